"""Translator families: closed forms against torch.linalg.lstsq, the layer ranking on a planted relation,
the residual family's start, distillation for every family, resume and the family check on load."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from tinypair import chat_rows, load_tiny_pair, write_prepared

from kvlingo.core.cache import Capture
from kvlingo.core.families.crosslayer.maps import CrossHead, CrossLayer, proportional_layers
from kvlingo.core.families.headwise.maps import Headwise
from kvlingo.core.families.residual.maps import Residual
from kvlingo.core.fit import NormalEquations
from kvlingo.core.translator import Geometry, TranslatorError
from kvlingo.records.saved import load_state, load_translator, read_manifest
from kvlingo.train.closed_form import fit_closed_form
from kvlingo.train.distill import distill_loss, distill_step, make_optimizer, validation_kl
from kvlingo.train.ranking import LayerStats

GEOM = Geometry(
    source_layers=4, source_kv_heads=2, source_head_dim=8, target_layers=3, target_kv_heads=3, target_head_dim=4
)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


def fake_capture(g: Geometry, tokens: int, seed: int = 0) -> Capture:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(g.source_layers, g.source_kv_heads, tokens, g.source_head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(g.source_layers, g.source_kv_heads, tokens, g.source_head_dim, generator=gen, dtype=torch.float64)
    return Capture(keys=x, values=v, prenorm=x, logits=torch.empty(0))


def lstsq_blocks(x, y, w=None, ridge=0.0):
    """Per-block textbook least squares on [x, 1], rows scaled by √w, ridge as extra rows (bias not shrunk)."""
    L, B, T, d = x.shape
    out = torch.zeros(L, B, d + 1, y.shape[-1], dtype=torch.float64)
    for l in range(L):
        for b in range(B):
            a, t = torch.cat([x[l, b], torch.ones(T, 1, dtype=torch.float64)], 1), y[l, b]
            if w is not None:
                s = w[l, b].sqrt()[:, None]
                a, t = a * s, t * s
            if ridge:
                a = torch.cat([a, torch.eye(d + 1, dtype=torch.float64)[:d] * ridge**0.5])
                t = torch.cat([t, torch.zeros(d, t.shape[1], dtype=torch.float64)])
            out[l, b] = torch.linalg.lstsq(a, t).solution
    return out


@pytest.mark.parametrize(
    "make",
    [
        lambda: CrossHead(GEOM, rank=0),
        lambda: CrossLayer(GEOM, k=2, pairing="proportional"),
        lambda: Headwise(Geometry(3, 2, 8, 3, 2, 4)),
    ],
)
@pytest.mark.parametrize("weighted,ridge", [(False, 0.0), (True, 0.0), (True, 0.7)])
def test_linear_closed_forms_match_lstsq(make, weighted, ridge):
    tr = make()
    g = tr.geometry
    cap = fake_capture(g, 300)
    L, B, d_in, d_out = tr.fit_blocks()
    gen = torch.Generator().manual_seed(1)
    ne = NormalEquations(L, B, d_in, d_out)
    xs = []
    x = tr.design(1, cap).double()  # the values' design (keys differ only by the key space, tested elsewhere)
    for which in (0, 1):
        W = torch.randn(L, B, d_in, d_out, generator=gen, dtype=torch.float64)
        y = x @ W + 0.05 * torch.randn(*x.shape[:3], d_out, generator=gen, dtype=torch.float64)
        w = torch.rand(L, B, 300, generator=gen, dtype=torch.float64) + 0.2 if weighted else None
        ne.update(which, x, y, w)
        xs.append((x, y, w))
    tr.solve_from(ne, ridge)
    for which, (x, y, w) in enumerate(xs):
        ref = lstsq_blocks(x, y, w, ridge)
        got = _augmented(tr, which).double()  # [L, B, d_in+1, d_out] from the parameters
        assert ((got - ref).norm() / ref.norm()).item() < 1e-6  # parameters are FP32: one rounding
    # and the translation uses the parameters as the design says: map(x) = x̃ᵀW̃, block by block
    got = _augmented(tr, 1).double()
    pred = torch.einsum("lbtd,lbdo->lbto", torch.cat([x, torch.ones_like(x[..., :1])], -1), got)
    out = tr.map(1, _capture_for(tr, cap), slice(None)).double()  # [L, H_t, T, d_t]
    assert (tr.block_targets(out) - pred).abs().max().item() < 1e-4


def _capture_for(tr, cap):
    return Capture(cap.prenorm.float(), cap.values.float(), cap.prenorm.float(), cap.logits)


def _augmented(tr, which):
    if isinstance(tr, Headwise):
        return torch.cat([tr.weight[which], tr.bias[which][..., None, :]], -2).detach()
    return torch.cat([tr.weight[which], tr.bias[which][:, None, :]], -2)[:, None].detach()


def test_fit_solves_match_lstsq_in_fp64_to_1e9():
    """The solve itself, before the FP32 parameters: FP64 against lstsq on a planted exact relation."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 1, 200, 12, generator=g, dtype=torch.float64)
    W = torch.randn(2, 1, 12, 5, generator=g, dtype=torch.float64)
    y = x @ W + 0.3
    for w, ridge in ((None, 0.0), (torch.rand(2, 1, 200, generator=g, dtype=torch.float64) + 0.1, 0.5)):
        ne = NormalEquations(2, 1, 12, 5)
        ne.update(0, x, y, w)
        ne.update(1, x, y, w)
        got = ne.solve_augmented(ridge)[0]
        ref = lstsq_blocks(x, y, w, ridge)
        assert ((got - ref).norm() / ref.norm()).item() < 1e-9


