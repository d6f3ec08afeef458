"""Training: the closed-form fit, distillation, checkpoints, resume guards and frozen models.

References: torch.linalg.lstsq for the fit, eager attention's `output_attentions` for the
attention weights, finite differences for the gradient, and an uninterrupted run for resume.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tinypair import chat_rows, load_tiny_pair, write_prepared

from kvlingo.core.cache import capture
from kvlingo.core.families.headwise.maps import Headwise
from kvlingo.core.handoff import as_ids
from kvlingo.core.rope import RopeCache
from kvlingo.core.translator import Geometry
from kvlingo.inputs.models import ModelSpec, load_model
from kvlingo.records import resume
from kvlingo.records.saved import load_state, load_translator, read_manifest
from kvlingo.train import checkpoints as C
from kvlingo.train import distill as D
from kvlingo.train import frozen as F
from kvlingo.train import rng as R
from kvlingo.train import rows as O
from kvlingo.train import weighting as W
from kvlingo.train.closed_form import fit_closed_form

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "train_translator.py"


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


# --------------------------------------------------------------------------- data and pair
def make_rows(tok, n: int, seed: int, tag: str) -> list[dict]:
    return chat_rows(tok, n, seed, tag, system_every=3)


def write_split(folder: Path, train: list[dict], val: list[dict]) -> Path:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TOK[0])
    return write_prepared(folder, tok, {"train": train, "validation": val})


TOK: list = []  # the tiny pair's tokenizer folder, set by the data fixture


@pytest.fixture(scope="module")
def data(tiny_pair_paths, tmp_path_factory):
    from transformers import AutoTokenizer

    TOK[:] = [tiny_pair_paths[0]]
    tok = AutoTokenizer.from_pretrained(tiny_pair_paths[0])
    train, val = make_rows(tok, 24, 0, "train"), make_rows(tok, 6, 1, "val")
    return write_split(tmp_path_factory.mktemp("data"), train, val), train, val


@pytest.fixture(scope="module")
def pair32(tiny_pair_paths):
    return load_tiny_pair(tiny_pair_paths)


def fitted(pair, rows, key_space="prenorm", weighting="uniform", ridge=0.0):
    """A head-wise translator fitted in closed form on `rows`, bound to the pair, and its fit statistics."""
    tr = Headwise(Geometry.of(pair.source, pair.target), key_space).bind(pair.source, pair.target)
    stats = fit_closed_form(pair.source, pair.target, tr, rows, weighting, ridge)
    return tr, stats


def cli(paths, data_dir, root, run, *extra) -> list[str]:
    return [
        "--profile",
        "tiny",
        "--data",
        str(data_dir),
        "--run",
        run,
        "--large",
        str(paths[0]),
        "--small",
        str(paths[1]),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--lr",
        "3e-3",
        "--batch",
        "2",
        "--n-fit",
        "12",
        "--artifacts",
        str(root / "artifacts"),
        "--results",
        str(root / "results"),
        *extra,
    ]


def main(argv):
    import train_translator

    return train_translator.main(argv)


@pytest.fixture(scope="module")
def trained(tiny_pair_paths, data, tmp_path_factory):
    """One complete run: 8 updates, checkpoints every 2, validation every 4."""
    root = tmp_path_factory.mktemp("run")
    args = cli(tiny_pair_paths, data[0], root, "base", "--updates", "8", "--checkpoint-every", "2", "--val-every", "4")
    return root, args, main(args)


def maps_equal(a: Path, b: Path) -> bool:
    ma, mb = load_state(a), load_state(b)
    return torch.equal(ma.weight, mb.weight) and torch.equal(ma.bias, mb.bias)


# --------------------------------------------------------------------------- closed-form fit
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
def test_closed_form_matches_lstsq_and_beats_baselines_on_held_out(pair32, data, key_space, weighting):
    _, train, val = data
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
def test_self_pair_fit_recovers_identity(tiny_pair_paths, data, key_space):
    """Source == target: the exact answer is the identity map, and the translated cache is the model's own."""
    model = load_model(ModelSpec.parse(str(tiny_pair_paths[0])), "cpu", torch.float32)
    _, train, val = data
    maps = Headwise(Geometry.of(model, model), key_space).bind(model, model)
    fit_closed_form(model, model, maps, train[:4], "attention")
    assert (maps.weight - torch.eye(16)).abs().max().item() < 1e-3 and maps.bias.abs().max().item() < 1e-3
    with torch.no_grad():
        cap = capture(model, as_ids(val[0]["prefix_ids"], "cpu"))
        k, v = maps(cap)
    assert (k - cap.keys).abs().max().item() < 1e-3 and (v - cap.values).abs().max().item() < 1e-3


