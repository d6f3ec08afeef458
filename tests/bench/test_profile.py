"""Where the handoff's time goes (kvlingo/bench/profile.py): the achieved-rate arithmetic against hand-computed
values, the datasheet peaks by device name, the kernel table from profiler events, a profiled matmul named as the
matmul, the eager stand-in for a replay the profiler cannot see into, and a profiled handoff on the 2-layer
stand-in pair (its phases, its kernels, its FLOPs as the physical limit counts them plus exact:0's layer 0). No
timed assertions."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from kvlingo.bench import profile, timing
from kvlingo.bench.roofline import Peaks


def test_achieved_rates_and_floors_are_the_hand_computed_ones():
    # 2 TFLOP and 1 GB in 0.5 s: 4 TFLOP/s and 2 GB/s; at 10 TFLOP/s and 100 GB/s the compute floor (0.2 s) beats
    # the memory floor (0.01 s), so 0.5 s is 2.5× the floor, 40% of the peak FLOP/s and 2% of the bandwidth
    r = profile.rates(2e12, 1e9, 0.5, Peaks(10e12, 100e9, "given"))
    assert r["tflops_per_s"] == pytest.approx(4.0) and r["gb_per_s"] == pytest.approx(2.0)
    assert r["floor_s"] == pytest.approx(0.2) and r["bound"] == "compute" and r["over_floor"] == pytest.approx(2.5)
    assert r["share_of_peak_flops"] == pytest.approx(0.4) and r["share_of_peak_bytes"] == pytest.approx(0.02)
    # a memory-bound step: 1 GFLOP and 4 GB in 0.1 s at the same peaks → floor 0.04 s of memory, 2.5× it
    m = profile.rates(1e9, 4e9, 0.1, Peaks(10e12, 100e9, "given"))
    assert m["bound"] == "memory" and m["floor_s"] == pytest.approx(0.04) and m["over_floor"] == pytest.approx(2.5)
    assert set(profile.rates(1.0, 1.0, 1.0)) == {"flops", "bytes", "seconds", "tflops_per_s", "gb_per_s"}


@pytest.mark.parametrize(
    "name, dtype, tflops, gbps",
    [
        ("NVIDIA H100 80GB HBM3", "bfloat16", 989.0, 3350.0),
        ("NVIDIA H100 PCIe", "bfloat16", 756.0, 2000.0),
        ("NVIDIA H100 NVL", "float16", 835.0, 3900.0),
        ("NVIDIA H200", "bfloat16", 989.0, 4800.0),
        ("NVIDIA H200 NVL", "bfloat16", 835.0, 4800.0),
        ("NVIDIA H200", "float32", 67.0, 4800.0),
    ],
)
def test_datasheet_peaks_by_device_name(name, dtype, tflops, gbps):
    peaks = profile.datasheet_peaks(name, dtype)
    assert (peaks.flops_per_s, peaks.bytes_per_s) == (tflops * 1e12, gbps * 1e9) and name in peaks.source


def test_a_device_the_datasheet_does_not_name_is_unknown_and_keeps_the_run_peaks():
    run = Peaks(3e12, 4e11, "measured on cuda")
    for name in ("NVIDIA GH200 480GB", "NVIDIA A100-SXM4-80GB", "cpu (x86_64)"):
        assert profile.datasheet_peaks(name, "bfloat16") is None
        peaks, datasheet = profile.floors_peaks(name, "bfloat16", run)
        assert not datasheet and (peaks.flops_per_s, peaks.bytes_per_s) == (3e12, 4e11)
        assert peaks.source.startswith(f"unknown device ({name})") and "measured on cuda" in peaks.source
    assert profile.floors_peaks("NVIDIA H200", "bfloat16", run)[1]


def test_the_sxm_datasheet_tflops_are_the_ones_the_memory_estimate_uses():
    from kvlingo.train.footprint import DEVICES

    for gpu in ("H100", "H200"):
        peaks = profile.datasheet_peaks(f"NVIDIA {gpu}", "bfloat16")
        assert peaks.flops_per_s == DEVICES[gpu]["bf16"] * 1e12
        assert profile.datasheet_peaks(f"NVIDIA {gpu}", "float32").flops_per_s == DEVICES[gpu]["fp32"] * 1e12


def _event(name, device, us, annotation=False):
    cpu = device == DeviceType.CPU
    return SimpleNamespace(
        name=name,
        device_type=device,
        is_async=False,
        is_user_annotation=annotation,
        self_cpu_time_total=us if cpu else 0.0,
        self_device_time_total=0.0 if cpu else us,
    )


def test_kernel_table_sums_each_kernels_calls_and_self_time_over_the_trials():
    cuda, cpu = DeviceType.CUDA, DeviceType.CPU
    events = [
        _event("gemm", cuda, 300.0),
        _event("gemm", cuda, 500.0),
        _event("copy", cuda, 100.0),
        _event("norm", cuda, 100.0),
        _event("ProfilerStep#1", cuda, 9e6, annotation=True),  # a user annotation's span is no kernel
        _event("aten::mm", cpu, 50.0),  # the host's side: not the device's kernels
    ]
    t = profile.kernel_table(events, on_device=True, trials=2, top=2)
    assert t["busy_ms_per_step"] == pytest.approx(0.5) and t["distinct_kernels"] == 3  # 1,000 µs over 2 trials
    assert [(k["name"], k["calls"]) for k in t["kernels"]] == [("gemm", 2), ("copy", 1)]  # top 2 by total time
    assert t["kernels"][0]["total_ms"] == pytest.approx(0.8) and t["kernels"][0]["share"] == pytest.approx(0.8)
    host = profile.kernel_table(events, on_device=False, trials=1)
    assert host["kernels"] == [{"name": "aten::mm", "calls": 1, "total_ms": 0.05, "share": 1.0}]


def test_a_profiled_matmul_is_named_as_the_matmul():
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    t = profile.profile_calls(lambda: a @ b, "cpu", trials=3)
    top = t["kernels"][0]
    assert top["name"] == "aten::mm" and top["calls"] == 3 and top["share"] > 0.5
    assert sum(k["share"] for k in t["kernels"]) == pytest.approx(1.0) and t["busy_ms_per_step"] > 0


def test_a_replay_the_profiler_sees_nothing_of_takes_the_eager_runs_kernels_and_a_failure_keeps_the_timings(
    monkeypatch,
):
    seen = {"replayed": {"busy_ms_per_step": 0.0, "distinct_kernels": 0, "kernels": []}}
    eager_table = {"busy_ms_per_step": 1.0, "distinct_kernels": 1, "kernels": [{"name": "gemm"}]}
    monkeypatch.setattr(profile, "profile_calls", lambda fn, *a: seen.get(fn(), eager_table))
    settings = profile.ProfileSettings(warmups=0, timed=2, profiled=1)
    row = profile.profile_phase(lambda: "replayed", "cpu", settings, eager=lambda: "eager")
    assert row["kernels"] == [{"name": "gemm"}] and row["kernels_from"].startswith("run eagerly")
    assert len(row["trials_s"]) == 2 and row["median_s"] > 0
    alone = profile.profile_phase(lambda: "replayed", "cpu", settings)  # no eager stand-in: nothing to show
    assert alone["kernels"] == [] and alone["kernels_from"] == "as timed"

    def broken(*_):
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")

    monkeypatch.setattr(profile, "profile_calls", broken)  # a failing profiler keeps the phase's timings
    row = profile.profile_phase(lambda: "replayed", "cpu", settings)
    assert row["kernels"] == [] and len(row["trials_s"]) == 2
    assert row["kernels_from"] == "none: the profiler failed (RuntimeError: CUPTI_ERROR_NOT_INITIALIZED)"


@pytest.fixture(scope="module")
def stand_in():
    """The 2-layer stand-in pair (l2s) and the pilot profile's default translator at its shapes."""
    from kvlingo.bench.random_pair import random_pair, random_translator
    from kvlingo.core.settings import Geometry
    from kvlingo.inputs.profiles import get_profile
    from kvlingo.train.config import resolve_family

    pair = random_pair("tiny", "l2s", "cpu", torch.float32)
    family, settings = resolve_family(get_profile("pilot"), "l2s", None, {}, Geometry.of(pair.source, pair.target))
    return pair, random_translator(pair.source, pair.target, family=family, settings=settings)


