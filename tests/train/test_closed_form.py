"""The closed-form fit over data (kvlingo/train/closed_form.py) against torch.linalg.lstsq: it beats the
baselines on held-out rows, recovers the identity on a self pair, and fits across depth, KV heads and head_dim."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
from refs import tiny_ids
from tinypair import tiny_model
from trainrun import fitted

from kvlingo.core.cache import capture
from kvlingo.core.families.headwise.maps import Headwise
from kvlingo.core.handoff import as_ids
from kvlingo.core.translator import Geometry
from kvlingo.inputs.models import ModelSpec, load_model
from kvlingo.train.closed_form import fit_closed_form

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


def _features(pair, translator, rows):
    """Stacked fit inputs/outputs over rows: (xk, yk, xv, yv), each [layers, heads, tokens, dim] in FP64."""
    parts = []
    for r in rows:
        ids = as_ids(r["prefix_ids"] + r["reply_ids"], "cpu")
        with torch.no_grad():
            s, t = capture(pair.source, ids), capture(pair.target, ids)
        parts.append((translator.source(0, s), translator.space.target_keys(t), s.values, t.values))
    return [torch.cat([p[i] for p in parts], dim=2).double() for i in range(4)]


@pytest.mark.parametrize("key_space,weighting", [("prenorm", "uniform"), ("cache", "attention")])
def test_closed_form_matches_lstsq_and_beats_baselines_on_held_out(pair32, train_data, key_space, weighting):
    _, train, val = train_data
    maps, stats = fitted(pair32, train[:12], key_space, weighting)
    assert stats["n_conversations"] == 12 and maps.weight.dtype == torch.float32
    tr = maps
    xk_fit, yk_fit, _, yv_fit = _features(pair32, tr, train[:12])
    assert stats["n_tokens"] == xk_fit.shape[2]
    if weighting == "uniform":  # independent reference: per-block lstsq on [x, 1]
        for l, h in [(0, 0), (1, 1)]:
            a = torch.cat([xk_fit[l, h], torch.ones(xk_fit.shape[2], 1, dtype=torch.float64)], 1)
            ref = torch.linalg.lstsq(a, yk_fit[l, h]).solution
            got = torch.cat([maps.weight[0, l, h], maps.bias[0, l, h][None]]).double()
            assert ((got - ref).norm() / ref.norm()).item() < 1e-5

    # Held out: MSE of translated vs target K/V, in the space the maps write (what least squares minimises).
    # In `cache` space that equals the error of the final cached keys (RoPE is a rotation); in `prenorm` space
    # it is the error before the target's k_norm, a non-linear step the fit does not see.
    xk, yk, xv, yv = _features(pair32, tr, val)

    def mse(m):
        with torch.no_grad():
            k, v = m._affine(0, xk.float(), slice(None), None), m._affine(1, xv.float(), slice(None), None)
        return torch.stack([(k.double() - yk).pow(2).mean(), (v.double() - yv).pow(2).mean()])

    g = maps.geometry
    mean_only = Headwise(g, key_space)  # the train mean: what the bias alone could learn
    with torch.no_grad():
        mean_only.bias.copy_(torch.stack([yk_fit.mean(2), yv_fit.mean(2)]).float())
    fit = mse(maps)
    baselines = {"zero": Headwise(g, key_space), "identity": Headwise.identity(g, key_space), "train mean": mean_only}
    for name, base in baselines.items():
        assert (fit < mse(base)).all(), (name, fit, mse(base))


@pytest.mark.parametrize("key_space", ["prenorm", "cache"])
def test_self_pair_fit_recovers_identity(tiny_pair_paths, train_data, key_space):
    """Source == target: the exact answer is the identity map, and the translated cache is the model's own."""
    model = load_model(ModelSpec.parse(str(tiny_pair_paths[0])), "cpu", torch.float32)
    _, train, val = train_data
    maps = Headwise(Geometry.of(model, model), key_space).bind(model, model)
    fit_closed_form(model, model, maps, train[:4], "attention")
    assert (maps.weight - torch.eye(16)).abs().max().item() < 1e-3 and maps.bias.abs().max().item() < 1e-3
    with torch.no_grad():
        cap = capture(model, as_ids(val[0]["prefix_ids"], "cpu"))
        k, v = maps(cap)
    assert (k - cap.keys).abs().max().item() < 1e-3 and (v - cap.values).abs().max().item() < 1e-3


