"""The physical limit (kvlingo/bench/roofline.py): FLOPs against torch's flop counter, the deferred work a new turn
adds, and measured peaks raised to the rates the timed steps reached."""

from __future__ import annotations

import pytest
import torch
from refs import random_ids
from translators import translated_and_deferred, translator

from kvlingo.core.cache import run_with_cache


@pytest.mark.parametrize("name", ["headwise", "crosshead", "crosslayer k=2 rank 12, key rank 6"])
def test_deferred_work_is_what_the_new_turn_adds_by_torch_flop_counter(translator_pairs, name):
    """`roofline.deferred_work`'s FLOPs equal torch's count of a new turn on the deferred cache minus the same
    turn on the translated cache; `handoff_work` then prices the keys-only translation plus that turn."""
    from torch.utils.flop_counter import FlopCounterMode

    from kvlingo.bench.roofline import deferred_work, handoff_work

    source, target, maps = translator(translator_pairs, name, seed=8)
    ids = random_ids(39, target.config.vocab_size, 8)
    _, plain, deferred = translated_and_deferred(source, target, maps, ids, 30, 9)
    counts = []
    for cache in (plain, deferred):
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            run_with_cache(target, ids[:, 30:], cache=cache)
        counts.append(counter.get_total_flops())
    flops, _ = deferred_work(maps, target, 30, 9, torch.float32)
    assert flops == counts[1] - counts[0] != 0
    on, off = (handoff_work(source, target, maps, 30, 9, torch.float32, defer_values=d) for d in (True, False))
    assert on["translation"][0] == maps.flops_per_token(0) * 30 and off["translation"][0] == maps.flops_per_token() * 30
    assert on["new_turn"][0] - off["new_turn"][0] == flops and on["reprefill"] == off["reprefill"]


def test_forward_flops_match_torch_flop_counter(models):
    from torch.utils.flop_counter import FlopCounterMode

    from kvlingo.bench.roofline import Peaks, forward_flops, step_floor

    model = models["small", torch.float32]
    c = model.config
    for q in (1, 5):
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(input_ids=random_ids(q, c.vocab_size), logits_to_keep=1)
        counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
        matmuls = sum(n for op, n in counts.items() if "attention" not in op)
        causal = 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * q * (q + 1) / 2
        assert forward_flops(model, q, 0) == matmuls + causal  # dense layers and one row of logits, then attention
        if q == 1:
            assert forward_flops(model, q, 0) == counter.get_total_flops()  # one query: nothing is masked
    floor = step_floor(2e9, 1e9, Peaks(1e12, 1e11, "given"))
    assert floor["floor_s"] == 1e-2 and floor["bound"] == "memory"


def test_exact_layer0_flops_match_torch_flop_counter(models):
    """`roofline.layer0_work`'s FLOPs are torch's count of the target's layer 0 from the token ids
    (`layer0.ContextFree.kv`: k_proj and v_proj, norms and RoPE uncounted by both); its bytes read each token's
    embedding row once and the two projections."""
    from torch.utils.flop_counter import FlopCounterMode

    from kvlingo.bench.roofline import layer0_work
    from kvlingo.core.layer0 import ContextFree

    model = models["small", torch.float32]
    c, attn = model.config, model.model.layers[0].self_attn
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        ContextFree(model).kv(random_ids(13, c.vocab_size)[0])
    flops, nbytes = layer0_work(model, 13, torch.float32)
    assert flops == counter.get_total_flops() > 0
    assert nbytes == 4 * (13 * c.hidden_size + attn.k_proj.weight.numel() + attn.v_proj.weight.numel())


def test_measured_peaks_are_raised_to_the_rates_the_timed_steps_reached():
    """A step that did F FLOPs and moved B bytes in t s shows the device reaches F / t and B / t: a measured peak
    below either is raised to it (naming the step), so every floor is at most its step's time; peaks already higher,
    or given (not to be raised), stay as they are."""
    from kvlingo.bench.roofline import Peaks, raise_to_reached, step_floor

    probe = Peaks(1e9, 1e9, "measured (test)")
    steps = [("a", 4e9, 1e8, 2.0), ("b", 1e9, 3e9, 1.0), ("c", 1e9, 1e9, 4.0)]  # 2e9 / 1e9 / 2.5e8 FLOP/s
    up = raise_to_reached(probe, steps)
    assert (up.flops_per_s, up.bytes_per_s) == (2e9, 3e9)
    assert up.source.startswith("measured (test); ") and "what a reached" in up.source and "what b reached" in up.source
    for _, flops, nbytes, seconds in steps:
        assert step_floor(flops, nbytes, up)["floor_s"] <= seconds * (1 + 1e-12)
    assert step_floor(4e9, 1e8, probe)["floor_s"] == 4.0  # the probe's floor for step a: twice its time
    kept = raise_to_reached(probe, steps, flops=False)
    assert (kept.flops_per_s, kept.bytes_per_s) == (1e9, 3e9) and "FLOP/s raised" not in kept.source
    high = Peaks(1e12, 1e12, "given")
    assert raise_to_reached(high, steps) == high
