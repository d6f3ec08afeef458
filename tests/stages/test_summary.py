"""The summary stage: it refuses a run with no report, naming those that have some. The page itself, its figure,
its up-to-date check and its flags on cells of other maps are checked on a real run in tests/scripts/test_demo.py;
the commands a stage suggests in tests/records/test_paths.py."""

from __future__ import annotations

import pytest

from kvlingo.io import atomic_write_json


def test_a_run_without_reports_is_refused_naming_the_runs_that_have_some(tmp_path, capsys):
    import summary

    for run in ("demo-l2s", "demo-l2s-recipe/lr1.00e-03-s42"):
        atomic_write_json(tmp_path / "results" / run / "train.json", {"stage": "train"})
    roots = ["--results", str(tmp_path / "results"), "--artifacts", str(tmp_path / "artifacts")]
    with pytest.raises(SystemExit) as e:
        summary.main(roots)  # the pilot profile's run, pilot-l2s, as `make summary` without PROFILE=demo
    err = capsys.readouterr()
    assert e.value.code == 2 and err.out == "" and err.err.count("\n") == 1
    assert "pilot-l2s holds no report" in err.err
    assert "runs with reports under" in err.err and "demo-l2s, demo-l2s-recipe/lr1.00e-03-s42" in err.err
    assert "`make summary RUN=demo-l2s`" in err.err
    assert not (tmp_path / "results" / "pilot-l2s").exists()  # nothing written


def test_the_task_panel_says_not_run_and_reads_in_percent():
    """A run with a benchmark but no IFEval or task report: the figure's task panel says so and how to fill it, on
    a 0–100 axis."""
    from unittest import mock

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    from kvlingo.stages import summary

    texts, limits = [], []
    real_text, real_ylim = Axes.text, Axes.set_ylim

    def text(ax, *a, **k):
        texts.append(a[2] if len(a) > 2 else k.get("s"))
        return real_text(ax, *a, **k)

    def ylim(ax, *a, **k):
        limits.append(a)
        return real_ylim(ax, *a, **k)

    page = summary.Page.__new__(summary.Page)
    page.bench = {"n_samples": {"conversations": 4}}
    kl = {"mean": 0.5, "se": 0.1, "n": 4}
    table = {arm: [summary.Cell(arm), summary.Cell("0.5", kl)] + [summary.Cell("—")] * 5 for arm in summary.ARMS}
    with mock.patch.object(Axes, "text", text), mock.patch.object(Axes, "set_ylim", ylim):
        png = summary.plot(page, ["arm", "KL/token"], table, "t", "")
    assert png[:4] == b"\x89PNG"
    assert any(t and t.startswith("not run: no IFEval or task report") for t in texts), texts
    assert (0, 100) in limits, limits


# --------------------------------------------------------------------------- a run of sealed reports, written here
SPEED = {"source_cache_handoff": 2.147}


def write_run(root, tokens=(10, 10, 10), interval=(0.751, 3.22), noisy=True):
    """A run as the stages leave it: both translators' manifests, benchmark.json with its sealed
    benchmark.rows.jsonl (KL and NLL per conversation differ, tokens per conversation as given) and its timing;
    (results folder, artifacts folder)."""
    from kvlingo.eval import quality
    from kvlingo.io import atomic_write_jsonl, sha256_file
    from kvlingo.records.report import Report

    art, res = root / "artifacts" / "demo-l2s", root / "results" / "demo-l2s"
    shas = {}
    for kind in ("closed_form", "distilled"):
        atomic_write_json(art / kind / "manifest.json", {"maps_sha256": f"{kind}-maps"})
        shas[kind] = sha256_file(art / kind / "manifest.json")
    rows = []
    for i, t in enumerate(tokens):
        arms = {}
        for j, arm in enumerate(quality.ARMS):
            kl = 0.0 if arm == "native_target" else 0.01 * (j + 1) * (1 + i * i)
            arms[arm] = {"kl_sum": kl * t, "nll_sum": (1 + kl) * t, "top1_sum": 0.95 * t, "n_tokens": t}
            arms[arm].update(kl_mean=kl, nll_mean=1 + kl, top1=0.95)
        rows.append({"id": f"c{i}", "reply_tokens": t, "arms": arms})
    atomic_write_jsonl(res / "benchmark.rows.jsonl", rows)
    timing = {
        "translator": "distilled",
        "threads": 1,
        "contexts": [
            {
                "context_tokens": 100,
                "speedup": dict(SPEED),
                "speedup_interval": {"source_cache_handoff": list(interval)},
                "paths": {"target_reprefill": {"noisy": False}, "source_cache_handoff": {"noisy": noisy}},
            }
        ],
    }
    Report(
        "benchmark",
        config={"pair": None, "profile": "demo", "refresh": "none"},
        inputs={"test_split": {"sha256": "s"}, **{k: {"manifest_sha256": v} for k, v in shas.items()}},
        results={
            "quality": {**quality.summarize(rows), "control_translator": "distilled"},
            "timing": timing,
            "checks": {"controls_passed": True},
        },
        n_samples={"conversations": len(rows), "reply_tokens": sum(tokens)},
        wall_time_s=0.0,
        files={"benchmark.rows.jsonl": sha256_file(res / "benchmark.rows.jsonl")},
    ).write(res / "benchmark.json")
    return res, art, shas, rows