def test_attention_weights_match_eager_output_attentions(tiny_pair_paths, pair32, data):
    row = data[2][0]
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


# --------------------------------------------------------------------------- distillation
def test_gradient_matches_finite_difference_and_flows_through_bf16_cast(tiny_pair_paths, pair32, data):
    _, train, _ = data
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


def test_distillation_lowers_validation_kl_and_writes_outputs(trained, pair32):
    root, _, report = trained
    res = report["results"]
    assert res["distilled_val_kl"] < 0.97 * res["closed_form_val_kl"], res["val_kl_curve"]
    assert [p["update"] for p in res["val_kl_curve"]] == [0, 4, 8] and len(res["loss_curve"]) == 8
    assert res["frozen_weights"]["verified"] and all(m["match"] for m in res["frozen_weights"]["models"].values())
    art, out = root / "artifacts" / "base", root / "results" / "base"
    cf, manifest = load_state(art / "closed_form"), read_manifest(art / "closed_form")
    dist, dmanifest = load_state(art / "distilled"), read_manifest(art / "distilled")
    assert not torch.equal(cf.weight, dist.weight)
    assert dmanifest["direction"] == "l2s" and dmanifest["key_space"] == "prenorm" and dmanifest["family"] == "headwise"
    assert dmanifest["closed_form_sha256"] == manifest["maps_sha256"]
    translator, _ = load_translator(art / "distilled", pair32, key_space="prenorm")  # how later stages load it
    assert torch.equal(translator.weight, dist.weight)
    saved = json.loads((out / "train.json").read_text())
    assert (
        saved["stage"] == "train"
        and saved["config"]["lr"] == 3e-3
        and set(saved["inputs"]["data"]) == {"train.natural.jsonl", "validation.natural.jsonl"}
    )
    assert (out / "train.md").read_text().startswith("# train: base")
    assert (out / "train.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in (art / "checkpoints").iterdir()) == sorted(
        [f"ckpt_{u:06d}.pt" for u in (2, 4, 6, 8)] + [f"DONE_{u:06d}" for u in (2, 4, 6, 8)]
    )


def test_init_from_reuses_the_closed_form(tiny_pair_paths, data, trained, tmp_path):
    root, _, base = trained
    src = root / "artifacts" / "base" / "closed_form"
    rep = main(cli(tiny_pair_paths, data[0], tmp_path, "reuse", "--init-from", str(src), "--closed-form-only"))
    assert maps_equal(src, tmp_path / "artifacts" / "reuse" / "closed_form")
    assert rep["results"]["distilled_val_kl"] is None
    assert rep["results"]["closed_form_val_kl"] == base["results"]["closed_form_val_kl"]
    with pytest.raises(SystemExit) as e:
        main(cli(tiny_pair_paths, data[0], tmp_path, "reuse2", "--init-from", str(src), "--key-space", "cache"))
    assert e.value.code == 2


