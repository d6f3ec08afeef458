"""Native controls (kvlingo/eval/controls.py) pass on Qwen3, Llama and Qwen2, and can fail."""

from __future__ import annotations

import pytest
import torch
from refs import tiny_ids
from tinypair import tiny_model

from kvlingo.eval.controls import native_controls, tolerances_for
from kvlingo.inputs.models import ModelSpec, load_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_controls_pass_and_can_fail(bench_setup, dtype):
    model = load_model(ModelSpec.parse(str(bench_setup["small_p"])), "cpu", dtype)
    tol = tolerances_for(dtype)
    for conv in bench_setup["test"][:3]:
        r = native_controls(model, conv["prefix_ids"], conv["reply_ids"], tol)
        assert r["reconstruction"]["passed"] and r["identity"]["passed"], r
        # transformers' own cache and attention: same tensors, same kernels
        shipped = native_controls(model, conv["prefix_ids"], conv["reply_ids"], tol, kind="dynamic")
        assert shipped["reconstruction"]["max_abs_dlogit"] == 0.0
        bad = native_controls(model, conv["prefix_ids"], conv["reply_ids"], tol.scaled(-1.0))
        assert not bad["reconstruction"]["passed"] and not bad["identity"]["passed"]


FAMILIES = [("llama", "llama3"), ("llama", "default"), ("qwen2", "yarn"), ("qwen2", "default")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_type,schedule", FAMILIES + [("qwen3", "yarn"), ("qwen3", "longrope")])
def test_native_controls_pass(model_type, schedule, dtype):
    model = tiny_model(model_type, schedule, dtype=dtype)
    ids = tiny_ids(40, 2)[0].tolist()
    res = native_controls(model, ids[:30], ids[30:], tolerances_for(dtype))
    assert res["reconstruction"]["passed"] and res["identity"]["passed"], res
    assert res["identity"]["values_equal"]
