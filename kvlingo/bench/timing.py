"""Wall-clock timing of the handoff: synchronised trials, their median and CV, and the four paths.

Every path ends at the same place: the logits of the first token after a new turn. They
differ in how the target gets a cache of the context before it reads that turn:

    target_reprefill        the target re-reads the whole context plus the new turn
    source_cache_handoff    a source cache (with its pre-norm key features) already exists:
                            translate it into the target's cache, run the new turn
    source_prefill_handoff  the source prefills the context first, then as above
    target_cache_continue   the target's own cache already exists: run the new turn on it
                            (the ideal a handoff can at best match)

Each path runs in one of two modes (`MODES`), the same for every path, so baselines get
every optimisation the handoff gets:

    shipped    transformers' DynamicCache and sdpa attention as shipped, the translation in
               FP32 maths, eager
    optimised  a preallocated cache with room for the new turn, reserved once per context and
               reused by every call, which the translation writes straight into; grouped-query
               attention without repeated K/V (kvlingo.core.attention); on a CPU, the values left
               deferred where the value maps allow it and it saves FLOPs (kvlingo.core.preallocated);
               the keys' norm and RoPE compiled on a CPU and the maps' matmuls in the run dtype on
               CUDA (`fast_precision`);
               on CUDA each path replayed as a CUDA graph (kvlingo.bench.graphs). On a CPU the
               caller also packs the target's projections for oneDNN (`packing.packed`).

How the paths run is one `PathOptions`; how they are timed is one `Trials`. The paths take
models, a translator and token ids only, so the same code times real checkpoints and
architecture-exact random models alike. Models must be built outside `torch.inference_mode`
(CPU BF16 kernels run far slower for models built inside it); only the trials run inside it.
Whatever "already exists" in a path is computed once, before any trial.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..core.cache import Capture, build_cache, empty_cache, run_with_cache
from ..core.handoff import can_defer_values, device_of, prefill, refreshing, translate, translate_to_cache
from ..core.translator import Translator
from ..eval.stats import cv, median, ratio_of_medians_interval
from . import graphs
from .roofline import deferral_saves, synchronize

PATHS = ("target_reprefill", "source_cache_handoff", "source_prefill_handoff", "target_cache_continue")
STAGES = ("translate", "build_cache", "new_turn")  # the pieces of source_cache_handoff, timed apart
MODES = ("shipped", "optimised")
CV_LIMIT = 0.10  # a timing whose trials vary more than this (SD / mean) is flagged as noisy


@dataclass(frozen=True)
class Trials:
    """How a timing takes its trials."""

    warmups: int = 5  # untimed calls of each path first
    repeats: int = 30  # timed trials, at least
    cv_limit: float = CV_LIMIT  # a timing whose CV exceeds this is flagged (and, under max_repeats, timed again)
    max_repeats: int | None = None  # trials go on past `repeats` while the CV exceeds the limit, up to this many
    max_seconds: float | None = None  # ... and while the timing's trials add up to less than this


@dataclass(frozen=True)
class PathOptions:
    """How the paths run: one mode for all four, and what the optimised mode may use."""

    mode: str = "optimised"  # shipped or optimised (`MODES`)
    cuda_graphs: bool | None = None  # optimised on CUDA: each path replayed as a CUDA graph (None: yes)
    fuse_keys: bool | None = None  # optimised: the keys' norm and RoPE compiled or not (None: `fast_precision`)
    defer_values: bool | None = None  # optimised: the context's values deferred or not (None: `defer_values_here`)
    refresh: object = None  # the part of the context the target recomputes in a handoff (kvlingo.core.refresh)


def mode_for(cache_kind: str) -> str:
    """The timing mode of a pair's KV cache kind (`PairConfig.cache`): optimised on a preallocated cache."""
    return "optimised" if cache_kind == "preallocated" else "shipped"


def fast_precision(device, fuse_keys: bool | None = None) -> str:
    """The precision an optimised handoff translates in (kvlingo.core.engine): `fast` on CUDA (tensor cores),
    `fused` on a CPU (FP32 maths, the keys' finish compiled: a CPU run's re-prefill baseline is FP32 too),
    `fp32` elsewhere. `fuse_keys` True or False asks for the compiled finish or not (CUDA: `fast-fused` or
    `fast`; CPU: `fused` or `fp32`); None takes the default."""
    kind = torch.device(device).type
    if kind == "cuda":
        return "fast-fused" if fuse_keys else "fast"
    if kind == "cpu":
        return "fp32" if fuse_keys is False else "fused"
    return "fp32"


