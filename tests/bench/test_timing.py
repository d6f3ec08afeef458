"""The timing paths (kvlingo/bench/timing.py) against transformers' own forwards, with and without deferred
values; the adaptive trials and the time cap on a fake clock; the interleaved handoffs and the caches they reserve."""

from __future__ import annotations

import statistics

import pytest
import torch
from refs import random_ids, random_maps
from translators import translator

from kvlingo.bench import timing
from kvlingo.core.cache import capture, continue_from
from kvlingo.core.handoff import as_ids, prefill


def test_fast_precision_follows_the_device_and_the_fuse_keys_switch():
    from kvlingo.bench.timing import fast_precision

    assert [fast_precision("cuda", f) for f in (None, True, False)] == ["fast", "fast-fused", "fast"]
    assert [fast_precision("cpu", f) for f in (None, True, False)] == ["fused", "fused", "fp32"]
    assert [fast_precision("mps", f) for f in (None, True, False)] == ["fp32"] * 3


def test_timing_modes_agree_with_transformers(models):
    source, target = models["large", torch.float32], models["small", torch.float32]
    ids = random_ids(30, target.config.vocab_size, 9)
    maps = random_maps(source, target, 3)
    out = {}
    for mode in timing.MODES:
        paths = timing.HandoffPaths(source, target, maps, ids[:, :26], ids[:, 26:], timing.PathOptions(mode))
        with torch.inference_mode():
            out[mode] = {name: paths.path(name)().clone() for name in timing.PATHS}
            again = paths.source_cache_handoff()  # a reused cache gives the same answer on every call
        assert torch.equal(again, out[mode]["source_cache_handoff"])
    with torch.no_grad():
        plain = target(input_ids=ids).logits[0, -1]  # transformers, no cache object of ours
    for mode in timing.MODES:
        assert (out[mode]["target_reprefill"] - plain).abs().max().item() <= 1e-5
        assert (out[mode]["target_cache_continue"] - plain).abs().max().item() <= 1e-5
    for name in timing.PATHS:
        assert (out["optimised"][name] - out["shipped"][name]).abs().max().item() <= 1e-5


def test_a_stage_alone_gives_the_handoffs_logits_and_refuses_what_cannot_run_alone(models):
    """`HandoffPaths.stage`: the optimised handoff's translate then new_turn, called apart, end at the logits of
    the whole handoff; a path that is one step is that path; the shipped mode's pieces, a path outside `need` and
    an unknown name are refused by name."""
    source, target = models["large", torch.float32], models["small", torch.float32]
    ids = random_ids(30, target.config.vocab_size, 9)
    maps = random_maps(source, target, 3)
    paths = timing.HandoffPaths(
        source, target, maps, ids[:, :26], ids[:, 26:], need=("target_reprefill", "source_cache_handoff")
    )
    with torch.inference_mode():
        whole = paths.source_cache_handoff().clone()
        paths.stage("translate")()
        assert torch.equal(paths.stage("new_turn")(), whole) and torch.equal(
            paths.stage("new_turn", eager=True)(), whole
        )
        assert torch.equal(paths.stage("target_reprefill")(), paths.target_reprefill())
    with pytest.raises(ValueError, match="not in `need`"):
        paths.stage("target_cache_continue")
    with pytest.raises(ValueError, match="unknown stage 'build_cache'"):
        paths.stage("build_cache")
    shipped = timing.HandoffPaths(source, target, maps, ids[:, :26], ids[:, 26:], timing.PathOptions("shipped"))
    with pytest.raises(ValueError, match="runs alone only in the optimised mode"):
        shipped.stage("new_turn")


