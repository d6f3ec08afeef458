"""`make demo` in miniature: a mini toy world (seconds), then one pass through every stage in the
demo's order with the demo's flags, on the tiny profile, ending in the summary page; then a retrained
translator, which the page flags in every cell that scored the old maps."""

from __future__ import annotations

import pytest

from kvlingo.eval.tasks import grader as ifeval_grader
from kvlingo.io import read_json
from kvlingo.toy import train as toytrain
from summary import ARMS, LEGEND, summary_rows


@pytest.mark.slow
def test_every_stage_runs_on_a_mini_toy_world(tmp_path, monkeypatch, capsys):
    import benchmark
    import ifeval
    import prepare
    import recipe
    import switch_cost
    import task_eval
    import train_translator

    toy = tmp_path / "toy"
    toytrain.build_toy_world(toy, seed=0, mini=True, progress=False, log=lambda _m: None)
    nltk_home = tmp_path / "nltk_data"
    ifeval_grader.install_punkt(nltk_home)
    for k, v in {"NLTK_DATA": str(nltk_home), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)  # every stage writes under ./data, ./artifacts, ./results, as in the repo

    run = "mini-l2s"
    pair = [
        "--large",
        str(toy / "large"),
        "--small",
        str(toy / "small"),
        "--direction",
        "l2s",
        "--device",
        "cpu",
        "--dtype",
        "float32",
    ]
    stage = ["--profile", "tiny", "--run", run, *pair]
    data = ["--data", "data/tiny"]
    evals = ["--data-root", "data/toy-eval"]
    corpus = toy / "corpus"

    prepare.main(["--profile", "tiny", "--tokenizer", str(toy / "small"), "--source", str(corpus / "chats.jsonl")])
    train_translator.main([*stage, *data, "--lr", "1e-3", "--fit-weighting", "attention"])
    benchmark.main([*stage, *data, "--allow-cv"])
    switch_cost.main([*stage, *data, "--lengths", "120", "240", "--allow-cv"])
    ifeval.main(["--prepare", *evals, "--source", str(corpus / "ifeval.jsonl")])
    ifeval.main([*stage, *evals, "--native"])
    ifeval.main([*stage, *evals])
    for task in ("arc", "gsm8k"):
        task_eval.main(["--task", task, "--prepare", *evals, "--source", str(corpus / f"{task}.jsonl")])
        for mode in ("prompt", "trace"):
            for native in (["--native"], []):
                task_eval.main(["--task", task, "--handoff", mode, *stage, *evals, *native, "--resume"])
    recipe.main(
        [
            "--profile",
            "tiny",
            *data,
            "--run",
            f"{run}-recipe",
            *pair,
            "--ifeval-data-root",
            "data/toy-eval",
            "--quick",
            "--grid-size",
            "1",
            "--seeds",
            "42",
            "--max-extensions",
            "0",
            "--updates",
            "1",
            "--benchmark-args=--allow-cv --timing-conversations 1",
        ]
    )
    capsys.readouterr()

    results = tmp_path / "results" / run
    for name in (
        "train",
        "benchmark",
        "switch",
        "ifeval",
        "ifeval-native",
        "task-arc",
        "task-arc-native",
        "task-arc-trace",
        "task-gsm8k",
        "task-gsm8k-trace-native",
    ):
        report = read_json(results / f"{name}.json")
        assert report["env"]["device"] == "cpu", name
    assert read_json(tmp_path / "results" / f"{run}-recipe" / "recipe.json")["results"]["seeds"]

    headers, rows = summary_rows(results, tmp_path / "artifacts" / run)
    table = {r[0]: dict(zip(headers, r)) for r in rows}
    assert list(table) == list(ARMS)
    for arm in ARMS:  # every arm has a KL from the benchmark
        assert table[arm]["KL/token"] != "—", arm
    assert table["native_target"]["KL/token"].startswith("0.0000 ± 0.0000 (n=")  # the reference: KL 0, SE 0
    gen_columns = ("IFEval strict prompt %", "ARC %", "GSM8K %")
    for arm in ("native_source", "native_target", "distilled", "control", "no_context"):
        for col in gen_columns:  # the generation stages score the native paths, the handoff and both floors
            assert "(n=" in table[arm][col], (arm, col)
    assert all(table["closed_form"][col] == "—" for col in gen_columns)
    assert "× (" in table["distilled"]["speedup vs re-prefill"]  # the speedup and its 95% interval
    assert table["native_target"]["speedup vs re-prefill"] == "—"  # the native target re-prefills: nothing to beat

    # The page: table, maps, gate, legend and the figure it links; up to date until a report or translator changes.
    import summary

    summary.main(["--profile", "tiny", "--run", run])
    md = (results / "summary.md").read_text()
    page = read_json(results / "summary.json")
    assert "![KL and task accuracy per arm, ±1 SE](summary.png)" in md and "Evidence gate on the distilled maps" in md
    assert all(f"- {arm}: " in md for arm in LEGEND) and "±1 standard error" not in md  # said on the figure
    assert (results / "summary.png").read_bytes()[:4] == b"\x89PNG"
    assert "says little about a handoff's speed at real shapes" in md and "make perf" in md  # a toy context
    bench = read_json(results / "benchmark.json")["n_samples"]
    assert {k: page["n_samples"][k] for k in ("conversations", "reply_tokens")} == {
        k: bench[k] for k in ("conversations", "reply_tokens")
    }
    distilled = read_json(tmp_path / "artifacts" / run / "distilled" / "manifest.json")["maps_sha256"]
    assert f"distilled sha256 {distilled}" in md and page["results"]["stale"] == {}
    assert page["results"]["cells"]["distilled"]["GSM8K %"]["maps"]["maps_sha256"] == distilled
    assert page["results"]["evidence_gate"]["passed"] in (True, False)
    capsys.readouterr()
    summary.main(["--profile", "tiny", "--run", run])
    assert "summary.md is up to date (same reports and translators)" in capsys.readouterr().out

    train_translator.main([*stage, *data, "--lr", "1e-3", "--fit-weighting", "attention", "--updates", "2"])
    capsys.readouterr()
    summary.main(["--profile", "tiny", "--run", run])
    out = capsys.readouterr()
    assert "up to date" not in out.out and "cells marked (other maps)" in out.err
    page = read_json(results / "summary.json")
    stale = {h for h, c in page["results"]["cells"]["distilled"].items() if c["stale"]}
    assert stale == {
        "KL/token",
        "KL/conv ± SE",
        "reply ppl",
        "IFEval strict prompt %",
        "ARC %",
        "GSM8K %",
        "speedup vs re-prefill",
    }
    assert set(page["results"]["stale"]) == {"benchmark", "ifeval", "task-arc", "task-gsm8k"}
    assert page["results"]["evidence_gate"]["passed"] is None  # not judged on a benchmark of other maps
    md = (results / "summary.md").read_text()
    assert "make benchmark PROFILE=tiny RUN=mini-l2s" in md and "(other maps)" in md