# --------------------------------------------------------------------------- primitives
def threads() -> int:
    """Intra-op threads torch runs on: reported with every timing (a shared CPU is far from idle)."""
    return torch.get_num_threads()


def run_trials(
    fn: Callable[[], object],
    device,
    warmups: int,
    repeats: int,
    cv_limit: float | None = None,
    max_repeats: int | None = None,
    max_seconds: float | None = None,
) -> list[float]:
    """`warmups` untimed calls, then at least `repeats` timed ones: seconds per call, in call order.

    Each trial is bracketed by device synchronisations and read with `time.perf_counter`,
    so it covers the device work it queued and nothing queued before it. With `cv_limit` and
    `max_repeats` above `repeats`, trials go on past `repeats` while the CV of all trials so far
    exceeds `cv_limit`, up to `max_repeats` (a GPU's first trials can include clock ramps and
    allocator growth). With `max_seconds`, those extra trials also stop once the trials add up to
    that many seconds, so a cheap step can take many and a slow one no more than `repeats`. Every
    trial is kept and reported; the screen still sees them all.
    """
    return run_interleaved({"": fn}, device, warmups, repeats, cv_limit, max_repeats, max_seconds)[""]


def wants_trial(
    done: list[list[float]],
    repeats: int,
    cv_limit: float | None,
    max_repeats: int | None,
    max_seconds: float | None,
    spent: float | None = None,
) -> bool:
    """Whether a timing wants one more trial: fewer than `repeats`, or one of its series `done` (trials
    taken together, e.g. a handoff's stages) has a CV above `cv_limit` while the trials number fewer
    than `max_repeats` and, with `max_seconds`, took less than that (`spent`; default: `done`'s sum)."""
    n = len(done[0])
    if n < repeats:
        return True
    if cv_limit is None or n >= max(repeats, max_repeats or repeats):
        return False
    spent = sum(sum(series) for series in done) if spent is None else spent
    return (max_seconds is None or spent < max_seconds) and any(cv(series) > cv_limit for series in done)