def test_adaptive_trials_stop_at_the_cv_limit_or_the_cap(monkeypatch):
    clock = {"t": 0.0}
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock["t"])

    def steady():
        clock["t"] += 1.0

    durations = iter([1.0, 2.0] * 50)

    def jumpy():
        clock["t"] += next(durations)

    assert len(timing.run_trials(steady, "cpu", 0, 3, cv_limit=0.1, max_repeats=20)) == 3
    assert len(timing.run_trials(jumpy, "cpu", 0, 3, cv_limit=0.1, max_repeats=20)) == 20
    assert len(timing.run_trials(jumpy, "cpu", 0, 3)) == 3  # no cap given: exactly the repeats
    # a time cap ends the extra trials once they add up to max_seconds, but never cuts the repeats short
    trials = timing.run_trials(jumpy, "cpu", 0, 3, cv_limit=0.1, max_repeats=20, max_seconds=6)
    assert len(trials) == 4 and sum(trials[:3]) < 6 <= sum(trials)  # 1 + 2 + 1 (or 2 + 1 + 2) < 6 s: one more
    assert len(timing.run_trials(jumpy, "cpu", 0, 3, cv_limit=0.1, max_repeats=20, max_seconds=1)) == 3


def test_a_time_cap_gives_cheap_noisy_steps_more_trials_than_slow_ones(monkeypatch):
    """Interleaved with max_seconds: both callables are as noisy, but the 10× slower one reaches the cap first."""
    clock = {"t": 0.0}
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock["t"])

    def jumpy(scale):
        steps = iter([1.0, 2.0] * 50)

        def fn():
            clock["t"] += scale * next(steps)

        return fn

    trials = timing.run_interleaved(
        {"slow": jumpy(10.0), "cheap": jumpy(1.0)}, "cpu", 0, 3, cv_limit=0.1, max_repeats=30, max_seconds=20
    )
    assert trials["slow"] == [10.0, 20.0, 10.0]  # 40 s after its repeats: no extra trial
    assert len(trials["cheap"]) == 14 and sum(trials["cheap"][:-1]) < 20 <= sum(trials["cheap"])


def test_breakdown_extra_trials_stop_at_the_time_cap(monkeypatch):
    """The handoff's breakdown goes on while translate or new turn is noisy, until its trials add up to max_seconds."""
    from types import SimpleNamespace

    clock = {"t": 0.0}
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock["t"])
    steps = iter([1.0, 2.0] * 50)

    def handoff(mark):
        for stage in timing.STAGES:
            clock["t"] += next(steps) if stage == "translate" else 0.5
            mark(stage)

    paths = SimpleNamespace(target=torch.nn.Linear(1, 1), optimised=False, source_cache_handoff=handoff)
    out = timing.time_breakdown(
        paths, timing.Trials(warmups=0, repeats=2, cv_limit=0.1, max_repeats=30, max_seconds=10)
    )
    # trials of 2.0 / 3.0 s in turn: 2 + 3 + 2 < 10 ≤ 2 + 3 + 2 + 3, so four trials
    assert out["translate"]["trials_s"] == [1.0, 2.0, 1.0, 2.0] and out["new_turn"]["n"] == 4
    assert (
        timing.time_breakdown(paths, timing.Trials(0, 2, 0.1, 30))["translate"]["n"] == 30
    )  # no time cap: the count cap


def test_interleaved_trials_take_turns_after_every_warm_up(monkeypatch):
    """Warm-ups first (per name), then one trial of each callable per round in the order given; a noisy one goes
    on alone after the steady one has its repeats; every trial is the time of its own call."""
    clock, calls = {"t": 0.0}, []
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock["t"])
    jumps = iter([1.0, 3.0] * 50)

    def steady():
        calls.append("a")
        clock["t"] += 2.0

    def jumpy():
        calls.append("b")
        clock["t"] += next(jumps)

    trials = timing.run_interleaved({"a": steady, "b": jumpy}, "cpu", {"a": 1, "b": 2}, 3, cv_limit=0.1, max_repeats=5)
    assert calls == ["a", "b", "b"] + ["a", "b"] * 3 + ["b", "b"]
    assert trials == {"a": [2.0] * 3, "b": [1.0, 3.0, 1.0, 3.0, 1.0]}  # the warm-ups took the first 1.0 and 3.0
    with pytest.raises(ValueError, match="warmups ≥ 0"):
        timing.run_interleaved({"a": steady}, "cpu", {"a": -1}, 3)


