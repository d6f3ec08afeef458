"""`make perf` end to end on the 2-layer stand-in: a smoke test with no timing assertions."""

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_make_perf_smoke(tmp_path):
    out = tmp_path / "perf"
    args = (f"--arch tiny --lengths 16 32 --new-turn-tokens 4 --timing-warmups 0 --timing-repeats 2 "
            f"--results {tmp_path}")
    proc = subprocess.run(["make", "-s", "perf", "DEVICE=cpu", f"PERF_ARGS={args}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "perf.json").read_text())
    assert report["stage"] == "perf" and report["config"]["dtype"] == "float32"  # auto → FP32 on a CPU
    lengths = report["results"]["lengths"]
    assert [p["context_tokens"] for p in lengths] == [16, 32]
    assert report["config"]["modes"] == ["shipped", "optimised"] and report["config"]["threads"] >= 1
    for p in lengths:
        for mode in ("shipped", "optimised"):
            row = p["modes"][mode]
            assert set(row["paths"]) == {"target_reprefill", "source_cache_handoff", "source_prefill_handoff",
                                         "target_cache_continue"}
            assert all(len(s["trials_s"]) == 2 for s in row["paths"].values())
            assert row["translation_gflops_per_s"] > 0 and row["vs_limit"]["speedup_fraction_of_limit"] > 0
        assert p["modes"]["shipped"]["cache"] == "dynamic" and p["modes"]["optimised"]["cache"] == "preallocated"
        limit = p["limit"]
        assert limit["speedup_limit"] > 0 and limit["peaks"]["flops_per_s"] > 0
        assert limit["reprefill"]["flops"] > limit["new_turn"]["flops"] > 0  # n + k tokens against k
    assert len(report["results"]["switch_cost"]) == 4
    assert (out / "perf.png").read_bytes()[:4] == b"\x89PNG"
    for heading in ("Where the existing-source handoff's time goes", "Physical limit", "| shipped ", "| optimised "):
        assert heading in proc.stdout