def run_interleaved(
    fns: dict[str, Callable[[], object]],
    device,
    warmups: int | dict[str, int],
    repeats: int,
    cv_limit: float | None = None,
    max_repeats: int | None = None,
    max_seconds: float | None = None,
) -> dict[str, list[float]]:
    """`run_trials` for several callables at once, their trials interleaved round by round.

    Every warm-up runs first (`warmups`: one count for all, or one per name). Then each round
    times one trial of every callable that still wants one (fewer than `repeats`, or a CV above
    `cv_limit`, fewer than `max_repeats` and, with `max_seconds`, trials adding up to less than
    that), in the order given. A slow spell of a shared machine
    then falls on every callable of that round alike instead of on whichever was being timed,
    so ratios of their medians move less from run to run. Returns {name: seconds per trial}.
    """
    if repeats < 1 or (min(warmups.values(), default=0) if isinstance(warmups, dict) else warmups) < 0:
        raise ValueError(f"need repeats ≥ 1 and warmups ≥ 0 (got {repeats} and {warmups})")
    trials: dict[str, list[float]] = {name: [] for name in fns}

    def wants(name: str) -> bool:
        return wants_trial([trials[name]], repeats, cv_limit, max_repeats, max_seconds)

    with torch.inference_mode():
        for name, fn in fns.items():
            for _ in range(warmups[name] if isinstance(warmups, dict) else warmups):
                fn()
        synchronize(device)
        while due := [name for name in fns if wants(name)]:
            for name in due:
                synchronize(device)
                t0 = time.perf_counter()
                fns[name]()
                synchronize(device)
                trials[name].append(time.perf_counter() - t0)
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
    """The four paths for one context and one new turn in one mode, as zero-argument callables.

    `context_ids` [1, T] and `new_ids` [1, k] are token ids on the models' device. What the
    paths in `need` take as already existing (the source capture, with pre-norm features when
    the maps need them; the target's own cache) is made here, once, outside any timed region,
    unless given (`source_capture`, `target_kv`: the same for both modes, so one set-up serves
    both). The optimised mode reserves only the caches that the paths in `need` write, and
    `path` refuses a path outside `need`. A path whose CUDA graph capture fails runs eagerly,
    and `graph_errors` says why.
    """

    def __init__(
        self,
        source,
        target,
        translator: Translator,
        context_ids: torch.Tensor,
        new_ids: torch.Tensor,
        options: PathOptions = PathOptions(),
        need: tuple[str, ...] = PATHS,
        out_dtype: torch.dtype | None = None,
        source_capture: Capture | None = None,
        target_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        if options.mode not in MODES:
            raise ValueError(f"unknown mode {options.mode!r}; choose from {MODES}")
        self.source, self.target, self.translator, self.mode = source, target, translator, options.mode
        self.context_ids, self.new_ids = context_ids, new_ids
        self.refresh = options.refresh
        # a refresh that runs the target's forward assembles its own cache per call; exact:0 writes in place
        self.assembles = refreshing(self.refresh) and self.refresh.kind != "exact"
        self.full_ids = torch.cat([context_ids, new_ids], dim=1)  # [1, T + k]: tokenisation is not timed
        self.out_dtype = out_dtype or next(target.parameters()).dtype
        self.want_prenorm = translator.needs_prenorm
        self.optimised = options.mode == "optimised"
        self.kind = "preallocated" if self.optimised else "dynamic"
        device = context_ids.device
        self.precision = fast_precision(device, options.fuse_keys) if self.optimised else "fp32"
        self.defer_values = self.optimised and defer_values_here(
            translator, device, self.refresh, options.defer_values, target, context_ids.shape[1], new_ids.shape[1]
        )
        # a refresh that runs the target inside the translation assembles a cache per call: not graphed
        self.graphs_on = (
            self.optimised and device.type == "cuda" and options.cuda_graphs is not False and not self.assembles
        )
        self.graph_errors: dict[str, str] = {}
        n, k = context_ids.shape[1], new_ids.shape[1]
        self.n_context = n
        self.source_capture, self.target_kv = source_capture, target_kv
        # RoPE tables grow on demand; size them now so that no trial pays for growing them.
        translator.space.source_rope(n, device=device)
        translator.space.target_rope(n, device=device)
        with torch.inference_mode():
            if "source_cache_handoff" in need and self.source_capture is None:
                self.source_capture = prefill(source, context_ids, self.want_prenorm, kind=self.kind)
            if "target_cache_continue" in need and self.target_kv is None:
                own = prefill(target, context_ids, want_prenorm=False, kind=self.kind)
                self.target_kv = (own.keys, own.values)
        self.need = tuple(need)
        self.handoff_cache = self.reprefill_cache = self.own_cache = None
        if self.optimised:  # reserved once, reused by every call (ordinary tensors: writable in any mode)
            with torch.no_grad():  # only what the paths in `need` write (a refresh assembles its own cache)
                if {"source_cache_handoff", "source_prefill_handoff"} & set(need) and not self.assembles:
                    self.handoff_cache = empty_cache(target, n, k, self.out_dtype, device)
                if "target_reprefill" in need:
                    self.reprefill_cache = empty_cache(target, n + k, 0, self.out_dtype, device)
                if "target_cache_continue" in need:  # a copy of the target's own cache, with room for the turn
                    self.own_cache = build_cache(target, *self.target_kv, kind="preallocated", room=k)
        self._steps: dict[str, Callable] = {}
        if self.graphs_on:
            with torch.inference_mode():
                self._capture_graphs(need, device)

    # ------------------------------------------------------------------ steps
    def _translate_into_cache(self, cap: Capture):
        """Optimised: the translation written straight into the reserved handoff cache."""
        if self.assembles:
            return translate_to_cache(
                self.source,
                self.target,
                self.translator,
                self.context_ids,
                cap=cap,
                room=self.new_ids.shape[1],
                out_dtype=self.out_dtype,
                precision=self.precision,
                refresh=self.refresh,
            )
        return translate_to_cache(  # under exact:0, layer 0 from the ids in place too
            self.source,
            self.target,
            self.translator,
            self.context_ids if refreshing(self.refresh) else None,
            cap=cap,
            into=self._reserved("handoff_cache", "source_cache_handoff"),
            out_dtype=self.out_dtype,
            precision=self.precision,
            refresh=self.refresh if refreshing(self.refresh) else None,
            defer_values=self.defer_values,
        )

    def _reserved(self, name: str, path: str):
        """The cache reserved at set-up for `path` (optimised mode), or a clear error when `need` left it out."""
        cache = getattr(self, name)
        if cache is None:
            raise self._not_set_up(path)
        return cache

    def _not_set_up(self, path: str) -> ValueError:
        return ValueError(
            f"path {path!r} was not in `need` {self.need} when these paths were set up, so what it "
            "reads or writes was not made; add it there"
        )

    def _new_turn(self, cache) -> torch.Tensor:
        if self.optimised:
            cache.set_length(self.n_context)  # a reused cache: the previous call's new turn is overwritten
        return new_turn_logits(self.target, self.new_ids, cache)

    def _handoff(
        self, cap: Capture, mark: Callable[[str], None] | None = None, steps: dict[str, Callable] | None = None
    ) -> torch.Tensor:
        mark, steps = mark or (lambda _stage: None), steps or {}
        if self.optimised:
            made = steps.get("translate", lambda: self._translate_into_cache(cap))()
            mark("translate")
            # the translation wrote the reserved cache (a refresh that assembles makes its own): nothing left to build
            cache = made if self.assembles else self.handoff_cache
        else:
            keys, values = translate(
                self.source,
                self.translator,
                self.context_ids,
                self.out_dtype,
                cap=cap,
                refresh=self.refresh,
                target=self.target,
                precision=self.precision,
            )
            mark("translate")
            cache = build_cache(self.target, keys, values, kind="dynamic")
        mark("build_cache")
        logits = steps.get("new_turn", lambda: self._new_turn(cache))()
        mark("new_turn")
        return logits

    def _eager(self, name: str) -> torch.Tensor:
        if name == "target_reprefill":
            cache = None
            if self.optimised:
                cache = self._reserved("reprefill_cache", name)
                cache.set_length(0)
            out, _ = run_with_cache(self.target, self.full_ids, cache=cache, kind=self.kind, logits_to_keep=1)
            return out.logits[0, -1]
        if name == "source_prefill_handoff":
            return self._handoff(prefill(self.source, self.context_ids, self.want_prenorm, kind=self.kind))
        if name == "target_cache_continue":
            own = self.own_cache if self.optimised else build_cache(self.target, *self.target_kv, kind="dynamic")
            return self._new_turn(own)
        raise ValueError(name)

    def _capture_graphs(self, need: tuple[str, ...], device) -> None:
        """One CUDA graph per path, and for the existing-source handoff one per stage (so its
        breakdown can still be timed); each captured after warm-ups on its own static buffers."""
        candidates: dict[str, Callable] = {}
        if "source_cache_handoff" in need:
            candidates["translate"] = lambda: self._translate_into_cache(self.source_capture)
            candidates["new_turn"] = lambda: self._new_turn(self.handoff_cache)
        for name in ("target_reprefill", "source_prefill_handoff", "target_cache_continue"):
            if name in need:
                candidates[name] = lambda name=name: self._eager(name)
        for name, fn in candidates.items():
            try:
                self._steps[name] = graphs.capture(fn, device)
            except Exception as err:  # a capture that fails leaves that step eager, and says why
                self.graph_errors[name] = f"{type(err).__name__}: {err}"

    # ------------------------------------------------------------------ the paths
    def target_reprefill(self) -> torch.Tensor:
        return self._steps.get("target_reprefill", lambda: self._eager("target_reprefill"))()

    def source_cache_handoff(self, mark: Callable[[str], None] | None = None) -> torch.Tensor:
        return self._handoff(self.source_capture, mark, self._steps)

    def source_prefill_handoff(self) -> torch.Tensor:
        return self._steps.get("source_prefill_handoff", lambda: self._eager("source_prefill_handoff"))()

    def target_cache_continue(self) -> torch.Tensor:
        return self._steps.get("target_cache_continue", lambda: self._eager("target_cache_continue"))()

    @property
    def graphed(self) -> list[str]:
        """Steps replayed as CUDA graphs."""
        return sorted(self._steps)

    def path(self, name: str) -> Callable[[], torch.Tensor]:
        if name not in PATHS:
            raise ValueError(f"unknown path {name!r}; choose from {PATHS}")
        if name not in self.need:
            raise self._not_set_up(name)
        return getattr(self, name)

    def stage(self, name: str, eager: bool = False) -> Callable[[], object]:
        """One step alone, as the trials run it (its CUDA graph where one was captured; `eager`: never): a
        piece of the optimised existing-source handoff, `translate` (into the reserved cache) or `new_turn`
        (on that cache as the last translation left it), or a path that is one step (`target_reprefill`,
        `source_prefill_handoff`, `target_cache_continue`)."""
        if name in PATHS and name != "source_cache_handoff":
            self.path(name)  # refuses a path outside `need`
            fn = lambda: self._eager(name)  # noqa: E731
        elif name in ("translate", "new_turn"):
            if not self.optimised or self.assembles:
                raise ValueError(
                    f"stage {name!r} runs alone only in the optimised mode under no refresh but exact:0 (here: "
                    f"{self.mode}, refresh {self.refresh}); the handoff's stages then share one call"
                )
            self._reserved("handoff_cache", "source_cache_handoff")
            if name == "translate":
                fn = lambda: self._translate_into_cache(self.source_capture)  # noqa: E731
            else:
                fn = lambda: self._new_turn(self.handoff_cache)  # noqa: E731
        else:
            one_step = [p for p in PATHS if p != "source_cache_handoff"]
            raise ValueError(f"unknown stage {name!r}; choose from translate, new_turn or one of {one_step}")
        return fn if eager else self._steps.get(name, fn)


def defer_values_here(
    translator: Translator, device, refresh=None, wanted: bool | None = None, target=None, n: int = 4096, k: int = 16
) -> bool:
    """Whether an optimised handoff leaves the context's values deferred (`handoff.translate_to_cache`).

    None: where the translator can (value maps linear in the source's values, no refresh), on a CPU,
    and where deferring does fewer FLOPs than translating the values for a new turn of k tokens on n
    (`roofline.deferral_saves`, given the `target`); not yet on other devices, where no run of this
    suite has timed it. True refuses (ValueError) a translator or refresh that cannot; False never defers."""
    if wanted is False:
        return False
    able = can_defer_values(translator, "preallocated", refresh)
    if wanted and not able:
        raise ValueError(
            f"values cannot be deferred with a {translator.family} translator"
            + (" under a refresh" if refreshing(refresh) else "")
            + ": only translators whose value maps are linear in the source's values (and token features) can, "
            "under no refresh but exact:0; turn deferred values off"
        )
    if not able or wanted:
        return able
    return torch.device(device).type == "cpu" and (target is None or deferral_saves(translator, target, n, k))


def time_paths(
    paths: HandoffPaths, names=PATHS, trials: Trials = Trials(), warmups: dict[str, int] | None = None
) -> dict:
    """Time the named paths, their trials interleaved round by round after every warm-up
    (`run_interleaved`; `warmups` per path, in place of `trials.warmups`). Returns {path: summary};
    speedups are `speedups(...)` of the result."""
    device = device_of(paths.target)
    timed = run_interleaved(
        {name: paths.path(name) for name in names},
        device,
        trials.warmups if warmups is None else warmups,
        trials.repeats,
        trials.cv_limit,
        trials.max_repeats,
        trials.max_seconds,
    )
    return {name: summarize(t, trials.cv_limit) for name, t in timed.items()}


def time_handoffs(
    source,
    target,
    handoffs: dict[str, tuple[Translator, object]],
    context_ids: torch.Tensor,
    new_ids: torch.Tensor,
    trials: Trials = Trials(),
    mode: str = "optimised",
) -> dict:
    """Re-prefill and several handoffs from an existing source cache on one context, every trial interleaved
    round by round (`run_interleaved`), so that the handoffs' speedups share one slow spell or none.

    `handoffs`: {name: (translator, refresh setting or None)}. Each translator's source capture is made
    once and shared by its settings; the optimised mode reserves one handoff cache per pure translation
    and one re-prefill cache in all. Returns {"reprefill": summary, "handoff": {name: summary}}.
    """
    if not handoffs or "target_reprefill" in handoffs:
        raise ValueError(
            f"time_handoffs needs at least one handoff, none named 'target_reprefill' (got {list(handoffs)})"
        )
    device = device_of(target)
    fns: dict[str, Callable[[], object]] = {}
    captures: dict[int, Capture] = {}
    for name, (translator, refresh) in handoffs.items():
        need = ("source_cache_handoff",) if fns else ("target_reprefill", "source_cache_handoff")
        paths = HandoffPaths(
            source,
            target,
            translator,
            context_ids,
            new_ids,
            PathOptions(mode, refresh=refresh),
            need=need,
            source_capture=captures.get(id(translator)),
        )
        captures[id(translator)] = paths.source_capture
        if not fns:
            fns["target_reprefill"] = paths.path("target_reprefill")
        fns[name] = paths.path("source_cache_handoff")
    timed = run_interleaved(
        fns, device, trials.warmups, trials.repeats, trials.cv_limit, trials.max_repeats, trials.max_seconds
    )
    return {
        "reprefill": summarize(timed.pop("target_reprefill"), trials.cv_limit),
        "handoff": {name: summarize(t, trials.cv_limit) for name, t in timed.items()},
    }


def time_breakdown(paths: HandoffPaths, trials: Trials = Trials()) -> dict:
    """Where the time of `source_cache_handoff` goes: translate, cache build, new-turn step.

    Separate trials from the path's own, with a synchronisation between stages (which the
    end-to-end trials do not pay), so each stage's clock covers its own device work only.
    Extra trials go on while a stage's CV exceeds the limit, as in `run_trials`.
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

    screened = [per_stage["translate"], per_stage["new_turn"]]  # the build's microseconds say nothing
    with torch.inference_mode():
        for _ in range(trials.warmups):
            trial()
        for s in STAGES:
            per_stage[s].clear()
        while wants_trial(
            screened,
            trials.repeats,
            trials.cv_limit,
            trials.max_repeats,
            trials.max_seconds,
            spent=sum(sum(per_stage[s]) for s in STAGES),
        ):
            trial()
    out = {s: summarize(per_stage[s], trials.cv_limit) for s in STAGES}
    if paths.optimised:  # microseconds of bookkeeping: their CV says nothing about the machine
        out["build_cache"].update(noisy=False, note="nothing to build: the translation wrote the cache")
    return out


def speedups(summaries: dict, baseline: str = "target_reprefill") -> dict[str, float]:
    """median(baseline) / median(path) for every other path: > 1 means faster than re-reading."""
    base = summaries[baseline]["median_s"]
    return {name: base / s["median_s"] for name, s in summaries.items() if name != baseline}


def speedup_intervals(
    summaries: dict, baseline: str = "target_reprefill", level: float = 0.95
) -> dict[str, list[float]]:
    """A bootstrap interval [lo, hi] (`level`) of each `speedups` ratio, from the raw trials of the
    baseline and the path (`stats.ratio_of_medians_interval`): how far the trials alone move it."""
    base = summaries[baseline]["trials_s"]
    return {
        name: ratio_of_medians_interval(base, s["trials_s"], level) for name, s in summaries.items() if name != baseline
    }


def cv_checks(noisy: list[str], cv_limit: float, allow_cv: bool, failed: list[str] | None = None) -> dict:
    """A timing stage's checks: the CV screen (waived by allow_cv) on top of any earlier failures."""
    failed = list(failed or [])
    if noisy and not allow_cv:
        failed.append(f"CV > {cv_limit:g} in {', '.join(noisy)} (--allow-cv waives this)")
    return {"noisy_timings": noisy, "cv_allowed": allow_cv, "failed": failed, "passed": not failed}


def checks_line(checks: dict) -> str:
    """The checks' verdict, saying why timings flagged NOISY did not fail it (the CV screen was waived)."""
    noisy = checks.get("noisy_timings") or []
    waived = (
        (
            f" ({len(noisy)} timing(s) flagged NOISY: the CV of their trials exceeds --cv-limit; waived by "
            "--allow-cv or the profile, so their medians are less certain)"
        )
        if noisy and checks.get("cv_allowed")
        else ""
    )
    return f"\nChecks: {'PASSED' if checks['passed'] else 'FAILED: ' + '; '.join(checks['failed'])}{waived}\n"


def noisy_timings(summaries: dict, prefix: str = "") -> list[str]:
    """Names (with a prefix) of the timings whose CV exceeds the limit they were summarised with."""
    return [f"{prefix}{name}" for name, s in summaries.items() if s["noisy"]]
