"""Distillation (kvlingo/train/distill.py): the gradient against finite differences, the validation KL lowered
for every family, and the auxiliary attention term."""

from __future__ import annotations

import pytest
import torch
from tinypair import chat_rows, load_tiny_pair
from trainrun import fitted

from kvlingo.core.families.headwise.maps import Headwise
from kvlingo.core.translator import Geometry
from kvlingo.train import distill as D
from kvlingo.train.closed_form import fit_closed_form
from kvlingo.train.distill import distill_loss, distill_step, make_optimizer, validation_kl

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


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
    before = validation_kl(pair.source, pair.target, tr, val, torch.float32)[0]
    opt = make_optimizer(tr, 1e-3, 0.0)
    for u in range(8):
        distill_step(
            pair.source, pair.target, tr, [train[(2 * u + j) % len(train)] for j in range(4)], opt, torch.float32, 1.0
        )
    after = validation_kl(pair.source, pair.target, tr, val, torch.float32)[0]
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


def test_gradient_matches_finite_difference_and_flows_through_bf16_cast(tiny_pair_paths, pair32, train_data):
    _, train, _ = train_data
    maps, _ = fitted(pair32, train[:6])
    tr = maps
    row = train[7]
    loss = D.distill_loss(pair32.source, pair32.target, tr, row, torch.float32)
    loss.backward()
    g = maps.weight.grad.clone()
    direction = torch.randn(maps.weight.shape, generator=torch.Generator().manual_seed(0))
    eps, base = 1e-2, maps.weight.detach().clone()
    vals = []
    for s in (1, -1):
        with torch.no_grad():
            maps.weight.copy_(base + s * eps * direction)
            vals.append(D.distill_loss(pair32.source, pair32.target, tr, row, torch.float32).item())
    fd, an = (vals[0] - vals[1]) / (2 * eps), (g * direction).sum().item()
    assert abs(fd - an) <= 0.05 * abs(an), (fd, an)
    assert all(p.grad is None for m in (pair32.source, pair32.target) for p in m.parameters())

    # BF16 models: the translated K/V are cast to bf16 inside Translator, and gradients still reach the FP32 maps.
    bf = load_tiny_pair(tiny_pair_paths, torch.bfloat16)
    maps16 = Headwise(Geometry.of(bf.source, bf.target)).bind(bf.source, bf.target)
    with torch.no_grad():
        maps16.weight.copy_(base)
    D.distill_loss(bf.source, bf.target, maps16, row, torch.bfloat16).backward()
    for which in (0, 1):
        grad = maps16.weight.grad[which]
        assert maps16.weight.dtype == torch.float32 and torch.isfinite(grad).all() and grad.abs().sum() > 0


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_each_updates_learning_rate_is_the_one_torchs_scheduler_steps_to(schedule):
    """`lr_at` against torch.optim.lr_scheduler stepped once per update: ConstantLR at factor 1, LinearLR from 1
    to 0 and CosineAnnealingLR to η_min 0 over the run's updates (the reference steps recursively; `lr_at` is a
    function of the update, what a resume needs)."""
    from torch.optim import lr_scheduler as S

    from kvlingo.stages.train import LR_SCHEDULES
    from kvlingo.train.distill import LR_SCHEDULES as DISTILL_SCHEDULES
    from kvlingo.train.distill import lr_at

    assert LR_SCHEDULES == DISTILL_SCHEDULES  # the stage's choices (kept without torch, for a fast --help)
    updates, lr = 37, 3e-3
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)
    ref = {
        "constant": lambda: S.ConstantLR(opt, factor=1.0, total_iters=updates),
        "linear": lambda: S.LinearLR(opt, start_factor=1.0, end_factor=0.0, total_iters=updates),
        "cosine": lambda: S.CosineAnnealingLR(opt, T_max=updates, eta_min=0.0),
    }[schedule]()
    for u in range(updates):
        assert lr_at(lr, schedule, u, updates) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-9, abs=1e-15), u
        opt.step()
        ref.step()
    with pytest.raises(ValueError, match="one of constant, linear, cosine"):
        lr_at(lr, "step", 0, updates)