@pytest.mark.parametrize("family", ["crosshead", "crosslayer"])
def test_closed_form_and_translation_across_depth_kv_heads_and_head_dim(family):
    """A Llama source (3 layers × 1 KV head × head_dim 16, llama3 RoPE) and a Qwen3 target (2 × 2 × 8, k_norm):
    the FP64 closed form fits (in sample it beats the mean-only map, as least squares must), the translation
    has the target's layout, and the target continues on it."""
    from kvlingo.core.handoff import capture_source, continue_target, translate
    from kvlingo.records.saved import build
    from kvlingo.train.closed_form import fit_closed_form

    source = tiny_model("llama", "llama3", layers=3, kv_heads=1, seed=1)
    target = tiny_model("qwen3", "default", layers=2, kv_heads=2, head_dim=8, seed=2)
    g = Geometry.of(source, target)
    assert (g.source_layers, g.source_kv_heads, g.source_head_dim) == (3, 1, 16)
    assert (g.target_layers, g.target_kv_heads, g.target_head_dim) == (2, 2, 8)
    tr = build({"family": family, "key_space": "prenorm", "settings": {}, "geometry": asdict(g)}).bind(source, target)
    rows = [
        {"prefix_ids": tiny_ids(20, seed).tolist()[0], "reply_ids": tiny_ids(6, 100 + seed).tolist()[0]}
        for seed in range(10)
    ]
    stats = fit_closed_form(source, target, tr, rows, "uniform", ridge=0.0)
    assert stats["n_tokens"] == 10 * 26 and tr.plan.shape[-1] == (1 if family == "crosshead" else 2)

    def relative_error(row) -> float:
        ids = torch.tensor([row["prefix_ids"] + row["reply_ids"]])
        with torch.no_grad():
            keys, values = translate(source, tr, ids, torch.float32)
            own = capture(target, ids)
        assert keys.shape == own.keys.shape == (2, 2, 26, 8)
        centred = own.values - own.values.mean(dim=2, keepdim=True)
        return ((values - own.values).norm() / centred.norm()).item()

    assert sum(relative_error(r) for r in rows) / len(rows) < 1.0
    with torch.no_grad():
        ids = tiny_ids(12, 77)
        kv = translate(source, tr, ids, torch.float32, cap=capture_source(source, ids, [tr]))
        out = continue_target(target, kv, tiny_ids(3, 78))
    assert out.logits.shape[-2:] == (3, 320) and torch.isfinite(out.logits).all()


def test_value_fit_on_the_attention_output_minimises_what_the_queries_read(tiny_pair_paths, pair32, train_data):
    """--value-fit output: the keys are the plain fit's; the values minimise the error of what the scored queries
    read from the context (measured with eager attention's probabilities), where the plain fit minimises the
    error of each value, and each fit is the better one on its own objective over the fit conversations."""
    rows = train_data[1][:8]
    plain, _ = fitted(pair32, rows)
    out, stats = fitted(pair32, rows, value_fit="output")
    assert stats["value_fit"] == "output"
    assert torch.equal(out.weight[0], plain.weight[0]) and torch.equal(out.bias[0], plain.bias[0])
    assert not torch.allclose(out.weight[1], plain.weight[1], atol=1e-3)
    eager = load_model(ModelSpec.parse(str(tiny_pair_paths[1])), "cpu", torch.float32, attn="eager")

    def errors(maps) -> tuple[float, float]:
        """(Σ |v̂ − v|² over every position, Σ |Σ_j p_ij (v̂_j − v_j)|² over scored queries and query heads)."""
        raw = read = 0.0
        for r in rows:
            n_ctx, R = len(r["prefix_ids"]) - 1, len(r["reply_ids"])
            ids = as_ids(r["prefix_ids"] + r["reply_ids"], "cpu")
            with torch.no_grad():
                s, t = capture(pair32.source, ids), capture(pair32.target, ids)
                v = maps._affine(1, maps.source(1, s), slice(None), None).double()
                attn = eager(input_ids=ids, output_attentions=True).attentions
            d = v - t.values.double()  # [L, H, T, head_dim]
            raw += d.pow(2).sum().item()
            group = attn[0].shape[1] // d.shape[1]
            for l, a in enumerate(attn):
                p = a[0, :, n_ctx : n_ctx + R, :n_ctx].double()  # [q_heads, R, ctx]
                read += (p @ d[l, :, :n_ctx].repeat_interleave(group, 0)).pow(2).sum().item()
        return raw, read

    (plain_raw, plain_read), (out_raw, out_read) = errors(plain), errors(out)
    assert out_read < plain_read and plain_raw < out_raw, (plain_raw, plain_read, out_raw, out_read)


def test_value_fit_on_the_attention_output_refuses_a_cross_head_base(pair32, train_data):
    from kvlingo.records.saved import build

    g = Geometry.of(pair32.source, pair32.target)
    tr = build({"family": "crosshead", "key_space": "prenorm", "settings": {}, "geometry": asdict(g)})
    tr = tr.bind(pair32.source, pair32.target)
    with pytest.raises(ValueError, match="one fit block per target layer and KV head"):
        fit_closed_form(pair32.source, pair32.target, tr, train_data[1][:2], "uniform", 0.0, value_fit="output")
    with pytest.raises(ValueError, match="value fit 'raw' is not one of"):
        fit_closed_form(pair32.source, pair32.target, tr, train_data[1][:2], "uniform", 0.0, value_fit="raw")
