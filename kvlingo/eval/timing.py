"""Wall-clock timing of the handoff: synchronised trials, their median and CV, and the four paths.

Every path ends at the same place: the logits of the first token after a new turn. They
differ in how the target gets a cache of the context before it reads that turn:

    target_reprefill        the target re-reads the whole context plus the new turn
    source_cache_handoff    a source cache (with its pre-norm key features) already exists:
                            translate it, build the target cache, run the new turn
    source_prefill_handoff  the source prefills the context first, then as above
    target_cache_continue   the target's own cache already exists: build it, run the new
                            turn (the ideal a handoff can at best match)

The paths take models, a translator and token ids only, never data files, so the same code
times real checkpoints and architecture-exact random models alike. Models must be built
outside `torch.inference_mode` (CPU BF16 kernels run far slower for models built inside it);
only the trials run inside it. Whatever "already exists" in a path (captures, the target's
cache) is computed once, before any trial, so it stays out of the timed region.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from ..core.cache import Capture, build_cache, run_with_cache
from ..core.handoff import device_of, prefill, translate
from ..core.translator import Translator
from .stats import cv, median

PATHS = ("target_reprefill", "source_cache_handoff", "source_prefill_handoff", "target_cache_continue")
STAGES = ("translate", "build_cache", "new_turn")  # the pieces of source_cache_handoff, timed apart
CV_LIMIT = 0.10  # a timing whose trials vary more than this (SD / mean) is flagged as noisy


# --------------------------------------------------------------------------- primitives
def threads() -> int:
    """Intra-op threads torch runs on: reported with every timing (a shared CPU is far from idle)."""
    return torch.get_num_threads()


def synchronize(device: str | torch.device) -> None:
    """Wait for queued device work so that a host clock reading covers it (a no-op on CPU)."""
    kind = torch.device(device).type
    if kind == "cuda":
        torch.cuda.synchronize(device)
    elif kind == "mps":
        torch.mps.synchronize()


def run_trials(fn: Callable[[], object], device, warmups: int, repeats: int) -> list[float]:
    """`warmups` untimed calls, then `repeats` timed ones: seconds per call, in call order.

    Each trial is bracketed by device synchronisations and read with `time.perf_counter`,
    so it covers the device work it queued and nothing queued before it.
    """
    if repeats < 1 or warmups < 0:
        raise ValueError(f"need repeats ≥ 1 and warmups ≥ 0 (got {repeats} and {warmups})")
    with torch.inference_mode():
        for _ in range(warmups):
            fn()
        synchronize(device)
        trials = []
        for _ in range(repeats):
            synchronize(device)
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            trials.append(time.perf_counter() - t0)
    return trials


def summarize(trials: list[float], cv_limit: float = CV_LIMIT) -> dict:
    """Median, CV and the raw trials (seconds); `noisy` when the CV exceeds `cv_limit`."""
    c = cv(trials)
    return {
        "median_s": median(trials),
        "cv": c,
        "min_s": min(trials),
        "max_s": max(trials),
        "n": len(trials),
        "noisy": bool(c > cv_limit) if c == c else False,  # NaN (one trial) cannot be screened
        "trials_s": list(trials),
    }


# --------------------------------------------------------------------------- the paths
def new_turn_logits(model, new_ids: torch.Tensor, cache=None) -> torch.Tensor:
    """Run the new turn [1, k] (on a cache, if given): logits of the next token [vocab]."""
    out, _ = run_with_cache(model, new_ids, cache=cache, logits_to_keep=1)
    return out.logits[0, -1]


class HandoffPaths:
    """The four paths for one context and one new turn, as zero-argument callables.

    `context_ids` [1, T] and `new_ids` [1, k] are token ids on the models' device. What the
    paths in `need` take as already existing (the source capture, with pre-norm features when
    the maps need them; the target's own cache) is made here, once, outside any timed region.
    """

    def __init__(self, source, target, translator: Translator, context_ids: torch.Tensor, new_ids: torch.Tensor,
                 out_dtype: torch.dtype | None = None, need: tuple[str, ...] = PATHS, refresh=None):
        self.source, self.target, self.translator = source, target, translator
        self.context_ids, self.new_ids = context_ids, new_ids
        self.refresh = refresh  # the part of the context the target recomputes in a handoff (kvlingo.core.refresh)
        self.full_ids = torch.cat([context_ids, new_ids], dim=1)  # [1, T + k]: tokenisation is not timed
        self.out_dtype = out_dtype or next(target.parameters()).dtype
        self.want_prenorm = translator.needs_prenorm
        self.source_capture: Capture | None = None
        self.target_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # [layers, kv_heads, T, head_dim] each
        # RoPE tables grow on demand; size them now so that no trial pays for growing them.
        translator.space.source_rope(context_ids.shape[1], device=context_ids.device)
        translator.space.target_rope(context_ids.shape[1], device=context_ids.device)
        with torch.inference_mode():
            if "source_cache_handoff" in need:
                self.source_capture = prefill(source, context_ids, self.want_prenorm)
            if "target_cache_continue" in need:
                own = prefill(target, context_ids, want_prenorm=False)
                self.target_kv = (own.keys, own.values)

    def target_reprefill(self) -> torch.Tensor:
        out, _ = run_with_cache(self.target, self.full_ids, logits_to_keep=1)
        return out.logits[0, -1]

    def source_cache_handoff(self, mark: Callable[[str], None] | None = None) -> torch.Tensor:
        return self._handoff(self.source_capture, mark)

    def source_prefill_handoff(self) -> torch.Tensor:
        cap = prefill(self.source, self.context_ids, self.want_prenorm)
        return self._handoff(cap)

    def target_cache_continue(self) -> torch.Tensor:
        return new_turn_logits(self.target, self.new_ids, build_cache(self.target, *self.target_kv))

    def _handoff(self, cap: Capture, mark: Callable[[str], None] | None = None) -> torch.Tensor:
        keys, values = translate(self.source, self.translator, self.context_ids, self.out_dtype, cap=cap,
                                 refresh=self.refresh, target=self.target)
        if mark:
            mark("translate")
        cache = build_cache(self.target, keys, values)
        if mark:
            mark("build_cache")
        logits = new_turn_logits(self.target, self.new_ids, cache)
        if mark:
            mark("new_turn")
        return logits

    def path(self, name: str) -> Callable[[], torch.Tensor]:
        if name not in PATHS:
            raise ValueError(f"unknown path {name!r}; choose from {PATHS}")
        if (name == "source_cache_handoff" and self.source_capture is None) or \
                (name == "target_cache_continue" and self.target_kv is None):
            raise ValueError(f"path {name!r} was not in `need` when these paths were set up")
        return getattr(self, name)


def time_paths(paths: HandoffPaths, names=PATHS, warmups: int = 5, repeats: int = 30, cv_limit: float = CV_LIMIT) -> dict:
    """Time each named path on its own (all its warm-ups and trials, then the next path).

    Returns {path: summary}; speedups are `speedups(...)` of the result.
    """
    device = device_of(paths.target)
    return {name: summarize(run_trials(paths.path(name), device, warmups, repeats), cv_limit) for name in names}


def time_breakdown(paths: HandoffPaths, warmups: int = 5, repeats: int = 30, cv_limit: float = CV_LIMIT) -> dict:
    """Where the time of `source_cache_handoff` goes: translate, cache build, new-turn step.

    Separate trials from the path's own, with a synchronisation between stages (which the
    end-to-end trials do not pay), so each stage's clock covers its own device work only.
    """
    device = device_of(paths.target)
    per_stage: dict[str, list[float]] = {s: [] for s in STAGES}
    clock: dict[str, float] = {}

    def mark(stage: str) -> None:
        synchronize(device)
        now = time.perf_counter()
        per_stage[stage].append(now - clock["t"])
        clock["t"] = now

    def trial() -> None:
        synchronize(device)
        clock["t"] = time.perf_counter()
        paths.source_cache_handoff(mark)

    with torch.inference_mode():
        for _ in range(warmups):
            trial()
        for s in STAGES:
            per_stage[s].clear()
        for _ in range(repeats):
            trial()
    return {s: summarize(per_stage[s], cv_limit) for s in STAGES}


def speedups(summaries: dict, baseline: str = "target_reprefill") -> dict[str, float]:
    """median(baseline) / median(path) for every other path: > 1 means faster than re-reading."""
    base = summaries[baseline]["median_s"]
    return {name: base / s["median_s"] for name, s in summaries.items() if name != baseline}


def cv_checks(noisy: list[str], cv_limit: float, allow_cv: bool, failed: list[str] | None = None) -> dict:
    """A timing stage's checks: the CV screen (waived by allow_cv) on top of any earlier failures."""
    failed = list(failed or [])
    if noisy and not allow_cv:
        failed.append(f"CV > {cv_limit:g} in {', '.join(noisy)} (--allow-cv waives this)")
    return {"noisy_timings": noisy, "cv_allowed": allow_cv, "failed": failed, "passed": not failed}


def checks_line(checks: dict) -> str:
    return f"\nChecks: {'PASSED' if checks['passed'] else 'FAILED: ' + '; '.join(checks['failed'])}\n"


def noisy_timings(summaries: dict, prefix: str = "") -> list[str]:
    """Names (with a prefix) of the timings whose CV exceeds the limit they were summarised with."""
    return [f"{prefix}{name}" for name, s in summaries.items() if s["noisy"]]