def write_task(res, name, shas, accuracy, n=20):
    """A task or IFEval report `name` (…-native: the native paths; else the distilled maps and the control)."""
    from kvlingo.records.report import Report

    native, ifeval = "-native" in name, name.startswith("ifeval")
    metric = "prompt_level_strict_acc" if ifeval else "accuracy"
    paths = ("native_source", "native_target", "no_context") if native else ("translated", "control")
    Report(
        "ifeval" if ifeval else "task",
        config={"translator": None if native else "distilled", "max_new_tokens": 8, "enable_thinking": False},
        inputs={} if native else {"translator_manifest_sha256": shas["distilled"]},
        results={"paths": {p: {metric: {"mean": accuracy, "se": 0.05, "n": n}} for p in paths}},
        n_samples={"prompts" if ifeval else "items": n},
        wall_time_s=0.0,
    ).write(res / f"{name}.json")


def table_of(res, art):
    from kvlingo.stages import summary

    page = summary.Page(res, art)
    headers, table = page.rows()
    return page, {arm: dict(zip(headers[1:], cells)) for arm, cells in table.items()}


def test_a_translator_moved_away_marks_only_its_own_cells_stale(tmp_path):
    """Only the closed-form maps are gone: their cells say (other maps); the distilled row, its speedup and the
    gate are judged as before."""
    res, art, _, _ = write_run(tmp_path)
    (art / "closed_form").rename(tmp_path / "closed_form_away")
    page, table = table_of(res, art)
    assert all("(other maps)" in table["closed_form"][h].text for h in ("KL/token", "KL/conv ± SE", "reply ppl"))
    assert not any(c.stale or "(other maps)" in c.text for c in table["distilled"].values())
    assert not table["distilled"]["speedup vs re-prefill"].stale
    assert set(page.stale) == {"benchmark"} and set(page.stale["benchmark"]) == {"closed_form"}
    verdict, passed = page.verdict()
    assert passed is not None, verdict  # judged: the distilled maps the benchmark scored are the run's


def test_the_speedup_cell_carries_its_interval_and_noisy_flag(tmp_path):
    res, art, _, _ = write_run(tmp_path / "a")
    _, table = table_of(res, art)
    cell = table["distilled"]["speedup vs re-prefill"].text
    assert cell == "2.15× (0.751–3.22; includes 1×; NOISY)", cell  # as benchmark.md: 2.147 | 0.751–3.22 | NOISY
    assert table["native_target"]["speedup vs re-prefill"].text == "—"
    res, art, _, _ = write_run(tmp_path / "b", interval=(10.3, 40.3), noisy=False)
    _, table = table_of(res, art)
    assert table["distilled"]["speedup vs re-prefill"].text == "2.15× (10.3–40.3)"