def test_reduced_rank_is_the_best_low_rank_fit():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 1, 400, 10, generator=g, dtype=torch.float64)
    low = torch.randn(10, 2, generator=g, dtype=torch.float64) @ torch.randn(2, 6, generator=g, dtype=torch.float64)
    y = x @ low + 0.01 * torch.randn(1, 1, 400, 6, generator=g, dtype=torch.float64)
    tr = CrossLayer(Geometry(1, 2, 5, 1, 2, 3), k=1, rank=2, pairing="proportional")
    ne = NormalEquations(1, 1, 10, 6)
    for which in (0, 1):
        ne.update(which, x, y)
    tr.solve_from(ne, 0.0)
    fitted = tr.down[0, 0].double() @ tr.up[0, 0].double()
    assert ((fitted - low).norm() / low.norm()).item() < 2e-3  # the planted rank-2 map is recovered
    assert tr.flops_per_token() == 2.0 * 2 * 1 * 2 * (10 + 6)


def test_a_key_rank_of_its_own_fits_keys_reduced_and_values_in_full(tmp_path):
    """`key_rank`: the keys keep the reduced-rank solution (a planted rank-2 key map is recovered), the values
    the full least-squares one (against lstsq); each counts its own FLOPs and saves under its own names."""
    from kvlingo.records.saved import save_translator

    g = torch.Generator().manual_seed(6)
    x = torch.randn(1, 1, 400, 10, generator=g, dtype=torch.float64)
    low = torch.randn(10, 2, generator=g, dtype=torch.float64) @ torch.randn(2, 6, generator=g, dtype=torch.float64)
    full = torch.randn(10, 6, generator=g, dtype=torch.float64)
    ys = (x @ low + 0.01 * torch.randn(1, 1, 400, 6, generator=g, dtype=torch.float64), x @ full + 0.5)
    tr = CrossLayer(Geometry(1, 2, 5, 1, 2, 3), k=1, rank=0, key_rank=2, pairing="proportional")
    ne = NormalEquations(1, 1, 10, 6)
    for which, y in enumerate(ys):
        ne.update(which, x, y)
    tr.solve_from(ne, 0.0)
    fitted = tr.key_down[0].double() @ tr.key_up[0].double()
    assert ((fitted - low).norm() / low.norm()).item() < 2e-3
    ref = lstsq_blocks(x, ys[1])[0, 0]  # [d_in+1, d_out]
    got = torch.cat([tr.value_weight[0], tr.bias[1][0][None]]).double()
    assert ((got - ref).norm() / ref.norm()).item() < 1e-6
    assert tr.flops_per_token(0) == 2.0 * 2 * (10 + 6) and tr.flops_per_token(1) == 2.0 * 10 * 6
    assert tr.flops_per_token() == tr.flops_per_token(0) + tr.flops_per_token(1)
    assert set(tr.state_dict()) == {"plan", "key_down", "key_up", "value_weight", "bias"}
    # keys and values of one rank keep one stacked tensor per factor, as folders written before key_rank hold
    assert set(CrossHead(GEOM, rank=2).state_dict()) == {"plan", "down", "up", "bias"}
    assert CrossHead(GEOM, rank=2).settings()["key_rank"] == 2 and CrossHead(GEOM, key_rank=3).ranks == (3, 0)
    save_translator(tmp_path / "t", tr, {})
    loaded = load_state(tmp_path / "t")
    assert loaded.ranks == (2, 0) and all(
        torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), tr.state_dict().values())
    )
    with pytest.raises(TranslatorError, match="key rank 7"):
        CrossHead(Geometry(1, 2, 3, 1, 2, 3), key_rank=7)


