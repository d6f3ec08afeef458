"""Where the handoff's time goes: each phase under torch.profiler, its top kernels, and its rates against the floors.

perf.py --kernels looks inside the optimised handoff from an existing source cache at each context length,
one phase at a time, on the pair and translator it timed:

    translate  the translation written into the target's cache; under the default translator (token input
               with exact:0) that includes the target's exact layer 0 and the token features its maps read
    new_turn   the target's forward of the k-token new turn on that cache
    reprefill  the target re-reading the context and the new turn (what the handoff saves)

Each phase runs `warmups` untimed calls, then `timed` trials bracketed by device syncs (the time per step
is their median, outside the profiler, which slows the host's launches), then `profiled` trials under
torch.profiler. Its kernels are the device's on a GPU (CUDA kernels, copies and memsets by self device
time) and the aten ops' on a CPU (by self CPU time): each one's calls, total over the profiled trials and
share of their sum, the phase's busy time. A phase replayed as a CUDA graph is timed as replayed; where
the profiler sees no kernels in the replay, its kernels come from the same phase run eagerly (same kernels,
other launch gaps), and the report says so.

Achieved rates are FLOPs and bytes over the time per step: the physical limit's counts
(`roofline.handoff_work`, what perf's limit counts) and, under exact:0, the target's layer-0 projections
(`roofline.layer0_work`), so translate's FLOPs still count the one layer exact:0 computes instead (at most
1/layers of the maps). The floors are those counts at the device's peaks (`roofline.step_floor`): the
datasheet's (`DATASHEET`) for a GPU named there, otherwise ("unknown device") the peaks the perf run
measured and raised to what its own steps reached.
"""

from __future__ import annotations

import platform
import re
from dataclasses import asdict, dataclass, replace

import torch

from ..core.handoff import refreshing
from ..eval.stats import cv, median
from . import packing, timing
from .roofline import Peaks, handoff_work, layer0_work, step_floor, synchronize
from .speed import context_ids

PHASES = {"translate": "translate", "new_turn": "new_turn", "reprefill": "target_reprefill"}  # phase → its step
WORK = {"translate": "translation", "new_turn": "new_turn", "reprefill": "reprefill"}  # phase → handoff_work's key

# Dense peaks (no sparsity): (name pattern, BF16/FP16 TFLOP/s, FP32 TFLOP/s without TF32, memory GB/s), from
# NVIDIA's "H100 Tensor Core GPU" datasheet (SXM5, PCIe and NVL columns) and "H200 Tensor Core GPU" datasheet
# (SXM and NVL), their with-sparsity tensor figures halved. The SXM TFLOP/s are kvlingo/train/footprint.py's
# DEVICES (tests/bench/test_profile.py checks they agree). The first pattern found in the device's name
# (torch.cuda.get_device_name: "NVIDIA H100 80GB HBM3", "NVIDIA H200", ...) wins, so variants come first;
# \b keeps "GH200" (a Grace Hopper superchip, other memory) from passing for an H200.
DATASHEET = (
    (r"\bH100 PCIe\b", 756.0, 51.0, 2000.0),
    (r"\bH100 NVL\b", 835.0, 60.0, 3900.0),
    (r"\bH200 NVL\b", 835.0, 60.0, 4800.0),
    (r"\bH100\b", 989.0, 67.0, 3350.0),  # SXM5, 80 GB HBM3
    (r"\bH200\b", 989.0, 67.0, 4800.0),  # SXM, 141 GB HBM3e
)


@dataclass(frozen=True)
class ProfileSettings:
    warmups: int = 3  # untimed calls of each phase first (a CUDA graph's capture has run it 3 times already)
    timed: int = 5  # synchronised trials outside the profiler: the phase's time per step (median)
    profiled: int = 3  # trials under torch.profiler: the phase's kernels
    top: int = 20  # kernels kept per phase, by total time