def test_task_columns_read_the_test_split_and_never_the_validation_one(tmp_path, capsys):
    """task-arc.json and task-arc-test.json: the column reads the test split for every arm; IFEval with only a
    test report reads it; GSM8K with only a validation report stays empty; the footer says which split."""
    import summary as script

    res, art, shas, _ = write_run(tmp_path)
    write_task(res, "task-arc", shas, 0.10)
    write_task(res, "task-arc-native", shas, 0.15)
    write_task(res, "task-arc-test", shas, 0.40)
    write_task(res, "task-arc-native-test", shas, 0.45)
    write_task(res, "ifeval-test", shas, 0.30)
    write_task(res, "task-gsm8k-validation", shas, 0.90)
    _, table = table_of(res, art)
    assert table["distilled"]["ARC %"].text == "40.0 ± 5.0 (n=20)"
    assert table["distilled"]["ARC %"].report == "task-arc-test.json"
    assert table["native_target"]["ARC %"].text == "45.0 ± 5.0 (n=20)"
    assert table["distilled"]["IFEval strict prompt %"].report == "ifeval-test.json"
    assert all(table[arm]["GSM8K %"].text == "—" for arm in table)
    script.main(["--profile", "demo", "--results", str(tmp_path / "results"), "--artifacts", str(art.parent)])
    md = (res / "summary.md").read_text()
    assert "validation reports are never read (IFEval: test split, ARC: test split, GSM8K: no report)" in md


def test_every_quality_cell_gives_mean_se_and_n(tmp_path):
    """KL/token and reply ppl with their SE over conversations (equal token counts: the per-conversation means'
    SE, stats.mean_se), KL/conv with its n; without the sealed rows file the cells say why there is no SE."""
    import math

    from kvlingo.eval.stats import mean_se
    from kvlingo.records.report import fmt_pm

    res, art, _, rows = write_run(tmp_path)
    _, table = table_of(res, art)
    kl = mean_se([r["arms"]["distilled"]["kl_mean"] for r in rows])
    nll = mean_se([r["arms"]["distilled"]["nll_mean"] for r in rows])
    ppl = {"mean": math.exp(nll["mean"]), "se": math.exp(nll["mean"]) * nll["se"]}
    d = table["distilled"]
    assert d["KL/token"].text == fmt_pm(kl, 1.0, ".4f") + " (n=3)" and " ± " in d["KL/token"].text
    assert d["KL/conv ± SE"].text == fmt_pm(kl, 1.0, ".4f") + " (n=3)"
    assert d["reply ppl"].text == fmt_pm(ppl, 1.0, ".3g", ".2g") + " (n=3)" and " ± " in d["reply ppl"].text
    (res / "benchmark.rows.jsonl").unlink()
    _, table = table_of(res, art)
    assert table["distilled"]["KL/token"].text.endswith("(n=3, no SE: benchmark.rows.jsonl missing or changed)")


def test_token_weighted_se_is_the_conversation_means_se_when_lengths_are_equal():
    from kvlingo.eval.stats import mean_se
    from kvlingo.stages.summary import token_weighted

    kls = [0.1, 0.4, 0.25, 0.05]
    rows = [{"arms": {"a": {"kl_sum": 7 * k, "n_tokens": 7}}} for k in kls]
    got, ref = token_weighted(rows, "a", "kl_sum"), mean_se(kls)
    assert got["n"] == 4 and abs(got["mean"] - ref["mean"]) < 1e-12 and abs(got["se"] - ref["se"]) < 1e-12


@pytest.mark.parametrize(
    "name, script, flags",
    [
        ("benchmark", "benchmark.py", []),
        ("ifeval", "ifeval.py", []),
        ("ifeval-native-test", "ifeval.py", ["--native", "--split test"]),
        ("task-gsm8k", "task_eval.py", ["--task gsm8k", "--resume"]),
        ("task-arc-native-test", "task_eval.py", ["--task arc", "--native", "--resume --split test"]),
    ],
)
def test_a_stale_report_is_named_with_the_make_command_that_writes_it_again(name, script, flags):
    """Each stale report's command, dry-run by make as typed, runs the stage that writes that report: its task, the
    native paths where the report is theirs, and the test split where the report read it."""
    import shlex
    import subprocess
    from pathlib import Path

    from kvlingo.stages.summary import rescore_command

    root = Path(__file__).resolve().parents[2]
    pair = {"large": "L", "small": "S", "direction": "l2s", "device": "cpu", "dtype": "float32"}
    command = rescore_command(name, "r", "tiny", pair)
    dry = subprocess.run(
        ["make", "-n", "--no-print-directory", *shlex.split(command)[1:]], cwd=root, capture_output=True, text=True
    )
    assert dry.returncode == 0, (command, dry.stderr)
    line = next(x for x in dry.stdout.splitlines() if f" {script} " in x and "--direction" in x)
    assert "--run r" in line and all(f in line for f in flags), (command, line)
    assert ("--split test" in line) == name.endswith("-test") and ("--native" in line) == ("native" in name), line
