"""What an export says a handoff reads (`saved.handoff_reads`): the token ids, and the target's weights by name with
the sha256 of each as stored, so that a server loads and checks only those."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors.torch import load_file

from kvlingo.records.saved import handoff_reads


def digest(t: torch.Tensor) -> str:
    """An independent sha256 of a stored tensor: its dtype, shape, then its bytes."""
    h = hashlib.sha256(f"{t.dtype}:{tuple(t.shape)}:".encode())
    h.update(bytes(t.contiguous().view(torch.uint8).numpy()))
    return h.hexdigest()


@pytest.fixture(scope="module")
def target(tiny_pair_paths):
    small = tiny_pair_paths[1]
    stored = {}
    for f in sorted(small.glob("*.safetensors")):
        stored.update(load_file(str(f)))
    return {"path": str(small)}, stored


def test_headwise_maps_without_refresh_read_no_target_weight(target):
    identity, _ = target
    reads = handoff_reads("headwise", "none", identity, "cache")
    assert reads["token_ids"] is False and reads["target_weights"] == {}


def test_a_refresh_that_runs_the_targets_layers_reads_all_of_it(target):
    identity, _ = target
    reads = handoff_reads("headwise", "tail:2", identity, "cache")
    assert reads["token_ids"] is True and reads["target_weights"] == "all"


@pytest.mark.parametrize(
    "family, refresh, norm",
    [("tokeninput", "exact:0", True), ("tokeninput", "none", False), ("headwise", "exact:0", True)],
)
def test_the_token_path_reads_the_embedding_first_norm_and_layer0_kv_with_their_hashes(target, family, refresh, norm):
    identity, stored = target
    reads = handoff_reads(family, refresh, identity, "cache")
    assert reads["token_ids"] is True
    want = {
        n
        for n in stored
        if n.endswith("embed_tokens.weight")
        or n.endswith("layers.0.input_layernorm.weight")
        or ".layers.0.self_attn.k_proj." in f".{n}"
        or ".layers.0.self_attn.v_proj." in f".{n}"
        or (norm and n.endswith("layers.0.self_attn.k_norm.weight"))
    }
    assert want and set(reads["target_weights"]) == want
    # q/o projections, the MLP and every later layer stay unread
    assert not any(".q_proj" in n or ".o_proj" in n or "mlp" in n or ".layers.1." in n for n in reads["target_weights"])
    for name, sha in reads["target_weights"].items():
        assert sha == digest(stored[name]), name
    # a changed tensor changes its hash
    tampered = dict(stored)
    name = sorted(want)[0]
    tampered[name] = stored[name].clone()
    tampered[name].view(-1)[0] += 1
    assert digest(tampered[name]) != reads["target_weights"][name]