def test_a_profiled_handoff_names_each_phases_kernels_and_counts_exact_layer0(stand_in):
    from kvlingo.bench.roofline import handoff_work, layer0_work
    from kvlingo.core.settings import Refresh

    pair, maps = stand_in
    settings = profile.ProfileSettings(warmups=1, timed=2, profiled=1)
    options = timing.PathOptions(defer_values=False, refresh=Refresh.parse("exact:0"))
    point = profile.profile_at_length(
        pair.source, pair.target, maps, 24, 4, options, Peaks(1e11, 1e10, "given"), settings
    )
    assert list(point["phases"]) == ["translate", "new_turn", "reprefill"] and not point["deferred_values"]
    for phase in point["phases"].values():
        assert phase["kernels"] and phase["kernels"][0]["calls"] >= 1 and not phase["graphed"]
        assert all(k["name"].startswith("aten::") for k in phase["kernels"])  # a CPU's kernels: its ops
        assert phase["tflops_per_s"] > 0 and phase["over_floor"] > 0
    mm = {k["name"] for k in point["phases"]["reprefill"]["kernels"]}
    assert "aten::mm" in mm or "aten::addmm" in mm
    work = handoff_work(pair.source, pair.target, maps, 24, 4, torch.float32)
    layer0 = layer0_work(pair.target, 24, torch.float32)
    assert point["phases"]["translate"]["flops"] == work["translation"][0] + layer0[0]
    assert point["phases"]["reprefill"]["flops"] == work["reprefill"][0]
    assert point["phases"]["new_turn"]["bytes"] == work["new_turn"][1]
    plain = profile.phase_work(pair.source, pair.target, maps, 24, 4, torch.float32, False, Refresh.parse("none"))
    assert plain["translate"] == work["translation"]  # no exact:0, no layer 0 to count