# --------------------------------------------------------------------------- resume guards and checkpoints
def test_resume_refuses_each_change_and_accepts_none(tiny_pair_paths, data, trained, tmp_path, capsys, monkeypatch):
    root, args, _ = trained
    ckpts = root / "artifacts" / "base" / "checkpoints"
    before = {p.name: p.read_bytes() for p in ckpts.iterdir()}

    def refused(argv, pattern):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1, err  # one line, no traceback
        assert re.search(pattern, err), err

    refused(
        [*args, "--resume", "--lr", "1e-3"],
        r"refusing to resume base.*settings changed: settings\.lr: 0\.003 → 0\.001;.*drop --resume",
    )
    refused(
        [*args, "--resume", "--val-every", "3"], r"settings changed: settings\.val_every: 4 → 3;"
    )  # where the curve is measured
    with monkeypatch.context() as m:  # an edit of the code the stage imports
        m.setattr(resume, "code_hash", lambda *scripts: "e" * 64)
        refused([*args, "--resume"], r"refusing to resume.*code changed: code: \w+… → eeeeeeeeeeee…")
    # data: same folder layout elsewhere, one reply token changed
    rows = [json.loads(line) for line in (data[0] / "train.natural.jsonl").read_text().splitlines()]
    rows[3]["reply_ids"][0] = (rows[3]["reply_ids"][0] + 1) % 300
    changed = write_split(tmp_path / "data", rows, data[2])
    refused(
        [*args, "--resume", "--data", str(changed)], r"data changed: inputs\.data\.train\.natural\.jsonl: \w+… → \w+…"
    )
    # model: a copy of the small model with one weight nudged
    from transformers import AutoModelForCausalLM

    small = tmp_path / "small"
    shutil.copytree(tiny_pair_paths[1], small)
    m = AutoModelForCausalLM.from_pretrained(small)
    with torch.no_grad():
        m.model.norm.weight[0] += 0.5
    m.save_pretrained(small)
    refused([*args, "--resume", "--small", str(small)], r"models changed: pair\.target\.")
    assert {p.name: p.read_bytes() for p in ckpts.iterdir()} == before  # a refusal touches nothing

    # Unchanged inputs (and a resume-safe setting, recorded as it ran) resume from the last checkpoint and
    # change nothing.
    dist = root / "artifacts" / "base" / "distilled" / "maps.safetensors"
    old = dist.read_bytes()
    rep = main([*args, "--resume", "--checkpoint-every", "3"])
    assert rep["results"]["resumed_from_update"] == 8 and dist.read_bytes() == old
    assert rep["results"]["segments"] == [
        {"from_update": 0, "checkpoint_every": 2, "world_size": 1},
        {"from_update": 8, "checkpoint_every": 3, "world_size": 1},
    ]


