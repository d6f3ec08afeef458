"""The benchmark stage on the tiny pair: every row of its report, up to date unless its inputs change, a
nonzero exit after writing when checks fail, and the validation and train splits scored."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from benchworld import pair_args

from kvlingo.bench import timing
from kvlingo.eval import quality
from kvlingo.io import read_json, read_jsonl, sha256_file

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- the stage scripts
def run_script(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_benchmark_script_writes_every_row(bench_setup):
    out = bench_setup["root"] / "results_ok"
    proc = run_script(
        [
            "benchmark.py",
            "--data",
            str(bench_setup["data"]),
            "--run",
            "t",
            "--artifacts",
            str(bench_setup["art"]),
            "--results",
            str(out),
            "--dtype",
            "float32",
            "--timing-repeats",
            "3",
            "--timing-warmups",
            "1",
            "--new-turn-tokens",
            "4",
            "--allow-cv",
            *pair_args(bench_setup),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = out / "t"
    rep = read_json(out / "benchmark.json")
    assert rep["stage"] == "benchmark" and rep["schema_version"] == 3
    res = rep["results"]
    arms = res["quality"]["arms"]
    assert list(arms) == list(quality.ARMS)
    n_tokens = sum(len(c["reply_ids"]) for c in bench_setup["test"])
    for m in arms.values():
        assert m["n_conversations"] == 6 and m["n_tokens"] == n_tokens
        assert m["kl_conversation"]["n"] == 6 and math.isfinite(m["kl_conversation"]["se"])
    assert arms["native_target"]["kl_token_mean"] == 0.0 and arms["native_target"]["nll_delta_vs_native_target"] == 0.0
    # fitted maps carry the conversation: they beat the same maps on another conversation's cache, and the floor
    assert arms["control"]["kl_token_mean"] > arms["closed_form"]["kl_token_mean"]
    assert arms["no_context"]["kl_token_mean"] > arms["closed_form"]["kl_token_mean"]
    assert set(res["quality"]["paired"]) >= {
        "distilled_vs_native_target",
        "closed_form_vs_native_target",
        "distilled_vs_control",
    }
    rows = read_jsonl(out / "benchmark.rows.jsonl")
    assert [r["id"] for r in rows] == [c["id"] for c in bench_setup["test"]]
    assert all(r["id"] not in r["control_pairing"]["ids"] for r in rows)
    for d in ("bfloat16", "float32"):
        c = res["controls"][d]
        assert c["reconstruction"]["passed"] == c["identity"]["passed"] == 6 and c["tolerances"]["dtype"] == d
    t = res["timing"]["contexts"][0]
    assert t["id"] == max(bench_setup["test"], key=lambda c: len(c["prefix_ids"]))["id"]
    assert set(t["paths"]) == set(timing.PATHS) and all(len(s["trials_s"]) == 3 for s in t["paths"].values())
    assert set(t["breakdown"]) == set(timing.STAGES) and set(t["speedup"]) == set(timing.PATHS[1:])
    assert set(t["speedup_interval"]) == set(t["speedup"]) and "95% interval" in proc.stdout
    assert res["checks"]["passed"] and rep["files"]["benchmark.rows.jsonl"] == sha256_file(out / "benchmark.rows.jsonl")
    assert rep["config"]["pair"]["device"] == "cpu" and rep["env"]["threads"] >= 1 and res["timing"]["threads"] >= 1
    assert "| distilled" in (out / "benchmark.md").read_text() and "| distilled" in proc.stdout


def test_finished_report_is_not_redone_unless_inputs_change(bench_setup, monkeypatch, capsys):
    import benchmark

    # other kvlingo modules may change while this runs; pin the code hash so only our inputs vary
    monkeypatch.setattr("kvlingo.records.resume.code_hash", lambda *a: "pinned")
    results = bench_setup["root"] / "results_resume"
    out = results / "t"
    args = [
        "--data",
        str(bench_setup["data"]),
        "--run",
        "t",
        "--artifacts",
        str(bench_setup["art"]),
        "--results",
        str(results),
        "--dtype",
        "float32",
        "--control-dtypes",
        "float32",
        "--limit",
        "2",
        "--timing-conversations",
        "0",
        *pair_args(bench_setup),
    ]
    benchmark.main(args)
    first = read_json(out / "benchmark.json")
    assert first["results"]["timing"] is None and first["n_samples"]["conversations"] == 2
    capsys.readouterr()
    benchmark.main(args)
    assert "up to date" in capsys.readouterr().out
    assert read_json(out / "benchmark.json")["created_unix"] == first["created_unix"]
    benchmark.main(args + ["--limit", "3"])  # a changed config re-runs
    assert read_json(out / "benchmark.json")["n_samples"]["conversations"] == 3


def test_failed_checks_exit_nonzero_after_writing(bench_setup, capsys):
    import benchmark

    out = bench_setup["root"] / "results_fail"
    with pytest.raises(SystemExit) as exc:
        benchmark.main(
            [
                "--data",
                str(bench_setup["data"]),
                "--run",
                "t",
                "--artifacts",
                str(bench_setup["cf_only"]),
                "--results",
                str(out),
                "--dtype",
                "bfloat16",
                "--control-dtypes",
                "bfloat16",
                "--skip-missing",
                "--tolerance-scale",
                "-1",
                "--cv-limit",
                "0",
                "--limit",
                "3",
                "--timing-repeats",
                "2",
                "--timing-warmups",
                "0",
                "--new-turn-tokens",
                "4",
                *pair_args(bench_setup),
            ]
        )
    last = capsys.readouterr().err.splitlines()[-1]  # after the progress bars: one line
    assert exc.value.code == 1 and last.startswith("benchmark: checks failed: "), last
    res = read_json(out / "t" / "benchmark.json")["results"]
    assert not res["checks"]["passed"] and not res["checks"]["controls_passed"] and res["checks"]["noisy_timings"]
    assert any("CV" in f for f in res["checks"]["failed"]) and any(
        "reconstruction" in f for f in res["checks"]["failed"]
    )
    assert "distilled" not in res["quality"]["arms"] and res["quality"]["control_translator"] == "closed_form"
    assert res["quality"]["skipped"] == ["distilled"]
    # a missing artifact without --skip-missing: a clear error before any model is loaded
    capsys.readouterr()
    with pytest.raises(SystemExit) as missing:
        benchmark.main(
            [
                "--data",
                str(bench_setup["data"]),
                "--run",
                "t",
                "--artifacts",
                str(bench_setup["cf_only"]),
                *pair_args(bench_setup),
            ]
        )
    err = capsys.readouterr().err
    assert missing.value.code == 2 and err.count("\n") == 1 and err.startswith("benchmark: no trained translator"), err
    assert "make train" in err and "--skip-missing" in err
    with pytest.raises(SystemExit) as help_exit:
        benchmark.main(["--help"])
    assert help_exit.value.code == 0 and "examples" in capsys.readouterr().out


def test_benchmark_scores_the_validation_and_train_splits(tiny_pair_paths, tmp_path):
    from tinypair import task_inputs

    import benchmark
    import train_translator

    data, _ = task_inputs(tmp_path, tiny_pair_paths[0])
    common = [
        "--profile",
        "tiny",
        "--data",
        str(data),
        "--large",
        str(tiny_pair_paths[0]),
        "--small",
        str(tiny_pair_paths[1]),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--run",
        "r",
        "--artifacts",
        str(tmp_path / "a"),
        "--results",
        str(tmp_path / "r"),
    ]
    train_translator.main([*common, "--family", "headwise", "--updates", "1", "--n-fit", "12"])
    for split in ("validation", "train"):
        benchmark.main(
            [*common, "--split", split, "--timing-conversations", "0", "--control-dtypes", "none", "--limit", "5"]
        )
    val = read_json(tmp_path / "r" / "r" / "benchmark-validation.json")
    train = read_json(tmp_path / "r" / "r" / "benchmark-train.json")
    assert val["config"]["split"] == "validation" and "validation_split" in val["inputs"]
    assert train["n_samples"]["conversations"] == 5 and "train_split" in train["inputs"]
    assert not (tmp_path / "r" / "r" / "benchmark.json").exists()  # the test split's report is untouched
    arms = val["results"]["quality"]["arms"]
    native = arms["native_target"]
    assert native["context_kl_token_mean"] == 0 if native["context_tokens"] else native["context_tokens"] == 0
    assert 0 < arms["distilled"]["attention_cosine"]["mean"] <= 1 and arms["distilled"]["attention_cosine"]["n"] == 5


def test_a_missing_data_folder_is_refused_with_a_command_for_the_stage_s_profile(tiny_pair_paths, tmp_path, capsys):
    """Once, `benchmark.py --profile tiny --data /x/data` said `make prepare PROFILE=data, or prepare.py --profile
    data ...`: a profile named after the folder, which is none. The hint names --profile's, and the folder given."""
    import re

    from stagecli import refused

    import benchmark
    from kvlingo.inputs.profiles import PROFILES

    large, small = (str(p) for p in tiny_pair_paths)
    flags = ["--profile", "tiny", "--large", large, "--small", small, "--device", "cpu", "--skip-missing"]
    flags += ["--artifacts", str(tmp_path / "a"), "--results", str(tmp_path / "r")]
    for folder, out, then in ((tmp_path / "data", tmp_path / "data", True), (tmp_path / "tiny", tmp_path, False)):
        err = refused(benchmark.main, [*flags, "--data", str(folder)], capsys)
        named = re.findall(r"(?:--profile |PROFILE=)([^\s`]+)", err)
        assert named and set(named) == {"tiny"} <= set(PROFILES), err
        assert f"`.venv/bin/python prepare.py --profile tiny --out {out}`" in err, err
        assert (f"then pass --data {folder / 'tiny'}" in err) == then, err
