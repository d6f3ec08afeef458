"""The GPU check's dry run on the CPU: every step the GPU machine runs (the GPU tests, perf in both directions with
deferred values and CUDA graphs on and off, the benchmark, the profile of where the handoff's time goes), on the
2-layer stand-in and the tiny pair, into one table and its profile section; and its refusals before anything
runs."""

from __future__ import annotations

import json

import pytest
import torch
from benchworld import conversations, fit_maps, write_split

from kvlingo.inputs.models import ModelSpec, load_model, load_tokenizer
from kvlingo.records.saved import save_translator


@pytest.fixture(scope="module")
def bench_inputs(tiny_pair_paths, tmp_path_factory):
    """A test split and a trained-run folder (closed-form maps standing in for distilled ones) on the tiny pair."""
    root = tmp_path_factory.mktemp("gpu_check")
    large_p, small_p = tiny_pair_paths
    tok = load_tokenizer(ModelSpec.parse(str(small_p)))
    large = load_model(ModelSpec.parse(str(large_p)), "cpu", torch.float32)
    small = load_model(ModelSpec.parse(str(small_p)), "cpu", torch.float32)
    data = write_split(root / "data" / "tiny", tok, conversations(tok, 6, seed=1))
    cf, stand_in = fit_maps(large, small, conversations(tok, 10, seed=2), "prenorm", (1e-3, 1e-1))
    save_translator(root / "artifacts" / "t" / "closed_form", cf, {"direction": "l2s", "kind": "closed_form"})
    save_translator(root / "artifacts" / "t" / "distilled", stand_in, {"direction": "l2s", "kind": "distilled"})
    return [
        "--large",
        str(large_p),
        "--small",
        str(small_p),
        "--bench-profile",
        "tiny",
        "--bench-data",
        str(data),
        "--bench-artifacts",
        str(root / "artifacts"),
        "--bench-run",
        "t",
        "--bench-results",
        str(root / "none"),
    ]


@pytest.mark.slow
def test_the_dry_run_runs_every_step_into_one_table(bench_inputs, tmp_path, capsys):
    import gpu_check
    from kvlingo.stages.gpu_check import CONFIGS

    out = tmp_path / "gc"
    status = gpu_check.main(["--dry-run", "--out", str(out), *bench_inputs])
    printed = capsys.readouterr().out
    report = json.loads((out / "gpu-check.json").read_text())
    assert status == 0, [(s["step"], s["status"], s.get("tail", "")[-600:]) for s in report["steps"]]
    assert [s["step"] for s in report["steps"]] == ["tests", "perf-l2s", "perf-s2l", "benchmark", "profile"]
    rows = report["rows"]
    # per direction and length: the shipped re-prefill, then the optimised handoff with values deferred or
    # translated, CUDA graphs asked for or not (a CPU has none to replay)
    assert len(rows) == 2 * 2 * (len(CONFIGS) + 1) and not any(r.get("missing") for r in rows)
    assert {(r["direction"], r["context"]) for r in rows} == {(d, n) for d in ("l2s", "s2l") for n in (32, 64)}
    optimised = [r for r in rows if r["mode"] == "optimised"]
    assert {r["deferred"] for r in optimised} == {True, False} and not any(r["graphed"] for r in rows)
    assert {r["family"] for r in rows} == {"tokeninput"}  # the pilot profile's default (token input), both directions
    for r in rows:
        assert r["vs_eager"] > 0 and r["vs_eager_interval"][0] <= r["vs_eager"] <= r["vs_eager_interval"][1]
        assert len(r["handoff_trials_s"]) >= 2 and r["limit"] > 0
    md = (out / "gpu-check.md").read_text()
    head, profile = md.split("\n### Where the time goes", 1)  # the table and its notes, then the profile section
    table = [line for line in head.splitlines() if line.startswith("|")]
    assert len(table) == 2 + len(rows) and "vs eager SDPA re-prefill" in table[0]
    assert "GPU tests (pytest -m gpu" in md and "skipped" in md  # no GPU here: every one skips
    assert "toy demo benchmark (KL/token): closed_form" in md and "(passed)" in md
    assert md in printed and (out / "perf" / "s2l-defer-on-graphs-off" / "perf.json").is_file()
    # the profile: per direction and length, each phase of the handoff and the re-prefill with its CPU kernels
    profile = "### Where the time goes" + profile
    for direction in ("l2s", "s2l"):
        got = report["profile"][direction]
        assert got["peaks"]["source"].startswith("unknown device (cpu") and not got["peaks"]["datasheet"]
        assert got["translator"] == {
            "family": "tokeninput",
            "settings": got["translator"]["settings"],
            "refresh": "exact:0",
        }
        assert [p["context_tokens"] for p in got["lengths"]] == [32, 64]
        for point in got["lengths"]:
            assert list(point["phases"]) == ["translate", "new_turn", "reprefill"]
            for phase in point["phases"].values():
                assert phase["kernels"] and all(k["calls"] >= 1 and k["total_ms"] >= 0 for k in phase["kernels"])
                assert phase["median_s"] > 0 and phase["tflops_per_s"] > 0 and phase["over_floor"] > 0
        beside = (out / "perf" / f"profile-{direction}" / "profile.md").read_text()  # perf --kernels' own
        assert beside.startswith("## Where the time goes: tiny-") and "### Top kernels at 64 tokens" in beside
    assert profile.count("### Where the time goes") == 2 and profile.count("#### Top kernels at") == 4
    phase_rows = [line for line in profile.splitlines() if line.startswith(("| 32 ", "| 64 "))]
    kernel_rows = [line for line in profile.splitlines() if line.startswith("| ") and "aten::" in line]
    assert len(phase_rows) == 2 * 2 * 3 and len(kernel_rows) >= 2 * 2 * 3  # directions × lengths × phases
    assert {line.split("|")[1].strip() for line in kernel_rows} == {"translate", "new_turn", "reprefill"}


