"""The perf stage: `make perf` end to end on the 2-layer stand-in (a smoke test with no timing assertions), its
flags checked at parse time and reaching the report, the FLOP ceilings of every family at preset shapes, perf on a
geometry head-wise maps refuse, the floors, and (on a GPU only) deferred values."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvlingo.bench import timing

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_make_perf_smoke(tmp_path):
    out = tmp_path / "perf"
    args = (
        f"--arch tiny --full --lengths 16 32 --new-turn-tokens 4 --timing-warmups 0 --timing-repeats 2 "
        f"--results {tmp_path}"
    )
    proc = subprocess.run(
        ["make", "-s", "perf", "DEVICE=cpu", f"PERF_ARGS={args}"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "perf.json").read_text())
    assert report["stage"] == "perf" and report["config"]["dtype"] == "float32"  # auto → FP32 on a CPU
    lengths = report["results"]["lengths"]
    assert [p["context_tokens"] for p in lengths] == [16, 32]
    assert report["config"]["modes"] == ["shipped", "optimised"] and report["config"]["threads"] >= 1
    # make asks torch for huge pages; the report's environment says so, and so does perf.md
    from kvlingo.stages.perf import huge_pages_note

    hp = report["env"]["huge_pages"]
    assert hp["torch_allocator"] is True
    note = huge_pages_note(report["config"]["device"], hp)
    assert note and note in next(line for line in proc.stdout.splitlines() if line.startswith("## Handoff speed"))
    for p in lengths:
        for mode in ("shipped", "optimised"):
            row = p["modes"][mode]
            assert set(row["paths"]) == {
                "target_reprefill",
                "source_cache_handoff",
                "source_prefill_handoff",
                "target_cache_continue",
            }
            for s in row["paths"].values():  # 2 trials, more only while the CV so far was over the limit
                t = s["trials_s"]
                assert 2 <= len(t) <= 30 and (len(t) == 2 or timing.cv(t[:-1]) > timing.CV_LIMIT)
            assert row["translation_gflops_per_s"] > 0 and row["vs_limit"]["speedup_fraction_of_limit"] > 0
            for name, (lo, hi) in row["speedup_interval"].items():  # every path against re-prefill
                assert lo <= row["speedup"][name] <= hi
            assert set(row["speedup_interval"]) == set(row["speedup"])
        assert p["modes"]["shipped"]["cache"] == "dynamic" and p["modes"]["optimised"]["cache"] == "preallocated"
        limit = p["limit"]
        assert limit["speedup_limit"] > 0 and limit["peaks"]["flops_per_s"] > 0
        assert limit["reprefill"]["flops"] > limit["new_turn"]["flops"] > 0  # n + k tokens against k
    assert len(report["results"]["switch_cost"]) == 4
    assert all(
        c["speedup_interval"][0] <= c["speedup"] <= c["speedup_interval"][1] for c in report["results"]["switch_cost"]
    )
    assert "95% interval" in proc.stdout and "percentile bootstrap" in proc.stdout
    assert (out / "perf.png").read_bytes()[:4] == b"\x89PNG"
    for heading in ("Where the existing-source handoff's time goes", "Physical limit", "| shipped ", "| optimised "):
        assert heading in proc.stdout


def test_perf_md_says_which_pages_a_cpu_timing_ran_on():
    from kvlingo.stages.perf import huge_pages_note

    def note(device, on, kernel):
        return huge_pages_note(device, {"torch_allocator": on, "kernel": kernel})

    assert note("cpu", True, "madvise") == ", huge pages (THP_MEM_ALLOC_ENABLE=1, kernel madvise)"
    assert note("cpu", True, "never") == ", 4 KiB pages (THP_MEM_ALLOC_ENABLE=1, kernel never)"
    assert note("cpu", False, "madvise") == ", 4 KiB pages (THP_MEM_ALLOC_ENABLE=unset or 0, kernel madvise)"
    assert note("cpu", False, "always") == ", huge pages (kernel always)"
    assert note("cuda", True, "madvise") == ""  # a GPU timing's tensors are not on the CPU


def test_perf_flags_name_the_paths_modes_and_pieces_timing_runs():
    """perf.py's parser names timing's paths, modes and the handoff's pieces without importing torch: the same."""
    from kvlingo.stages import perf

    assert (perf.PATHS, perf.MODES, perf.STAGES) == (timing.PATHS, timing.MODES, timing.STAGES)