def test_ranking_recovers_planted_source_layers():
    """Target layer t is a linear function of source layer perm[t]: R² singles it out."""
    g = torch.Generator().manual_seed(5)
    perm = [2, 0, 3]
    W = torch.randn(3, 8, 6, generator=g, dtype=torch.float64)
    stats = LayerStats(4, 8, 3, 6)
    for part in (0, 1, 0, 0, 1):
        x = torch.randn(4, 120, 8, generator=g, dtype=torch.float64)
        y = torch.stack([x[perm[t]] @ W[t] for t in range(3)]) + 0.1 * torch.randn(
            3, 120, 6, generator=g, dtype=torch.float64
        )
        for which in (0, 1):
            stats.update(part, which, x, y)
    r2 = stats.r2()  # [2, L_s, L_t]
    assert r2.argmax(1)[0].tolist() == perm and r2.max() > 0.95 and r2.min() < 0.1


def test_proportional_pairing_and_crosshead_plan():
    assert [proportional_layers(t, 3, 5) for t in range(3)] == [[0], [2], [4]]
    assert proportional_layers(1, 3, 5, k=3) == [2, 3, 1]
    assert CrossHead(GEOM).plan[0, :, 0].tolist() == [0, 2, 3]  # round(l · 3 / 2): 0, 1.5 → 2, 3
    with pytest.raises(TranslatorError, match="k=5"):
        CrossLayer(GEOM, k=5)


def test_residual_starts_exactly_as_its_base():
    base = Headwise(Geometry(3, 2, 8, 3, 2, 4))
    res = Residual(Geometry(3, 2, 8, 3, 2, 4), base={"family": "headwise", "settings": {}}, hidden=16)
    with torch.no_grad():
        for p in base.parameters():
            p.normal_()
    res.base.load_state_dict(base.state_dict())
    cap = _capture_for(res, fake_capture(res.geometry, 20))
    assert torch.equal(res.map(1, cap, slice(None)), base.map(1, cap, slice(None)))  # keys: on the tiny pair below
    assert res.flops_per_token() > base.flops_per_token()
    with pytest.raises(TranslatorError, match="linear base"):
        Residual(GEOM, base={"family": "residual"})


# --------------------------------------------------------------------------- on the tiny pair
@pytest.fixture(scope="module")
def pair(tiny_pair_paths):
    return load_tiny_pair(tiny_pair_paths)


@pytest.fixture(scope="module")
def rows(tiny_pair_paths):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_pair_paths[0])
    return chat_rows(tok, 20, 0, "f"), chat_rows(tok, 4, 1, "v")


FAMILY_SPECS = [
    ("headwise", {}),
    ("crosshead", {"rank": 0}),
    ("crosshead", {"key_rank": 8}),
    ("crosslayer", {"k": 2, "rank": 8, "pairing": "ranked"}),
    ("residual", {"base": {"family": "crosshead", "settings": {}}, "hidden": 8}),
]


@pytest.mark.parametrize("name,settings", FAMILY_SPECS)
def test_distillation_lowers_validation_kl_for_every_family(pair, rows, name, settings):
    from kvlingo.records.saved import build

    train, val = rows
    tr = build(
        {
            "family": name,
            "key_space": "prenorm",
            "settings": settings,
            "geometry": Geometry.of(pair.source, pair.target).__dict__,
        }
    ).bind(pair.source, pair.target)
    stats = fit_closed_form(pair.source, pair.target, tr, train, "uniform", "auto")
    assert stats["ridge_choice"]["held_out_tokens"] > 0
    if name == "residual":  # zero-initialised MLP: the closed form translates exactly as its base
        from kvlingo.core.handoff import capture_source

        cap = capture_source(pair.source, val[0]["prefix_ids"], [tr])
        with torch.no_grad():
            ours, base = tr(cap), tr.base.bind(pair.source, pair.target)(cap)
        assert torch.equal(ours[0], base[0]) and torch.equal(ours[1], base[1])
    if name == "crosslayer":
        assert torch.equal(tr.plan, torch.tensor(stats["layer_ranking"]["plan"]))
    before = validation_kl(pair.source, pair.target, tr, val, torch.float32)
    opt = make_optimizer(tr, 1e-3, 0.0)
    for u in range(8):
        distill_step(
            pair.source, pair.target, tr, [train[(2 * u + j) % len(train)] for j in range(4)], opt, torch.float32, 1.0
        )
    after = validation_kl(pair.source, pair.target, tr, val, torch.float32)
    assert after < before, (name, before, after)


