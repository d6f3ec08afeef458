"""Attention weighting of the fit (kvlingo/train/weighting.py) against eager attention's `output_attentions`, in
Qwen3, Llama and Qwen2."""

from __future__ import annotations

import pytest
import torch
from refs import tiny_ids
from tinypair import tiny_model

from kvlingo.core.handoff import as_ids
from kvlingo.core.rope import RopeCache
from kvlingo.inputs.models import ModelSpec, load_model
from kvlingo.train import weighting as W

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


@pytest.mark.parametrize("model_type,schedule", [("llama", "llama3"), ("qwen2", "yarn")])
def test_attention_weights_read_q_proj_queries(model_type, schedule):
    """Without q_norm the queries are hooked on q_proj (Qwen2: bias included); yarn's attention scaling
    rides on both query and key tables. Reference: eager attention's own probabilities."""
    model = tiny_model(model_type, schedule)
    eager = tiny_model(model_type, schedule, attn_implementation="eager")
    P, R = 25, 8
    ids = tiny_ids(P + R, 3)
    with torch.no_grad():
        attn = eager(input_ids=ids, output_attentions=True).attentions  # per layer [1, q_heads, T, T]
        cap, q = W.capture_with_queries(model, ids, False, q_start=P - 1, n_q=R)
    H = model.config.num_key_value_heads
    ref = torch.stack([a[0, :, P - 1 : P - 1 + R, : P - 1].mean(1).view(H, -1, P - 1).mean(1) for a in attn]).double()
    got = W.scored_attention(model, cap.keys, q, P - 1, P - 1, RopeCache(model))
    assert (got - ref).abs().max().item() < 1e-6


def test_attention_weights_match_eager_output_attentions(tiny_pair_paths, pair32, train_data):
    row = train_data[2][0]
    P, R = len(row["prefix_ids"]), len(row["reply_ids"])
    ids = as_ids(row["prefix_ids"] + row["reply_ids"], "cpu")
    eager = load_model(ModelSpec.parse(str(tiny_pair_paths[1])), "cpu", torch.float32, attn="eager")
    with torch.no_grad():
        attn = eager(input_ids=ids, output_attentions=True).attentions  # per layer [1, q_heads, T, T]
        cap, q = W.capture_with_queries(pair32.target, ids, False, q_start=P - 1, n_q=R)
    H = pair32.target.config.num_key_value_heads
    # scored rows P-1..P+R-2 (they predict the reply), context columns 0..P-2; mean over rows, then over each GQA group
    ref = torch.stack([a[0, :, P - 1 : P - 1 + R, : P - 1].mean(1).view(H, -1, P - 1).mean(1) for a in attn]).double()
    for chunk in (256, 3):
        got = W.scored_attention(pair32.target, cap.keys, q, P - 1, P - 1, RopeCache(pair32.target), chunk=chunk)
        assert (got - ref).abs().max().item() < 1e-6
    w = W.attention_fit_weights(got, P + R)
    assert torch.allclose(w[..., : P - 1].mean(-1), torch.ones(2, H, dtype=torch.float64))
    assert torch.equal(w[..., P - 1 :], torch.ones(2, H, R + 1, dtype=torch.float64))
    assert w[..., : P - 1].std() > 0.1  # really non-uniform


@pytest.mark.parametrize("chunk", [256, 3])
def test_output_rows_solve_the_attention_output_least_squares(tiny_pair_paths, pair32, train_data, chunk):
    """The value fit on attention outputs: its rows, solved as normal equations, give the least-squares map of what
    the scored queries read from the context, Σ_{j<ctx} p_ij ([x_j, 1] W̃ − y_j), with p eager attention's own
    probabilities. Reference: torch.linalg.lstsq on those sums, built row by row."""
    from kvlingo.core.fit import NormalEquations

    row = train_data[2][1]
    P, R = len(row["prefix_ids"]), len(row["reply_ids"])
    n_ctx, T = P - 1, P + R
    ids = as_ids(row["prefix_ids"] + row["reply_ids"], "cpu")
    eager = load_model(ModelSpec.parse(str(tiny_pair_paths[1])), "cpu", torch.float32, attn="eager")
    with torch.no_grad():
        attn = eager(input_ids=ids, output_attentions=True).attentions  # per layer [1, q_heads, T, T]
        cap, q = W.capture_with_queries(pair32.target, ids, False, q_start=n_ctx, n_q=R)
    L, H = len(attn), pair32.target.config.num_key_value_heads
    group = attn[0].shape[1] // H
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(L, H, T, 3, generator=gen, dtype=torch.float64)
    y = torch.randn(L, H, T, 2, generator=gen, dtype=torch.float64)
    z, t, w = W.output_rows(pair32.target, cap.keys, q, n_ctx, n_ctx, RopeCache(pair32.target), x, y, chunk=chunk)
    assert z.shape == (L, H, group * R, 3) and t.shape == (L, H, group * R, 2) and w.shape == (L, H, group * R)
    ne = NormalEquations(L, H, 3, 2)
    ne.update(1, z, t, w)
    got = ne.solve_augmented(0.0)[1]  # the value part: [L, H, 4, 2]
    xa = torch.cat([x, torch.ones(L, H, T, 1, dtype=torch.float64)], -1)
    for l in range(L):
        for h in range(H):
            p = attn[l][0, h * group : (h + 1) * group, n_ctx : n_ctx + R, :n_ctx].double()  # [group, R, ctx]
            a = (p @ xa[l, h, :n_ctx]).reshape(-1, 4)  # Σ_j p_ij [x_j, 1], unnormalised
            b = (p @ y[l, h, :n_ctx]).reshape(-1, 2)
            ref = torch.linalg.lstsq(a, b).solution
            assert ((got[l, h] - ref).norm() / ref.norm()).item() < 1e-5, (l, h)
    assert w.min() < 0.9 * w.max()  # the context's share differs between queries: the weights are not a constant


def test_output_rows_need_one_block_per_kv_head(pair32, train_data):
    row = train_data[2][1]
    P, R = len(row["prefix_ids"]), len(row["reply_ids"])
    ids = as_ids(row["prefix_ids"] + row["reply_ids"], "cpu")
    with torch.no_grad():
        cap, q = W.capture_with_queries(pair32.target, ids, False, q_start=P - 1, n_q=R)
    L = q.shape[0]
    x, y = torch.zeros(L, 1, P + R, 3), torch.zeros(L, 1, P + R, 2)  # one block per layer: a cross-head design
    with pytest.raises(ValueError, match="one fit block per target layer and KV head.*--value-fit values"):
        W.output_rows(pair32.target, cap.keys, q, P - 1, P - 1, RopeCache(pair32.target), x, y)


def test_the_stage_lists_the_fits_the_code_has():
    """The training stage names the weightings and value fits without importing torch (fast --help)."""
    from kvlingo.stages import train as stage

    assert stage.FIT_WEIGHTINGS == W.FIT_WEIGHTINGS and stage.VALUE_FITS == W.VALUE_FITS