@pytest.mark.parametrize(
    "flags, says",
    [
        (("--lr", "nan"), "train_translator.py: argument --lr: nan is not a finite number"),  # when parsed
        (("--lr", "-1e-3"), "train_translator: --lr -0.001 is invalid: it must be a finite number > 0"),
        (("--n-fit", "0"), "train_translator: --n-fit 0 is invalid"),
        (("--ridge", "-1"), "train_translator: --ridge -1.0 is invalid: it must be a finite number ≥ 0"),
        (("--ridge", "much"), "train_translator: --ridge much is invalid: give a number ≥ 0, or auto"),
        (("--weight-decay", "nan"), "train_translator.py: argument --weight-decay: nan is not a finite number"),
    ],
)
def test_settings_out_of_range_are_refused_in_one_line_before_any_weights_load(
    tiny_pair_paths, data, tmp_path, capsys, monkeypatch, flags, says
):
    monkeypatch.setattr("kvlingo.inputs.models.load_pair", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(SystemExit) as e:
        main(cli(tiny_pair_paths, data[0], tmp_path, "bad", *flags))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith(says), err
    assert not (tmp_path / "artifacts" / "bad").exists()


def test_split_files_are_checked_against_the_data_manifest(tiny_pair_paths, data, tmp_path, capsys):
    folder = write_split(tmp_path / "data", data[1], data[2])
    with (folder / "validation.natural.jsonl").open("a") as f:
        f.write(json.dumps(data[2][0]) + "\n")
    with pytest.raises(SystemExit) as e:
        main(cli(tiny_pair_paths, folder, tmp_path, "manifest", "--updates", "1"))
    assert e.value.code == 2 and "validation.natural.jsonl was changed after preparation" in capsys.readouterr().err


def test_damaged_checkpoints_are_detected(tmp_path):
    folder = tmp_path / "ck"
    for u in (1, 2, 3):
        C.save_checkpoint(folder, u, {"x": torch.full((100,), float(u))})
    C.save_checkpoint(folder, 4, {"x": torch.zeros(3)})
    C.checkpoint_paths(folder, 4)[1].unlink()  # killed between the file and its marker: incomplete, not a candidate
    path3 = C.checkpoint_paths(folder, 3)[0]
    path3.write_bytes(path3.read_bytes()[:-50])  # truncated
    warnings: list[str] = []
    state = C.newest_checkpoint(folder, warn=warnings.append)
    assert state["update"] == 2 and torch.equal(state["x"], torch.full((100,), 2.0))
    assert "ckpt_000003.pt" in warnings[0] and "does not match its DONE marker" in warnings[0]
    for u in (1, 2):  # flip one byte: same length, different hash
        p = C.checkpoint_paths(folder, u)[0]
        blob = bytearray(p.read_bytes())
        blob[len(blob) // 2] ^= 0xFF
        p.write_bytes(bytes(blob))
    with pytest.raises(C.CheckpointError, match="no intact checkpoint"):
        C.newest_checkpoint(folder, warn=warnings.append)
    assert C.newest_checkpoint(tmp_path / "none") is None
    # temp files a kill leaves behind go on resume; checkpoints go only for a fresh run
    (folder / ".ckpt_000005.pt.abc123.tmp").write_bytes(b"half")
    (folder / "notes.txt").write_text("keep")
    assert C.clear_checkpoints(folder, temp_only=True) == 1 and (folder / "ckpt_000001.pt").exists()
    assert C.clear_checkpoints(folder) == 7 and sorted(p.name for p in folder.iterdir()) == ["notes.txt"]


def test_resume_after_truncated_checkpoint_falls_back_and_matches(tiny_pair_paths, data, trained, tmp_path):
    root, args, _ = trained
    shutil.copytree(root / "artifacts", tmp_path / "artifacts")
    newest = tmp_path / "artifacts" / "base" / "checkpoints" / "ckpt_000008.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    moved = [a if a != str(root / "artifacts") else str(tmp_path / "artifacts") for a in args]
    moved = [a if a != str(root / "results") else str(tmp_path / "results") for a in moved]
    rep = main([*moved, "--resume"])
    assert rep["results"]["resumed_from_update"] == 6
    assert maps_equal(root / "artifacts" / "base" / "distilled", tmp_path / "artifacts" / "base" / "distilled")


def test_a_finished_training_is_up_to_date_until_an_input_or_output_changes(trained, tmp_path, capsys, monkeypatch):

    root, args, _ = trained
    shutil.copytree(root, tmp_path / "run")
    args = [str(tmp_path / "run") + a.removeprefix(str(root)) if a.startswith(str(root)) else a for a in args]
    report = tmp_path / "run" / "results" / "base" / "train.json"
    maps = tmp_path / "run" / "artifacts" / "base" / "distilled" / "maps.safetensors"
    main(args)  # trains once more if an earlier test left another training's report in this run
    first = json.loads(report.read_text())

    def loads_nothing(*_a, **_k):
        raise AssertionError("an up-to-date training loaded the models")

    with monkeypatch.context() as m:
        m.setattr("kvlingo.inputs.models.load_pair", loads_nothing)
        capsys.readouterr()
        assert main(args) == first  # same config, data, models and code: nothing runs, nothing is rewritten
        assert f"{report} is up to date (same config, inputs and code); --force re-trains" in capsys.readouterr().out
        assert main([*args, "--resume"]) == first and json.loads(report.read_text()) == first
        with pytest.raises(AssertionError, match="loaded the models"):
            main([*args, "--force"])  # --force trains again
        with pytest.raises(AssertionError, match="loaded the models"):
            main([*args, "--updates", "9"])  # a changed setting trains again
        with pytest.raises(AssertionError, match="loaded the models"):
            main([*args, "--closed-form-only"])  # another kind of run trains again
        saved = maps.read_bytes()
        maps.write_bytes(saved[:-1] + bytes([saved[-1] ^ 1]))
        with pytest.raises(AssertionError, match="loaded the models"):
            main(args)  # maps that are not the ones the report records: trained again
        maps.write_bytes(saved)
        assert main(args) == first
    rep = main([*args, "--force"])
    assert rep["created_unix"] > first["created_unix"] and maps.read_bytes() == saved  # retrained bit for bit


def test_frozen_weights_are_verified(tiny_pair_paths, data, tmp_path, monkeypatch, capsys):
    import kvlingo.train.distill as distill

    real = distill.distill_step

    def tampering_step(source, target, *a, **kw):
        out = real(source, target, *a, **kw)
        with torch.no_grad():
            target.model.norm.weight[0] += 1e-3
        return out

    monkeypatch.setattr(distill, "distill_step", tampering_step)
    with pytest.raises(SystemExit) as e:
        main(cli(tiny_pair_paths, data[0], tmp_path, "tamper", "--updates", "1"))
    assert e.value.code == 1 and "frozen model weights changed during training: target" in capsys.readouterr().err
    assert not (tmp_path / "artifacts" / "tamper" / "distilled").exists()

    model = load_model(ModelSpec.parse(str(tiny_pair_paths[1])), "cpu", torch.float32)
    model.lm_head.weight.requires_grad_(True)
    with pytest.raises(F.FrozenWeightsChanged, match="trainable parameters"):
        F.check_frozen({"target": model})


# --------------------------------------------------------------------------- determinism
def test_rng_state_roundtrips_through_a_checkpoint(tmp_path):
    def draw():
        return random.random(), float(np.random.rand()), torch.rand(3)

    with R.preserved_rng():  # leave the session's RNGs as they were
        R.seed_everything(7)
        C.save_checkpoint(tmp_path, 1, {"rng": R.rng_state()})
        first = draw()
        R.set_rng_state(C.newest_checkpoint(tmp_path)["rng"])
        again = draw()
        assert first[:2] == again[:2] and torch.equal(first[2], again[2])
        R.seed_everything(7)
        with R.preserved_rng():
            draw()
        after = draw()
        assert after[:2] == first[:2] and torch.equal(after[2], first[2])


def test_data_order_is_a_function_of_the_seed():
    a, b = O.data_order(10, 1, 25), O.data_order(10, 1, 25)
    assert a == b and a != O.data_order(10, 2, 25)
    assert sorted(a[:10]) == list(range(10)) and sorted(a[10:20]) == list(range(10)) and a[:10] != a[10:20]
    assert O.fit_selection(10, 4, 3) == O.seeded_order(10, 3, "fit")[:4]


def test_help_has_examples(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "examples:" in capsys.readouterr().out


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical(tiny_pair_paths, data, tmp_path):
    """A real process killed with SIGKILL after its first checkpoint, then resumed, equals an uninterrupted run.

    Bit-identity holds for one CPU thread count: the reference, the killed run and the resume all use one.
    """
    settings = ["--updates", "24", "--checkpoint-every", "3", "--val-every", "6"]
    main(cli(tiny_pair_paths, data[0], tmp_path / "ref", "run", *settings))

    argv = [sys.executable, str(SCRIPT), *cli(tiny_pair_paths, data[0], tmp_path / "kill", "run", *settings)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    marker = tmp_path / "kill" / "artifacts" / "run" / "checkpoints" / "DONE_000003"
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    err = proc.communicate()[1].decode(errors="replace")
    assert proc.returncode == -signal.SIGKILL, f"the run ended before the kill (rc {proc.returncode}): {err[-2000:]}"
    killed = tmp_path / "kill" / "artifacts" / "run"
    assert not (killed / "distilled").exists()

    # The resume runs in this process (one thread, like the killed one): a second interpreter start costs ~20 s here.
    rep = main([*cli(tiny_pair_paths, data[0], tmp_path / "kill", "run", *settings), "--resume"])
    assert rep["results"]["resumed_from_update"] >= 3
    assert maps_equal(tmp_path / "ref" / "artifacts" / "run" / "distilled", killed / "distilled")
    ref = json.loads((tmp_path / "ref" / "results" / "run" / "train.json").read_text())["results"]
    got = json.loads((tmp_path / "kill" / "results" / "run" / "train.json").read_text())["results"]
    assert got["loss_curve"] == ref["loss_curve"] and got["val_kl_curve"] == ref["val_kl_curve"]