# --------------------------------------------------------------------------- peaks
def device_name(device) -> str:
    """What the device calls itself: the CUDA name, or the CPU's."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({platform.processor() or platform.machine()})"


def datasheet_peaks(name: str, dtype: str) -> Peaks | None:
    """The datasheet peaks of a device `name` for a run in `dtype` (float32: FP32 without TF32, else the
    16-bit tensor figure); None for a device `DATASHEET` does not name."""
    for pattern, half, single, gbps in DATASHEET:
        if re.search(pattern, name):
            tflops = single if dtype == "float32" else half
            precision = "FP32" if dtype == "float32" else "dense BF16/FP16"
            return Peaks(
                tflops * 1e12, gbps * 1e9, f"{name}'s datasheet: {tflops:g} TFLOP/s {precision}, {gbps:g} GB/s"
            )
    return None


def floors_peaks(name: str, dtype: str, run_peaks: Peaks) -> tuple[Peaks, bool]:
    """(the peaks the floors are taken at, whether they are a datasheet's): the datasheet's for a device it
    names, else `run_peaks` (the perf run's) under a source that says the device is unknown."""
    known = datasheet_peaks(name, dtype)
    if known is not None:
        return known, True
    return replace(
        run_peaks, source=f"unknown device ({name}): no datasheet peaks; the perf run's, {run_peaks.source}"
    ), False


# --------------------------------------------------------------------------- the arithmetic
def rates(flops: float, nbytes: float, seconds: float, peaks: Peaks | None = None) -> dict:
    """A step that did `flops` and moved `nbytes` in `seconds`: its achieved TFLOP/s and GB/s and, at `peaks`,
    its floor (`roofline.step_floor`), time ÷ floor and the share of each peak it reached."""
    out = {
        "flops": flops,
        "bytes": nbytes,
        "seconds": seconds,
        "tflops_per_s": flops / seconds / 1e12,
        "gb_per_s": nbytes / seconds / 1e9,
    }
    if peaks is not None:
        floor = step_floor(flops, nbytes, peaks)
        out |= {
            "floor_s": floor["floor_s"],
            "bound": floor["bound"],
            "over_floor": seconds / floor["floor_s"],
            "share_of_peak_flops": flops / seconds / peaks.flops_per_s,
            "share_of_peak_bytes": nbytes / seconds / peaks.bytes_per_s,
        }
    return out


def kernel_table(events, on_device: bool, trials: int, top: int = ProfileSettings.top) -> dict:
    """The kernels of `trials` profiled calls (torch.profiler's events), by total self time: on a device, its
    kernels, copies and memsets (self device time); on a CPU, the ops (self CPU time). Each kernel's calls and
    total over the trials and its share of their sum; `busy_ms_per_step` is that sum per trial."""
    from torch.autograd import DeviceType

    totals: dict[str, list] = {}  # name → [calls, microseconds]
    for evt in events:
        if evt.is_async or getattr(evt, "is_user_annotation", False):
            continue
        if on_device == (evt.device_type == DeviceType.CPU):
            continue
        us = evt.self_device_time_total if on_device else evt.self_cpu_time_total
        entry = totals.setdefault(evt.name, [0, 0.0])
        entry[0] += 1
        entry[1] += us
    busy = sum(us for _, us in totals.values())
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "busy_ms_per_step": busy / 1e3 / trials,
        "distinct_kernels": len(totals),
        "kernels": [
            {"name": name, "calls": calls, "total_ms": us / 1e3, "share": us / busy if busy else 0.0}
            for name, (calls, us) in ranked
        ],
    }


_warmed: set[str] = set()  # device types whose profiler has run once in this process


def profile_calls(fn, device, trials: int, top: int = ProfileSettings.top) -> dict:
    """`trials` calls of `fn` under torch.profiler, each ended by a device sync: `kernel_table` of them. The
    process's first profile of a device type is run once more and dropped: its first ops carry the profiler's
    start-up (a CPU run's first einsum took 4 ms of 0.6 in a dry run's first phase)."""
    from torch.profiler import ProfilerActivity, profile

    kind = torch.device(device).type
    on_device = kind == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    with torch.inference_mode():
        for _ in range(1 if kind in _warmed else 2):
            synchronize(device)
            with profile(activities=activities) as prof:
                for _ in range(trials):
                    fn()
                    synchronize(device)
        _warmed.add(kind)
    return kernel_table(prof.events(), on_device, trials, top)


def profile_phase(fn, device, settings: ProfileSettings = ProfileSettings(), eager=None) -> dict:
    """One phase: its time per step (median of `settings.timed` synchronised trials after the warm-ups) and its
    kernels over `settings.profiled` more; `eager`: the same step not replayed, whose kernels stand in where
    the profiler sees none in `fn`'s (a CUDA graph's replay)."""
    trials = timing.run_trials(fn, device, settings.warmups, settings.timed)
    try:  # a profiler that fails (CUPTI missing, say) costs the kernels, not the run's timings
        seen, where = profile_calls(fn, device, settings.profiled, settings.top), "as timed"
        if not seen["kernels"] and eager is not None:
            seen = profile_calls(eager, device, settings.profiled, settings.top)
            where = "run eagerly (the profiler saw no kernels in the CUDA graph's replay)"
    except Exception as err:
        seen = {"busy_ms_per_step": float("nan"), "distinct_kernels": 0, "kernels": []}
        where = f"none: the profiler failed ({type(err).__name__}: {err})"
    return {"median_s": median(trials), "cv": cv(trials), "trials_s": trials, "kernels_from": where, **seen}


def phase_work(source, target, translator, n: int, k: int, dtype, deferred: bool, refresh) -> dict:
    """(FLOPs, bytes) of each phase (`PHASES`) as perf's limit counts them, and under exact:0 the target's
    layer-0 projections added to the translation's."""
    work = handoff_work(source, target, translator, n, k, dtype, defer_values=deferred)
    out = {phase: work[WORK[phase]] for phase in PHASES}
    if refreshing(refresh) and refresh.kind == "exact":
        f, b = layer0_work(target, n, dtype)
        out["translate"] = (out["translate"][0] + f, out["translate"][1] + b)
    return out


def profile_at_length(
    source,
    target,
    translator,
    n: int,
    k: int,
    options: timing.PathOptions,
    peaks: Peaks,
    settings: ProfileSettings = ProfileSettings(),
) -> dict:
    """Every phase of the optimised handoff at a random context of n tokens and a new turn of k (the paths set
    up as `options` say, its mode aside), profiled; each phase's rates at `peaks`."""
    device = next(target.parameters()).device
    dtype = next(target.parameters()).dtype
    context, new = context_ids(target, n, k)
    with packing.packed(target, on=True):  # as perf's optimised rows run (nothing to pack off a CPU)
        paths = timing.HandoffPaths(
            source,
            target,
            translator,
            context,
            new,
            replace(options, mode="optimised"),
            need=("target_reprefill", "source_cache_handoff"),
        )
        work = phase_work(source, target, translator, n, k, dtype, paths.defer_values, options.refresh)
        phases = {}
        for phase, step in PHASES.items():  # translate first: the new turn reads the cache it wrote
            graphed = step in paths.graphed
            eager = paths.stage(step, eager=True) if graphed else None
            row = profile_phase(paths.stage(step), device, settings, eager)
            phases[phase] = {"graphed": graphed, **row, **rates(*work[phase], row["median_s"], peaks)}
    return {
        "context_tokens": n,
        "new_turn_tokens": k,
        "deferred_values": paths.defer_values,
        "graph_errors": paths.graph_errors,
        "phases": phases,
    }


def profile_report(cfg, name: str, peaks: Peaks, datasheet: bool, settings: ProfileSettings, points) -> dict:
    """profile.json: what was profiled (perf's config fields that set it), where, at which peaks, and per length
    every phase's time, rates and kernels."""
    return {
        "kind": "perf-profile",
        "device": cfg.device,
        "device_name": name,
        "torch": torch.__version__,
        "pair": {"source": cfg.source, "target": cfg.target, "direction": cfg.direction, "dtype": cfg.dtype},
        "translator": {"family": cfg.family, "settings": cfg.family_settings, "refresh": str(cfg.refresh)},
        "cuda_graphs": cfg.cuda_graphs,
        "defer_values": cfg.defer_values,
        "settings": asdict(settings),
        "peaks": {**asdict(peaks), "datasheet": datasheet},
        "lengths": points,
    }


# --------------------------------------------------------------------------- markdown
def short(name: str, width: int = 90) -> str:
    """A kernel's name for a table: one line, pipes escaped, long template names cut in the middle."""
    name = " ".join(name.split()).replace("|", "\\|")
    return name if len(name) <= width else name[: width // 2 - 1] + "…" + name[-(width // 2) :]


def markdown(report: dict, top: int = 8, level: str = "##") -> str:
    """The profile as markdown: per length, each phase's time per step and rates against the floors, then the
    top kernels of every phase."""
    from ..records.report import fmt_table

    pair, tr, peaks = report["pair"], report["translator"], report["peaks"]
    on_cpu = report["device"] == "cpu"
    text = (
        f"{level} Where the time goes: {pair['source']} → {pair['target']} ({pair['direction']}, {pair['dtype']}, "
        f"{report['device_name']}), {tr['family']} refresh {tr['refresh']}\n\n"
        f"torch.profiler, torch {report['torch']}: each phase after {report['settings']['warmups']} warm-ups; "
        f"ms/step = median of {report['settings']['timed']} synchronised trials outside the profiler; kernels over "
        f"{report['settings']['profiled']} profiled trials, "
        + ("the ops by self CPU time (a CPU: no device kernels)" if on_cpu else "by self device time")
        + f". Floors at {peaks['flops_per_s'] / 1e12:.4g} TFLOP/s and {peaks['bytes_per_s'] / 1e9:.4g} GB/s "
        f"({peaks['source']}).\n\n"
    )
    rows = []
    for p in report["lengths"]:
        for phase, r in p["phases"].items():
            rows.append(
                [
                    f"{p['context_tokens']:,}",
                    phase,
                    "graph" if r["graphed"] else "eager",
                    1e3 * r["median_s"],
                    r["busy_ms_per_step"],
                    r["flops"] / 1e9,
                    r["bytes"] / 1e9,
                    r["tflops_per_s"],
                    r["gb_per_s"],
                    1e3 * r["floor_s"],
                    r["bound"],
                    r["over_floor"],
                    100 * r["share_of_peak_flops"],
                    100 * r["share_of_peak_bytes"],
                ]
            )
    text += fmt_table(
        [
            "context",
            "phase",
            "runs as",
            "ms/step",
            "kernel ms/step",
            "GFLOP",
            "GB",
            "TFLOP/s",
            "GB/s",
            "floor ms",
            "bound",
            "× floor",
            "% peak FLOP/s",
            "% peak GB/s",
        ],
        rows,
    )
    for p in report["lengths"]:
        kernel_rows = []
        for phase, r in p["phases"].items():
            for kern in r["kernels"][:top]:
                kernel_rows.append([phase, short(kern["name"]), kern["calls"], kern["total_ms"], 100 * kern["share"]])
        ph = p["phases"]
        eager = [phase for phase, r in ph.items() if r["kernels_from"].startswith("run eagerly")]
        failed = [f"{phase}: {r['kernels_from']}" for phase, r in ph.items() if r["kernels_from"].startswith("none")]
        handoff = ph["translate"]["median_s"] + ph["new_turn"]["median_s"]
        text += (
            f"\n{level}# Top kernels at {p['context_tokens']:,} tokens (values "
            f"{'deferred' if p['deferred_values'] else 'translated'}; each phase's top {top}, over "
            f"{report['settings']['profiled']} trials"
            + (f"; {', '.join(eager)}: kernels of the eager run, the graph's replay showed none" if eager else "")
            + ")\n\n"
            f"translate + new turn {1e3 * handoff:.4g} ms against re-prefill {1e3 * ph['reprefill']['median_s']:.4g} "
            f"ms ({ph['reprefill']['median_s'] / handoff:.3g}×, phase by phase, each after its own warm-ups)"
            + "".join(f"; CUDA graph of {step} failed: {why}" for step, why in p["graph_errors"].items())
            + "".join(f"; kernels of {why}" for why in failed)
            + ".\n\n"
            + fmt_table(["phase", "kernel", "calls", "total ms", "share %"], kernel_rows)
        )
    return text