def test_handoffs_time_interleaved_and_reserve_only_the_caches_their_paths_write(models, monkeypatch):
    """Re-prefill and every (translator, refresh) handoff take one trial each per round; each translator's source
    capture is made once; one handoff cache per pure translation and one re-prefill cache are reserved; a
    path left out of `need` is refused, not run on a cache that was never reserved; results equal the paths'."""
    from kvlingo.core.refresh import Refresh

    source, target = models["large", torch.float32], models["small", torch.float32]
    ids = random_ids(30, target.config.vocab_size, 11)
    a, b = random_maps(source, target, 5), random_maps(source, target, 6)
    made, prefills = [], []
    real_init, real_prefill = timing.HandoffPaths.__init__, timing.prefill

    def spy_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(timing.HandoffPaths, "__init__", spy_init)
    monkeypatch.setattr(timing, "prefill", lambda *args, **kwargs: prefills.append(1) or real_prefill(*args, **kwargs))
    order = []
    real_run = timing.run_interleaved

    def spy_run(fns, *args, **kwargs):
        order.extend(fns)
        return real_run(fns, *args, **kwargs)

    monkeypatch.setattr(timing, "run_interleaved", spy_run)
    handoffs = {"a|none": (a, None), "a|tail:5": (a, Refresh.parse("tail:5")), "b|none": (b, Refresh.parse("none"))}
    out = timing.time_handoffs(
        source, target, handoffs, ids[:, :26], ids[:, 26:], timing.Trials(warmups=1, repeats=2), mode="optimised"
    )
    assert order == ["target_reprefill", *handoffs]  # one run_interleaved call over all of them
    assert list(out["handoff"]) == list(handoffs) and out["reprefill"]["n"] == 2
    assert all(s["n"] == 2 and len(s["trials_s"]) == 2 for s in out["handoff"].values())
    assert len(prefills) == 2  # one source capture per translator, shared by its settings
    assert [p.reprefill_cache is not None for p in made] == [True, False, False]
    assert [p.handoff_cache is not None for p in made] == [True, False, True]  # the refresh builds its own
    own = real_prefill(target, ids[:, :26])  # the target's own cache given, but no path continues it: not copied
    lean = timing.HandoffPaths(
        source, target, a, ids[:, :26], ids[:, 26:], need=("target_reprefill",), target_kv=(own.keys, own.values)
    )
    assert lean.own_cache is None and lean.handoff_cache is None and lean.reprefill_cache is not None
    with torch.inference_mode():
        for p in made[1 : len(handoffs)]:  # the handoffs after the first (not `lean` below)
            with pytest.raises(ValueError, match="not in `need`"):
                p.path("target_reprefill")
            with pytest.raises(ValueError, match="not in `need`.*was not made"):
                p.target_reprefill()
        full = timing.HandoffPaths(source, target, a, ids[:, :26], ids[:, 26:])
        assert torch.equal(made[0].source_cache_handoff(), full.source_cache_handoff())
        assert torch.equal(made[0].target_reprefill(), full.target_reprefill())
    with pytest.raises(ValueError, match="at least one handoff"):
        timing.time_handoffs(source, target, {}, ids[:, :26], ids[:, 26:], timing.Trials(0, 1))


def test_timing_paths_defer_on_a_cpu_where_cheaper_and_agree_with_transformers(translator_pairs):
    for name in ("headwise", "crosslayer k=2 rank 12"):
        source, target, maps = translator(translator_pairs, name, seed=6)
        ids = random_ids(30, target.config.vocab_size, 6)
        with torch.no_grad():
            handed = continue_from(target, *maps(capture(source, ids[:, :26])), ids[:, 26:], kind="dynamic").logits[
                0, -1
            ]
            native = target(input_ids=ids).logits[0, -1]
        with torch.inference_mode():
            on = timing.HandoffPaths(
                source, target, maps, ids[:, :26], ids[:, 26:], timing.PathOptions("optimised", defer_values=True)
            )
            off = timing.HandoffPaths(
                source, target, maps, ids[:, :26], ids[:, 26:], timing.PathOptions("optimised", defer_values=False)
            )
            shipped = timing.HandoffPaths(
                source, target, maps, ids[:, :26], ids[:, 26:], timing.PathOptions("shipped", defer_values=True)
            )
            assert on.defer_values and not off.defer_values and not shipped.defer_values  # shipped: never
            for paths in (on, off):
                for path in timing.PATHS:
                    ref = handed if "handoff" in path else native
                    assert (paths.path(path)() - ref).abs().max().item() <= 1e-5, (name, path)
                assert torch.equal(paths.source_cache_handoff(), paths.source_cache_handoff())  # a reused cache
            assert on.handoff_cache.deferred and not off.handoff_cache.deferred


