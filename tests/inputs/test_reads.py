"""What an export says a handoff reads (`kvlingo/inputs/reads.py`): the token ids, and the target's weights by name with
the sha256 of each as stored, so that a server loads and checks only those."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors.torch import load_file

from kvlingo.inputs.reads import handoff_reads


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


def test_an_export_records_the_target_tensors_its_handoff_reads_with_their_sha256(tiny_pair_paths):
    """What a handoff reads of the target, by family, refresh and key space: nothing (cache keys, no refresh); every
    layer's key norm (prenorm keys are finished with it); the embedding, the first norm and layer 0's K/V
    projections (token features), with layer 0's key norm (exact:0); every weight (a refresh that runs the target's
    layers). The sha256 are the stored tensors' (`models.tensor_digest`)."""
    from kvlingo.core.refresh import Refresh
    from kvlingo.inputs.models import ModelSpec, checkpoint_files, read_tensors, tensor_digest
    from kvlingo.inputs.reads import handoff_reads, target_weight_names

    target = ModelSpec.parse(str(tiny_pair_paths[1])).identity()
    names = list(read_tensors(checkpoint_files(target), lambda n: n))
    layers = sorted({n.split(".layers.")[1].split(".")[0] for n in names if ".layers." in n})
    features = {
        "embed_tokens.weight",
        "layers.0.input_layernorm.weight",
        *(f"layers.0.self_attn.{p}_proj.weight" for p in "kv"),
    }

    def picked(family, refresh, space):
        return {n.removeprefix("model.") for n in target_weight_names(names, family, Refresh.parse(refresh), space)}

    assert picked("crosshead", "none", "cache") == set()
    assert picked("crosshead", "tail:4", "prenorm") == {f"layers.{i}.self_attn.k_norm.weight" for i in layers}
    assert picked("tokeninput", "none", "cache") == features
    assert picked("headwise", "exact:0", "cache") == picked("tokeninput", "exact:0", "cache")
    assert picked("tokeninput", "exact:0", "cache") == features | {"layers.0.self_attn.k_norm.weight"}
    reads = handoff_reads("tokeninput", "exact:0", target, "cache")
    stored = read_tensors(checkpoint_files(target), lambda n: [m for m in n if m in reads["target_weights"]])
    assert reads["token_ids"] and reads["target_weights"] == {n: tensor_digest(t) for n, t in stored.items()}
    assert handoff_reads("crosshead", "layers:2", target, "cache")["target_weights"] == "all"
    assert handoff_reads("crosshead", "none", target, "cache") == {
        "source": "keys and values of every source layer",
        "token_ids": False,
        "target_weights": {},
    }