def test_auxiliary_attention_term_adds_to_the_kl_and_vanishes_on_the_model_itself(pair, rows):
    train, _ = rows
    tr = Headwise(Geometry.of(pair.source, pair.target)).bind(pair.source, pair.target)
    fit_closed_form(pair.source, pair.target, tr, train[:10], "uniform", 0.0)
    kl = distill_loss(pair.source, pair.target, tr, train[11], torch.float32)
    both = distill_loss(pair.source, pair.target, tr, train[11], torch.float32, aux_weight=1.0)
    assert both.item() > kl.item() > 0
    both.backward()
    assert tr.weight.grad.abs().sum() > 0
    me = Headwise.identity(Geometry.of(pair.target, pair.target)).bind(pair.target, pair.target)
    assert distill_loss(pair.target, pair.target, me, train[11], torch.float32, aux_weight=1.0).item() < 1e-6


def test_a_non_default_family_resumes_bit_identically_and_loads_only_as_itself(tiny_pair_paths, tmp_path, capsys):
    from transformers import AutoTokenizer

    import train_translator

    tok = AutoTokenizer.from_pretrained(tiny_pair_paths[0])
    data = write_prepared(
        tmp_path / "data", tok, {"train": chat_rows(tok, 16, 0, "t"), "validation": chat_rows(tok, 4, 1, "v")}
    )

    def argv(root, *extra):
        return [
            "--profile",
            "tiny",
            "--data",
            str(data),
            "--run",
            "r",
            "--large",
            str(tiny_pair_paths[0]),
            "--small",
            str(tiny_pair_paths[1]),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--lr",
            "3e-3",
            "--family",
            "crosslayer",
            "--k",
            "2",
            "--n-fit",
            "16",
            "--updates",
            "6",
            "--checkpoint-every",
            "2",
            "--artifacts",
            str(root / "artifacts"),
            "--results",
            str(root / "results"),
            *extra,
        ]

    train_translator.main(argv(tmp_path / "a"))
    train_translator.main(argv(tmp_path / "b"))
    ck = tmp_path / "b" / "artifacts" / "r" / "checkpoints"
    for u in (4, 6):  # as if killed after the update-2 checkpoint
        (ck / f"DONE_{u:06d}").unlink()
    (tmp_path / "b" / "artifacts" / "r" / "distilled" / "manifest.json").unlink()
    rep = train_translator.main([*argv(tmp_path / "b"), "--resume"])
    assert rep["results"]["resumed_from_update"] == 2
    a, b = (load_state(tmp_path / x / "artifacts" / "r" / "distilled") for x in "ab")
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    manifest = read_manifest(tmp_path / "a" / "artifacts" / "r" / "distilled")
    assert manifest["family"] == "crosslayer" and manifest["settings"]["k"] == 2
    assert len(manifest["settings"]["layers"][0]) == 2  # the ranked layer plan is recorded
    assert json.loads((tmp_path / "a" / "results" / "r" / "train.json").read_text())["results"]["fit"]["layer_ranking"]
    pair = load_tiny_pair(tiny_pair_paths)
    with pytest.raises(TranslatorError, match="family is 'crosslayer'"):
        load_translator(tmp_path / "a" / "artifacts" / "r" / "distilled", pair, family="headwise")
    shutil.rmtree(tmp_path / "b")


def test_a_named_family_takes_its_own_defaults_not_the_profiles():
    """The demo profile's s2l default before was a rank-32 cross-layer map (a variant of the crosslayer module);
    `--family crosslayer --k 2` must be full-rank, and only a run without --family inherits the variant's."""
    from kvlingo.core.translator import Geometry
    from kvlingo.inputs.profiles import get_profile
    from kvlingo.train.config import resolve_family

    toy = Geometry(4, 2, 32, 4, 2, 32)
    demo = replace(get_profile("demo"), family=("crosshead", "crosslayer-k4-rhalf"))
    assert resolve_family(demo, "s2l", "crosslayer", {"k": 2}, toy) == (
        "crosslayer",
        {"k": 2, "rank": 0, "pairing": "ranked"},
    )
    assert resolve_family(demo, "s2l", None, {"k": 2}, toy) == ("crosslayer", {"k": 2, "rank": 32, "pairing": "ranked"})
    assert resolve_family(demo, "s2l", None, {}, toy) == ("crosslayer", {"k": 4, "rank": 32, "pairing": "ranked"})
    assert resolve_family(demo, "l2s", None, {}, toy) == ("crosshead", {"rank": 0})
    # a rank declared as half the target's width is half of whichever target: 512 of Qwen3's 1,024
    real = Geometry(28, 8, 128, 28, 8, 128)
    assert resolve_family(demo, "s2l", None, {}, real)[1]["rank"] == 512