def test_timing_defers_by_default_on_a_cpu_only_where_it_saves_flops(translator_pairs):
    """Translating a cross-head map's values costs 2·mix·d_out per context token; deferring them costs each of
    the turn's q_heads·k query rows 2·(mix − d_t) per context token: on the tiny pair that saves FLOPs for
    a 1-token turn, not for a 16-token one. Head-wise deferral adds only the per-row maps (mix = d_t): it
    saves FLOPs on any but the shortest contexts (here from 33 tokens on, for a 16-token turn)."""
    from kvlingo.bench.roofline import deferral_saves

    source, target, headwise = translator(translator_pairs, "headwise")
    cross = translator(translator_pairs, "crosshead")[2]
    assert not deferral_saves(headwise, target, 32, 16) and deferral_saves(headwise, target, 33, 16)
    assert timing.defer_values_here(headwise, "cpu", target=target)  # 4,096 tokens by default
    assert not timing.defer_values_here(headwise, "cuda", target=target)  # untimed there: asked for with True
    assert timing.defer_values_here(headwise, "cuda", wanted=True)
    assert timing.defer_values_here(cross, "cpu", target=target, n=30, k=1)
    assert not timing.defer_values_here(cross, "cpu", target=target, n=30, k=16)
    assert timing.defer_values_here(cross, "cpu", wanted=True)  # asked for: deferred even where it costs more


def test_timing_paths_agree_and_keep_raw_trials(bench_setup):
    large, small = bench_setup["large"], bench_setup["small"]
    ids = as_ids(bench_setup["test"][0]["prefix_ids"], "cpu")
    k = 4
    paths = timing.HandoffPaths(large, small, bench_setup["cf"], ids[:, :-k], ids[:, -k:])
    with torch.inference_mode():
        plain = small(input_ids=ids).logits[0, -1]  # independent reference for the target's own paths
        assert torch.allclose(paths.target_reprefill(), plain, atol=1e-5)
        assert torch.allclose(paths.target_cache_continue(), plain, atol=1e-5)
        assert torch.equal(paths.source_cache_handoff(), paths.source_prefill_handoff())
    with torch.no_grad():  # keeping only the last logits leaves the captured cache unchanged
        ref, lean = capture(large, ids), prefill(large, ids, want_prenorm=True)
    for name in ("keys", "values", "prenorm"):
        assert torch.equal(getattr(ref, name), getattr(lean, name))
    assert torch.allclose(ref.logits[-1:], lean.logits, atol=1e-5)  # one-row vs many-row GEMM rounding
    summaries = timing.time_paths(paths, timing.PATHS, timing.Trials(warmups=1, repeats=4))
    for s in summaries.values():
        assert len(s["trials_s"]) == 4 and all(t > 0 for t in s["trials_s"])
        assert s["median_s"] == statistics.median(s["trials_s"])
        assert s["cv"] == pytest.approx(statistics.stdev(s["trials_s"]) / statistics.mean(s["trials_s"]))
    sp = timing.speedups(summaries)
    assert (
        sp["source_cache_handoff"]
        == summaries["target_reprefill"]["median_s"] / summaries["source_cache_handoff"]["median_s"]
    )
    intervals = timing.speedup_intervals(summaries)
    assert set(intervals) == set(sp) and all(lo <= sp[name] <= hi for name, (lo, hi) in intervals.items())
    br = timing.time_breakdown(paths, timing.Trials(warmups=0, repeats=3))
    assert list(br) == list(timing.STAGES) and all(len(s["trials_s"]) == 3 for s in br.values())
    assert timing.summarize([1.0, 1.0, 1.3], cv_limit=0.1)["noisy"] and not timing.summarize([1.0, 1.01], 0.1)["noisy"]