def test_it_names_what_is_missing_before_running_anything(tmp_path, capsys, monkeypatch):
    import gpu_check
    from kvlingo.stages import gpu_check as stage

    monkeypatch.setattr(stage, "pinned_transformers", lambda: (99, 0))
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--dry-run", "--out", str(tmp_path / "gc"), "--bench-data", str(tmp_path / "none")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and not (tmp_path / "gc").exists()
    assert err.startswith("gpu-check: not ready:\n  ")
    assert "transformers" in err and "older than the 99.0 pyproject.toml pins" in err and "pip download" in err
    assert f"{tmp_path / 'none'} is missing (make prepare PROFILE=demo makes it" in err
    assert stage.version_of("5.24.0.dev0") == (5, 24, 0) < stage.pinned_transformers()


@pytest.mark.parametrize("budget", ["0", "-10", "nan"])
def test_a_budget_that_is_not_positive_is_refused_at_parse_time(budget, tmp_path, capsys):
    import gpu_check

    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--budget-s", budget, "--dry-run", "--out", str(tmp_path / "gc")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--budget-s" in err and "> 0" in err and not (tmp_path / "gc").exists()


@pytest.mark.parametrize("flags, budget_s", [([], 1800.0), (["--budget-s", "30"], 30.0), (["--budget-s", "0.5"], 0.5)])
def test_the_budget_is_the_flag_given_else_the_default(flags, budget_s, tmp_path, monkeypatch, capsys):
    import time

    import gpu_check
    from kvlingo.stages import gpu_check as stage

    left = []

    def step(name, argv, deadline, log, factor=1.0):
        left.append(deadline - time.time())
        return {"step": name, "status": "passed", "tail": ""}

    monkeypatch.setattr(stage, "run_step", step)
    skip = ["--skip", "perf", "benchmark", "profile"]  # the tests step alone, stood in for by `step`
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path / "gc"), *skip, *flags]) == 0
    assert len(left) == 1 and budget_s - 60 < left[0] <= budget_s


def test_the_help_make_example_hands_the_shell_its_out_variable():
    """make reads `$OUT` as its variable `$O` then `UT` (`--out UT/gpu-check`): the example must survive make."""
    import shlex
    import subprocess
    from pathlib import Path

    from kvlingo.stages.gpu_check import GpuCheck

    root = Path(__file__).resolve().parents[2]
    lines = [e for e in GpuCheck.examples if e.startswith("make ") and "OUT" in e]
    assert lines, GpuCheck.examples
    for line in lines:
        made = subprocess.run(["make", "-n", *shlex.split(line)[1:]], cwd=root, capture_output=True, text=True)
        assert made.returncode == 0 and "--out $OUT/gpu-check" in made.stdout, (line, made.stdout, made.stderr)
