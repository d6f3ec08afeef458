"""The memory and time estimate (kvlingo/train/footprint.py): refused before any work when it does not fit,
per rank, and its graph memory against the bytes autograd itself saves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from rankrun import cli, main
from tinypair import load_tiny_pair

from kvlingo.core.families.headwise.maps import Headwise
from kvlingo.core.translator import Geometry
from kvlingo.inputs.data import read_split
from kvlingo.inputs.profiles import get_profile
from kvlingo.train import footprint as E
from kvlingo.train.distributed import SINGLE, World, WorldRefused

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


def test_refuses_a_run_that_does_not_fit_before_any_work(tiny_pair_paths, parallel_data, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(cli(tiny_pair_paths, parallel_data, tmp_path, "small", "--memory-limit-gib", "0.001"))
    out, err = capsys.readouterr()
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert "estimated peak" in err and "exceeds the 0.0 GiB" in err and "--no-memory-check" in err
    assert "estimate: peak" in out and "assumes throughput" in out
    assert not (tmp_path / "artifacts").exists() and not (tmp_path / "results").exists()


def test_more_ranks_than_conversations_is_refused(tiny_pair_paths):
    from kvlingo.inputs.models import resolve_pair

    pair_cfg, _ = resolve_pair(str(tiny_pair_paths[0]), str(tiny_pair_paths[1]), "l2s", "cpu", "float32")
    cfg = SimpleNamespace(updates=4, batch=2, val_every=2)
    args = SimpleNamespace(closed_form_only=False, memory_limit_gib=None, assume_tflops=None, no_memory_check=False)
    tr = Headwise(Geometry(**pair_cfg.geometry))
    with pytest.raises(WorldRefused, match="3 ranks but 2 conversations per update"):
        E.before_training(pair_cfg, tr, cfg, get_profile("tiny"), World(0, 3), args)
    lines: list[str] = []
    est = E.before_training(pair_cfg, tr, cfg, get_profile("tiny"), World(0, 2), args, say=lines.append)
    assert est.conversations_per_rank == 1 and lines[0].startswith("estimate: peak")
    one = E.before_training(pair_cfg, tr, cfg, get_profile("tiny"), SINGLE, args, say=lines.append)
    assert one.conversations_per_rank == 2 and est.seconds_per_update < one.seconds_per_update


def test_graph_memory_matches_what_autograd_saves(tiny_pair_paths, parallel_data):
    """The estimate's graph terms against the bytes of the distinct tensors autograd saves for one
    conversation's backward (translation, target graph and the KL's saved log-softmaxes)."""
    from kvlingo.train.distill import distill_loss

    pair = load_tiny_pair(tiny_pair_paths)
    rows = read_split(parallel_data, "train", "natural", pair.target.config.vocab_size)
    row = max(rows, key=lambda r: len(r["prefix_ids"]))
    tr = Headwise(Geometry.of(pair.source, pair.target)).bind(pair.source, pair.target)
    seen: dict[int, int] = {}

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    params = {p.untyped_storage().data_ptr() for m in (pair.source, pair.target, tr) for p in m.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        distill_loss(pair.source, pair.target, tr, row, torch.float32)
    saved = sum(n for ptr, n in seen.items() if ptr not in params)
    src, tgt = E.Shape.of(pair.source.config), E.Shape.of(pair.target.config)
    est = E.estimate(
        src,
        tgt,
        tr.n_params(),
        tr.flops_per_token(),
        prefix_cap=len(row["prefix_ids"]),
        reply_cap=len(row["reply_ids"]),
        batch=1,
        dtype_bytes=4,
        prenorm=True,
        nproc=1,
        device=E.Device("cpu", "cpu", 1e12, 1.0, "test"),
    )
    n, C = len(row["reply_ids"]), len(row["prefix_ids"]) - 1
    predicted = est.memory["translation"] + est.memory["target graph"] + 2 * 4 * n * tgt.vocab
    assert 0.8 < saved / predicted < 1.25, (saved, predicted, C, n)


def test_a_planned_gpu_is_named_whole_in_any_case_or_refused_with_the_nearest():
    h100 = E.DEVICES["H100"]["memory_gib"] * E.GIB
    for name in ("H100", "h100", " H100 "):
        dev = E.describe_device("cuda", 2, name=name)
        assert (dev.name, dev.memory_bytes) == ("H100", h100) and "989 TFLOP/s" in dev.basis
    for typo, near in (("H1000", "H100"), ("A100 40GB", "A100"), ("h20", "H200")):
        with pytest.raises(E.RunRefused, match=rf"--gpu '{typo}' is not a GPU .* \(did you mean {near}\?\)"):
            E.describe_device("cuda", 2, name=typo)
    with pytest.raises(E.RunRefused, match="name one of H200, H100, A100, L40S, A10, 4090") as e:
        E.describe_device("cuda", 2, name="MI300X", memory_gib=192.0)  # the throughput would come from the table
    assert "did you mean" not in str(e.value)
    label = E.describe_device("cuda", 2, name="MI300X", memory_gib=192.0, tflops=700.0)  # the table supplies nothing
    assert (label.name, label.memory_bytes, label.tflops) == ("MI300X", 192.0 * E.GIB, 700.0)


@pytest.mark.parametrize(
    "reported, card",
    [("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA A100-SXM4-40GB", "A100"), ("NVIDIA A10", "A10"), ("Tesla T4", None)],
)
def test_a_detected_gpu_maps_to_the_card_its_reported_name_holds(reported, card, monkeypatch):
    props = SimpleNamespace(name=reported, total_memory=40 * E.GIB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda rank: props)
    for name in (None, ""):  # no --gpu, or an empty one: this machine's device
        dev = E.describe_device("cuda", 2, name=name)
        assert dev.name == reported and dev.memory_bytes == 40 * E.GIB  # the device's own memory, not the table's
        peak = E.DEVICES[card]["bf16"] if card else None
        assert dev.tflops == (peak * E.MFU if card else E.FALLBACK_TFLOPS["cuda"]["bf16"]), dev