def test_flop_ceilings_of_every_family_for_a_preset_pair(tmp_path, capsys):
    """--large/--small name preset shapes; families that cannot map the geometry say why, the others get a row
    per length whose ceiling is re-prefill ÷ translation FLOPs (the same numbers perf's timing rows use)."""
    import perf
    from kvlingo.core.families import FAMILIES

    perf.main(
        [
            "--large",
            "Qwen/Qwen3-4B",
            "--small",
            "Qwen/Qwen3-0.6B",
            "--flops-only",
            "--lengths",
            "1024",
            "4096",
            "--results",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert "36×8×128 → 28×8×128" in out and "headwise: cannot map this pair" in out and "--family crosslayer" in out
    report = json.loads((tmp_path / "perf" / "perf-flops.json").read_text())
    rows = report["results"]["flop_ceilings"]
    families = {r["family"] for r in rows}
    assert "crosslayer" in families and "headwise" not in families and families <= set(FAMILIES)
    for r in rows:
        assert r["reprefill_over_translation"] == pytest.approx(r["target_reprefill_dense"] / r["translation"])


def test_perf_refuses_unknown_shapes_and_half_named_pairs(tmp_path, capsys):
    import perf

    for argv, message in (
        (["--large", "Qwen/Qwen3-4B"], "give both --large and --small"),
        (["--large", "org/none", "--small", "Qwen/Qwen3-0.6B"], "no preset shape 'org/none'"),
    ):
        with pytest.raises(SystemExit) as err:
            perf.main([*argv, "--flops-only", "--results", str(tmp_path)])
        assert err.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_perf_times_a_family_on_another_geometry(tmp_path):
    """A Llama stand-in (3 layers, 1 KV head, head_dim 32, llama3 RoPE) → tiny Qwen3 (2 × 2 × 16): head-wise maps
    (--family headwise) refuse it before any model is built; cross-layer maps built through the registry are timed."""
    base = [
        sys.executable,
        "perf.py",
        "--large",
        "tiny-llama",
        "--small",
        "tiny-small",
        "--device",
        "cpu",
        "--lengths",
        "16",
        "--new-turn-tokens",
        "4",
        "--timing-warmups",
        "0",
        "--timing-repeats",
        "2",
        "--results",
        str(tmp_path),
    ]
    refused = subprocess.run(base + ["--family", "headwise"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert (
        refused.returncode == 2 and "building random" not in refused.stderr and "--family crosslayer" in refused.stderr
    )
    proc = subprocess.run(
        base + ["--family", "crosslayer", "--refresh", "tail:4"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "perf" / "perf.json").read_text())
    assert report["config"]["family"] == "crosslayer" and report["config"]["refresh"] == "tail:4"
    assert report["results"]["lengths"][0]["limit"]["speedup_limit"] > 0


def test_perf_says_when_a_step_beats_its_floor(tmp_path, capsys):
    """Peaks far below the machine's (given, not measured) make every floor longer than its step: perf.json lists
    the steps under `below_floor` and perf.md says the floors were not lower bounds on that run."""
    import perf

    perf.main(
        [
            "--arch",
            "tiny",
            "--lengths",
            "16",
            "--new-turn-tokens",
            "4",
            "--modes",
            "optimised",
            "--paths",
            "target_reprefill",
            "source_cache_handoff",
            "--timing-warmups",
            "0",
            "--timing-repeats",
            "1",
            "--peak-tflops",
            "1e-9",
            "--peak-gbps",
            "1e-6",
            "--device",
            "cpu",
            "--results",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    row = json.loads((tmp_path / "perf" / "perf.json").read_text())["results"]["lengths"][0]["modes"]["optimised"]
    assert set(row["vs_limit"]["below_floor"]) == {"translate", "new_turn", "reprefill"}
    assert all(r < 1 for r in row["vs_limit"]["below_floor"].values())
    assert "Faster than their floor" in out and "16 optimised translate" in out
    assert out.count("## FLOP ceilings") == 1  # printed before the timings, not again with them


def test_perf_raises_a_low_probe_so_no_step_beats_its_floor(tmp_path, capsys, monkeypatch):
    """A probe that reads far below the machine (stubbed at 1 FLOP/s and 1 byte/s): perf raises the peaks to the best
    rate a timed step reached, keeps the probe beside them, and no step is then faster than its floor; the step that
    set the FLOP peak sits exactly on it (one trial: its median is its best trial)."""
    import perf
    from kvlingo.bench.roofline import Peaks

    monkeypatch.setattr(
        "kvlingo.bench.roofline.measure_peaks", lambda device, dtype: Peaks(1.0, 1.0, "measured (stub)")
    )
    perf.main(
        [
            "--arch",
            "tiny",
            "--lengths",
            "16",
            "32",
            "--new-turn-tokens",
            "4",
            "--modes",
            "optimised",
            "--paths",
            "target_reprefill",
            "source_cache_handoff",
            "--timing-warmups",
            "0",
            "--timing-repeats",
            "1",
            "--device",
            "cpu",
            "--results",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "perf" / "perf.json").read_text())
    peaks = report["config"]["peaks"]
    assert peaks["probe"] == {"flops_per_s": 1.0, "bytes_per_s": 1.0, "source": "measured (stub)"}
    assert peaks["flops_per_s"] > 1e3 and peaks["bytes_per_s"] > 1e3 and "raised from the probe" in peaks["source"]
    ratios = []
    for p in report["results"]["lengths"]:
        assert p["limit"]["peaks"] == {k: v for k, v in peaks.items() if k != "probe"}
        row = p["modes"]["optimised"]
        assert row["vs_limit"]["below_floor"] == {}
        ratios += [v for k, v in row["vs_limit"].items() if k.endswith("_over_floor")]
    assert min(ratios) == pytest.approx(1.0, rel=1e-9) and all(r >= 1 - 1e-9 for r in ratios)
    assert "raised from the probe" in out and "Faster than their floor" not in out


def test_perf_fuse_keys_switch_reaches_the_optimised_rows(tmp_path):
    """--fuse-keys off times the optimised handoff with the exact key finish (`fp32` on a CPU); auto keeps the
    device's default (`fused` on a CPU), and the choice is recorded in the config."""
    import perf

    base = [
        "--arch",
        "tiny",
        "--lengths",
        "16",
        "--new-turn-tokens",
        "4",
        "--modes",
        "optimised",
        "--paths",
        "target_reprefill",
        "source_cache_handoff",
        "--timing-warmups",
        "0",
        "--timing-repeats",
        "1",
        "--peak-tflops",
        "1",
        "--peak-gbps",
        "1",
        "--device",
        "cpu",
    ]
    for switch, precision in (("off", "fp32"), ("auto", "fused")):
        perf.main([*base, "--fuse-keys", switch, "--results", str(tmp_path / switch)])
        rep = json.loads((tmp_path / switch / "perf" / "perf.json").read_text())
        row = rep["results"]["lengths"][0]["modes"]["optimised"]
        assert rep["config"]["fuse_keys"] == switch and row["precision"] == precision
        assert (row["fused_keys"] is None) == (precision == "fp32")


def test_perf_packs_the_targets_projections_in_the_optimised_rows_only(tmp_path, monkeypatch):
    """On a CPU the optimised rows run the target's projections on oneDNN-packed weights (the tiny models'
    only with the size floor lowered), the shipped rows never; perf.md says which, and how much it holds."""
    import perf
    from kvlingo.core import linear

    base = [
        "--arch",
        "tiny",
        "--lengths",
        "16",
        "--new-turn-tokens",
        "4",
        "--modes",
        "shipped",
        "optimised",
        "--paths",
        "target_reprefill",
        "source_cache_handoff",
        "--timing-warmups",
        "0",
        "--timing-repeats",
        "1",
        "--peak-tflops",
        "1",
        "--peak-gbps",
        "1",
        "--device",
        "cpu",
    ]
    perf.main([*base, "--results", str(tmp_path / "small")])
    text = (tmp_path / "small" / "perf" / "perf.md").read_text()
    assert "projections unpacked (every weight under 1,048,576 elements)" in text
    monkeypatch.setattr(linear, "MIN_WEIGHT", 0)
    perf.main([*base, "--results", str(tmp_path / "packed")])
    rep = json.loads((tmp_path / "packed" / "perf" / "perf.json").read_text())
    modes = rep["results"]["lengths"][0]["modes"]
    assert modes["shipped"]["packed_linear"] is None
    held = modes["optimised"]["packed_linear"]
    assert held["packed_layers"] > 0 and held["packed_bytes"] > 0 and held["failure"] is None
    text = (tmp_path / "packed" / "perf" / "perf.md").read_text()
    assert f"projections on oneDNN-packed weights (a second copy: target {held['packed_layers']} layers" in text


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--lengths", "0"], "--lengths"),
        (["--lengths", "1024", "-5"], "--lengths"),
        (["--new-turn-tokens", "0"], "--new-turn-tokens"),
        (["--timing-repeats", "0"], "--timing-repeats"),
        (["--timing-warmups", "-1"], "--timing-warmups"),
        (["--cv-limit", "-0.1"], "--cv-limit"),
        (["--max-seconds", "-1"], "--max-seconds"),
        (["--peak-tflops", "0"], "--peak-tflops"),
        (["--peak-gbps", "nan"], "--peak-gbps"),
    ],
)
def test_perf_refuses_a_bad_number_at_parse_time(argv, flag, capsys):
    import perf

    with pytest.raises(SystemExit) as e:
        perf.parse_args(["--arch", "tiny", *argv])
    assert e.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err


def test_cv_limit_zero_still_parses_to_flag_every_timing():
    import perf

    assert perf.parse_args(["--cv-limit", "0"]).cv_limit == 0.0  # benchmark's exit-path test relies on it


def test_perf_refuses_an_unwritable_results_folder_before_it_times_anything(tmp_path, capsys):
    import perf

    blocker = tmp_path / "results"
    blocker.write_text("a file where the results folder should be")
    with pytest.raises(SystemExit) as e:
        perf.main(["--arch", "tiny", "--device", "cpu", "--lengths", "32", "--results", str(blocker)])
    assert e.value.code == 2
    err = capsys.readouterr()
    assert "perf: cannot write to" in err.err and "--results" in err.err
    assert "GFLOP" not in err.out  # refused before the FLOP table, so before any timing
    assert blocker.read_text() == "a file where the results folder should be"


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
def test_perf_times_deferred_values_on_cuda(tmp_path):
    """perf.py on CUDA with deferred values asked for, on the 2-layer stand-in: the default family's optimised
    rows defer, replay as CUDA graphs with no capture failing, and the limit counts the deferred work."""
    import json

    import perf

    perf.main(
        [
            "--arch",
            "tiny",
            "--device",
            "cuda",
            "--lengths",
            "64",
            "--new-turn-tokens",
            "4",
            "--modes",
            "optimised",
            "--defer-values",
            "on",
            "--timing-warmups",
            "1",
            "--timing-repeats",
            "3",
            "--allow-cv",
            "--results",
            str(tmp_path),
        ]
    )
    point = json.loads((tmp_path / "perf" / "perf.json").read_text())["results"]["lengths"][0]
    row = point["modes"]["optimised"]
    assert row["deferred_values"] and not row["graph_errors"] and "new_turn" in row["cuda_graphs"]
    assert point["cost"]["deferred"] and point["cost"]["deferred_new_turn_flops"] > 0


def test_perf_timing_switches_reach_the_report(tmp_path, capsys):
    """--max-repeats caps the extra trials, --defer-values off keeps the values translated, --no-cuda-graphs is
    recorded; --strict-cv fails a CPU run on its CV flags (exit 1) after the report is written."""
    import perf

    argv = [
        "--arch",
        "tiny",
        "--lengths",
        "16",
        "--new-turn-tokens",
        "4",
        "--modes",
        "optimised",
        "--device",
        "cpu",
        "--timing-repeats",
        "2",
        "--timing-warmups",
        "0",
        "--max-repeats",
        "3",
        "--max-seconds",
        "0",
        "--defer-values",
        "off",
        "--no-cuda-graphs",
        "--peak-tflops",
        "1",
        "--peak-gbps",
        "1",
        "--results",
        str(tmp_path),
        "--cv-limit",
        "0",
        "--strict-cv",
    ]
    with pytest.raises(SystemExit) as e:
        perf.main(argv)
    assert e.value.code == 1 and "perf: checks failed: CV > 0" in capsys.readouterr().err
    report = json.loads((tmp_path / "perf" / "perf.json").read_text())
    cfg, row = report["config"], report["results"]["lengths"][0]["modes"]["optimised"]
    assert cfg["max_repeats"] == 3 and cfg["defer_values"] == "off" and cfg["cuda_graphs"] is False
    assert row["deferred_values"] is False and not cfg["allow_cv"]
    assert all(2 <= s["n"] <= 3 for s in row["paths"].values())  # a CV of 0 is never met: the cap ends the trials


def test_perf_profile_writes_its_tables_beside_the_report_and_refuses_flops_only(tmp_path, capsys):
    """--kernels: profile.json and profile.md beside perf.json, both hashed in its `files`, one point per length
    with the handoff's phases and the re-prefill, on a CPU at the run's own peaks ("unknown device"); with
    --flops-only (nothing timed) it is refused before anything is written."""
    import perf
    from kvlingo.io import sha256_file

    tiny = ["--arch", "tiny", "--device", "cpu", "--new-turn-tokens", "4", "--results", str(tmp_path)]
    argv = [*tiny, "--lengths", "16", "24", "--timing-repeats", "2", "--timing-warmups", "0", "--max-repeats", "2"]
    perf.main([*argv, "--kernels"])
    printed = capsys.readouterr().out
    res = tmp_path / "perf"
    report, got = (json.loads((res / name).read_text()) for name in ("perf.json", "profile.json"))
    assert report["config"]["profile"] is True
    for name in ("profile.json", "profile.md"):
        assert report["files"][name] == sha256_file(res / name)
    assert got["device"] == "cpu" and got["peaks"]["source"].startswith("unknown device (cpu")
    assert got["translator"]["family"] == report["config"]["family"] and got["translator"]["refresh"] == "exact:0"
    assert [p["context_tokens"] for p in got["lengths"]] == [16, 24]
    assert all(list(p["phases"]) == ["translate", "new_turn", "reprefill"] for p in got["lengths"])
    assert (res / "profile.md").read_text() in printed and "profile.md (--kernels)" in (res / "perf.md").read_text()
    with pytest.raises(SystemExit) as e:
        perf.main([*tiny, "--flops-only", "--kernels", "--results", str(tmp_path / "none")])
    assert e.value.code == 2 and "--flops-only times nothing" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()
