"""CUDA graphs (kvlingo/bench/graphs.py): the graphed paths against the eager ones, with and without deferred
values, on a GPU; the capture refused on a CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from refs import BF16_EPS, random_ids, random_maps
from translators import DEFERRED_BF16_FACTOR, translator

from kvlingo.bench import graphs, timing
from kvlingo.core.cache import capture, continue_from
from kvlingo.inputs.models import ModelSpec, load_model


def test_cuda_graph_capture_refuses_a_cpu():
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        graphs.capture(lambda: None, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_paths_equal_eager_paths(tiny_pair_paths):
    source = load_model(ModelSpec.parse(str(tiny_pair_paths[0])), "cuda", torch.bfloat16)
    target = load_model(ModelSpec.parse(str(tiny_pair_paths[1])), "cuda", torch.bfloat16)
    ids = random_ids(60, target.config.vocab_size, 10).cuda()
    maps = random_maps(source, target, 4).cuda().bind(source, target)
    graphed = timing.HandoffPaths(source, target, maps, ids[:, :52], ids[:, 52:], timing.PathOptions(cuda_graphs=True))
    eager = timing.HandoffPaths(source, target, maps, ids[:, :52], ids[:, 52:], timing.PathOptions(cuda_graphs=False))
    assert not graphed.graph_errors and "new_turn" in graphed.graphed and not eager.graphed
    with torch.inference_mode():
        for name in timing.PATHS:
            a, b = graphed.path(name)().clone(), graphed.path(name)().clone()
            assert torch.equal(a, b) and torch.equal(a, eager.path(name)()), name


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", ["headwise", "crosshead", "crosslayer k=2 rank 12, key rank 6"])
def test_deferred_values_on_cuda_replay_as_cuda_graphs_and_stay_as_close_as_translated(translator_pairs, name):
    """BF16 on CUDA, the optimised paths with the values deferred: replayed as CUDA graphs they give the eager
    paths' logits bit for bit (the deferred attention reads no mask there); the handoff's logits are as close to
    FP32 maths as those of the same paths with the values translated (`DEFERRED_BF16_FACTOR`)."""
    source32, target32, maps32 = translator(translator_pairs, name, torch.float32, seed=9)
    source, target = (copy.deepcopy(m).to("cuda", torch.bfloat16) for m in (source32, target32))
    maps = copy.deepcopy(maps32).cuda().bind(source, target)
    ids = random_ids(60, target.config.vocab_size, 9)
    with torch.no_grad():
        truth = continue_from(target32, *maps32(capture(source32, ids[:, :52])), ids[:, 52:], kind="dynamic").logits[
            0, -1
        ]
    ids = ids.cuda()
    paths = {
        (defer, graphs): timing.HandoffPaths(
            source, target, maps, ids[:, :52], ids[:, 52:], timing.PathOptions(defer_values=defer, cuda_graphs=graphs)
        )
        for defer in (True, False)
        for graphs in (True, False)
    }
    graphed = paths[True, True]
    assert graphed.defer_values and not graphed.graph_errors and {"translate", "new_turn"} <= set(graphed.graphed)
    with torch.inference_mode():
        for path in timing.PATHS:
            a, b = graphed.path(path)().clone(), graphed.path(path)().clone()
            assert torch.equal(a, b) and torch.equal(a, paths[True, False].path(path)()), path
        deferred = (graphed.source_cache_handoff().float().cpu() - truth).abs().max().item()
        translated = (paths[False, True].source_cache_handoff().float().cpu() - truth).abs().max().item()
    assert deferred <= DEFERRED_BF16_FACTOR * translated + BF16_EPS * truth.abs().max().item()