def test_the_profile_markdown_has_a_phase_row_and_kernel_rows_per_length(stand_in):
    from kvlingo.core.settings import Refresh

    pair, maps = stand_in
    settings = profile.ProfileSettings(warmups=0, timed=1, profiled=1, top=3)
    options = timing.PathOptions(refresh=Refresh.parse("exact:0"))
    peaks = Peaks(1e11, 1e10, "given")
    points = [
        profile.profile_at_length(pair.source, pair.target, maps, n, 4, options, peaks, settings) for n in (16, 24)
    ]
    cfg = SimpleNamespace(
        device="cpu",
        source="tiny-large",
        target="tiny-small",
        direction="l2s",
        dtype="float32",
        family=maps.family,
        family_settings={},
        refresh=Refresh.parse("exact:0"),
        cuda_graphs=False,
        defer_values="auto",
    )
    report = profile.profile_report(cfg, "cpu (test)", peaks, False, settings, points)
    md = profile.markdown(report, top=2)
    assert md.startswith("## Where the time goes: tiny-large → tiny-small (l2s, float32, cpu (test))")
    for n in (16, 24):
        assert f"Top kernels at {n} tokens" in md
        assert sum(line.startswith(f"| {n} ") for line in md.splitlines()) == 3  # translate, new turn, re-prefill
    kernel_rows = [line for line in md.splitlines() if line.startswith("| ") and "aten::" in line]
    assert len(kernel_rows) == 2 * 3 * 2  # two lengths, three phases, the top two each


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_profiled_cuda_matmul_is_a_gemm_kernel_graphed_or_not():
    """On a GPU the kernels are the device's: a BF16 matmul's top kernel is cuBLAS's GEMM (sm90_xmma_gemm_*,
    nvjet_*, cutlass_*), whether it runs eagerly or replayed from a CUDA graph (or, if the profiler sees nothing
    of the replay, from the eager stand-in)."""
    from kvlingo.bench import graphs

    a, b = (torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty(2048, 2048, device="cuda", dtype=torch.bfloat16)

    def step():
        return torch.matmul(a, b, out=out)

    def gemm(name: str) -> bool:
        return any(word in name.lower() for word in ("gemm", "nvjet", "cutlass", "xmma"))

    eager = profile.profile_calls(step, "cuda", trials=3)
    assert gemm(eager["kernels"][0]["name"]) and eager["kernels"][0]["calls"] == 3, eager["kernels"][:3]
    with torch.inference_mode():
        replay = graphs.capture(step, "cuda")
    row = profile.profile_phase(replay, "cuda", profile.ProfileSettings(warmups=1, timed=2, profiled=2), eager=step)
    assert gemm(row["kernels"][0]["name"]), (row["kernels_from"], row["kernels"][:3])
    name = torch.cuda.get_device_name(0)
    assert profile.floors_peaks(name, "bfloat16", Peaks(1.0, 1.0, "run"))[1] == bool(
        profile.datasheet_peaks(name, "bfloat16")
    )
