"""kvlingo.Relay and export.py: a run's translator exported with the evidence its stages measured, loaded for
use, checked by the gate, and handing chats over exactly as the benchmark's and IFEval's translated arm does.

Two runs are made with the real stages (benchmark.py, ifeval.py, export.py) on closed-form maps fitted here:
- the toy pair (l2s), whose few-conversation fit fails the gate, measured with the target recomputing the
  last 2 context tokens (refresh tail:2): the handoff and the refusal of failing figures;
- a self pair (the tiny small model as both source and target, cache key space), whose fit recovers the
  identity and so passes the gate honestly: the path of proven maps and of a plain transformers cache.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tinypair import chat_rows, write_prepared
from toyrun import REFRESH, bench, fitted_run, run_flags

import export
from kvlingo import Relay
from kvlingo.core.handoff import stop_ids
from kvlingo.core.refresh import Refresh
from kvlingo.core.translator import TranslatorError
from kvlingo.eval.itemrows import read_rows
from kvlingo.eval.tasks.generate import generate
from kvlingo.inputs.data import read_split
from kvlingo.inputs.models import load_pair, render_ids, resolve_pair
from kvlingo.io import read_json, read_jsonl, sha256_file
from kvlingo.records.saved import CONFIG_FILE, EVIDENCE_FILE, Gate, judge, load_state, load_translator, sealed
from kvlingo.relay import UnprovenTranslator

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def proven(tiny_pair_paths, tmp_path_factory):
    """A self pair (the tiny small model on both sides), cache key space: its fit is exact, so it passes the gate."""
    root = tmp_path_factory.mktemp("relay_self")
    small = tiny_pair_paths[1]
    _, tok = resolve_pair(str(small), str(small), "l2s", "cpu", "float32")
    splits = {"train": chat_rows(tok, 8, 0, "tr"), "test": chat_rows(tok, 6, 1, "te")}
    data = write_prepared(root / "data" / "tiny", tok, splits)
    pair = fitted_run(root, "self", small, small, read_split(data, "train"), "cache")
    bench(root, "self", pair, data)
    export.main(run_flags(root, "self"))
    return {
        "root": root,
        "small": small,
        "export": root / "artifacts" / "self" / "export",
        "results": root / "results" / "self",
    }


def copy_export(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# --------------------------------------------------------------------------- the API
def test_import_kvlingo_stays_cheap():
    out = subprocess.run(
        [sys.executable, "-c", "import sys, kvlingo; print('torch' in sys.modules)"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "False"
    import kvlingo
    from kvlingo.relay import Relay as direct

    assert kvlingo.Relay is direct is Relay


def test_chat_is_the_translated_arm_token_for_token(toy_run):
    """Relay.chat on the exported folder = the suite's translated path (`generate`) with the run's own maps
    folder, and = the translated answers ifeval.py recorded for the same prompts."""
    relay = Relay.load(toy_run["export"], device="cpu", allow_unproven=True)
    cfg, tok = resolve_pair(str(toy_run["pair"] / "large"), str(toy_run["pair"] / "small"), "l2s", "cpu", "float32")
    pair = load_pair(cfg, tok)
    translator, _ = load_translator(toy_run["maps"], pair)
    chats = [json.loads(line) for line in (toy_run["pair"] / "corpus" / "chats.jsonl").read_text().splitlines()[:4]]
    refresh_mattered = False
    for chat in chats:
        messages = chat["input"]
        ids = render_ids(tok, messages, enable_thinking=False)
        ref = generate("translated", pair, translator, ids, 24, stop_ids(tok), refresh=Refresh.parse(REFRESH))
        got, hit = relay.reply_ids(messages, max_new_tokens=24)
        assert got == ref.ids and hit == ref.hit_cap
        assert relay.chat(messages, max_new_tokens=24) == tok.decode(ref.ids, skip_special_tokens=True)
        refresh_mattered |= generate("translated", pair, translator, ids, 24, stop_ids(tok)).ids != ref.ids
    assert refresh_mattered  # so the relay's recorded refresh setting is what made the answers equal
    rows = [r for r in read_rows(toy_run["results"] / "ifeval.rows.jsonl")[1] if r["path"] == "translated"]
    docs = {d["key"]: d for d in read_jsonl(toy_run["pair"] / "corpus" / "ifeval.jsonl")}
    assert len(rows) == 3
    for row in rows:
        messages = [{"role": "user", "content": docs[row["doc_key"]]["prompt"]}]
        assert relay.reply_ids(messages, max_new_tokens=10)[0] == row["new_ids"]


def test_handoff_cache_drives_transformers_generate(toy_run):
    """The cache `handoff` returns, given to transformers' own generate with the whole prompt, decodes what chat
    does."""
    relay = Relay.load(toy_run["export"], device="cpu", allow_unproven=True)
    messages = json.loads((toy_run["pair"] / "corpus" / "chats.jsonl").read_text().splitlines()[0])["input"]
    ids = relay.prompt_ids(messages)
    got, hit = relay.reply_ids(messages, max_new_tokens=16)
    out = relay.target.generate(
        torch.tensor([ids]),
        cache=relay.handoff(messages),
        max_new_tokens=16,
        do_sample=False,
        eos_token_id=sorted(stop_ids(relay.tokenizer)),
    )
    new = out[0, len(ids) :].tolist()
    if hit:
        assert new == got
    else:  # transformers keeps the stop token
        assert new[:-1] == got and new[-1] in stop_ids(relay.tokenizer)
    plain = relay.source(input_ids=torch.tensor([ids[:-1]]), use_cache=True).cache
    with pytest.raises(ValueError, match=f"refresh {REFRESH} read the context's token ids, which a bare cache lacks"):
        relay.handoff(plain)
    relay.refresh = Refresh()
    with pytest.raises(ValueError, match="pre-norm key features"):  # prenorm maps cannot read a plain cache
        relay.handoff(plain)


def test_export_round_trips_config_and_evidence(toy_run):
    relay = Relay.load(toy_run["export"], device="cpu", allow_unproven=True)
    manifest = read_json(toy_run["maps"] / "manifest.json")
    bench_rep = read_json(toy_run["results"] / "benchmark.json")
    ife = read_json(toy_run["results"] / "ifeval.json")
    cfg, ev = relay.config, relay.evidence
    assert cfg == read_json(toy_run["export"] / CONFIG_FILE) and ev == read_json(toy_run["export"] / EVIDENCE_FILE)
    # config: the spec and provenance of the run's maps, the pair of its reports, the hashes of the files
    assert (toy_run["export"] / "maps.safetensors").read_bytes() == (toy_run["maps"] / "maps.safetensors").read_bytes()
    assert cfg["maps_sha256"] == manifest["maps_sha256"] == sha256_file(toy_run["export"] / "maps.safetensors")
    assert cfg["evidence_sha256"] == sha256_file(toy_run["export"] / EVIDENCE_FILE)
    for key in ("family", "key_space", "settings", "geometry", "direction", "models", "n_params"):
        assert cfg[key] == manifest[key], key
    pair = bench_rep["config"]["pair"]
    assert cfg["pair"]["large"] == pair["source"] and cfg["pair"]["small"] == pair["target"]
    assert cfg["pair"]["tokenizer_sha256"] == pair["tokenizer_sha256"] == relay.pair.config.tokenizer_sha256
    assert cfg["origin"] == {
        "run": "toy",
        "translator": "distilled",
        "manifest_sha256": sha256_file(toy_run["maps"] / "manifest.json"),
    }
    for key, value in relay.translator.state_dict().items():
        assert torch.equal(value, load_state(toy_run["maps"]).state_dict()[key]), key
    # evidence: the benchmark's arms as reported (translated = distilled), IFEval's strict prompt accuracy
    arms = bench_rep["results"]["quality"]["arms"]
    assert ev["arms"] == {
        "native_target": arms["native_target"],
        "translated": arms["distilled"],
        "control": arms["control"],
        "no_context": arms["no_context"],
    }
    assert ev["benchmark"]["n_conversations"] == bench_rep["n_samples"]["conversations"] == 6
    assert ev["benchmark"]["test_split_sha256"] == sha256_file(toy_run["data"] / "test.natural.jsonl")
    assert ev["ifeval"]["paths"] == {p: s["prompt_level_strict_acc"] for p, s in ife["results"]["paths"].items()}
    assert ev["ifeval"]["paths"]["translated"]["n"] == 3
    assert ev["gate"] == judge(ev).to_dict() == relay.verdict.to_dict()
    assert ev["refresh"] == cfg["refresh"] == str(relay.refresh) == REFRESH == bench_rep["config"]["refresh"]
    card = (toy_run["export"] / "README.md").read_text()
    assert f"| translated    | {arms['distilled']['kl_token_mean']:.4g} " in card
    assert ("Gate: PASSED" in card) == relay.verdict.passed


# --------------------------------------------------------------------------- the gate
def test_failing_evidence_is_refused_with_its_figures(toy_run):
    t = read_json(toy_run["results"] / "benchmark.json")["results"]["quality"]["arms"]["distilled"]
    assert t["top1_agreement"] < 0.8 and t["nll_delta_vs_native_target"] > 0.25  # what this fit measured
    with pytest.raises(UnprovenTranslator) as err:
        Relay.load(toy_run["export"], device="cpu")
    msg = str(err.value)
    assert f"top-1 agreement with the native target {t['top1_agreement']:.3f} < 0.80" in msg
    assert f"NLL Δ vs the native target {t['nll_delta_vs_native_target']:.3f} nats/token > 0.25" in msg
    assert "allow_unproven=True" in msg
    lenient = Gate(min_top1=0.0, max_nll_delta=10.0)  # a loader may set its own thresholds
    assert Relay.load(toy_run["export"], device="cpu", gate=lenient).verdict.passed


def test_proven_maps_load_and_hand_over_a_plain_cache(proven):
    relay = Relay.load(proven["export"], device="cpu")
    t = read_json(proven["results"] / "benchmark.json")["results"]["quality"]["arms"]["distilled"]
    assert relay.verdict.passed and relay.evidence["arms"]["translated"] == t
    assert t["top1_agreement"] >= 0.8 and t["nll_delta_vs_native_target"] <= 0.25
    ids = relay.prompt_ids([{"role": "user", "content": "the cat sat on a mat"}])
    plain = relay.source(input_ids=torch.tensor([ids[:-1]]), use_cache=True).cache  # transformers' own cache
    for a, b in zip(relay.translate(plain), relay.translate(ids)):
        assert torch.equal(a, b)


def test_deliberately_failing_evidence_names_every_figure(proven, tmp_path):
    folder = copy_export(proven["export"], tmp_path / "failing")
    ev = read_json(folder / EVIDENCE_FILE)
    ev["arms"]["translated"].update(
        top1_agreement=0.5, nll_delta_vs_native_target=0.6, kl_token_mean=ev["arms"]["control"]["kl_token_mean"] + 1.0
    )
    (folder / EVIDENCE_FILE).write_text(json.dumps(ev))
    with pytest.raises(UnprovenTranslator, match="does not match the hash recorded"):  # edited, not re-exported
        Relay.load(folder, device="cpu")
    rewrite_config(folder, lambda c: {**c, "evidence_sha256": sha256_file(folder / EVIDENCE_FILE)})  # re-exported
    with pytest.raises(UnprovenTranslator) as err:
        Relay.load(folder, device="cpu")
    assert "0.500 < 0.80" in str(err.value) and "0.600 nats/token > 0.25" in str(err.value)
    assert "does not beat the control's" in str(err.value)
    relay = Relay.load(folder, device="cpu", allow_unproven=True)
    assert not relay.verdict.passed and len(relay.verdict.failures) == 3


def test_missing_evidence_is_refused_unless_allowed(proven, tmp_path):
    bare = tmp_path / "bare"
    export.main([*run_flags(proven["root"], "self"), "--no-evidence", "--out", str(bare)])
    assert not (bare / EVIDENCE_FILE).exists() and read_json(bare / CONFIG_FILE)["evidence_sha256"] is None
    with pytest.raises(UnprovenTranslator, match=r"without evidence \(it was exported without evidence"):
        Relay.load(bare, device="cpu")
    folder = copy_export(proven["export"], tmp_path / "missing")
    (folder / EVIDENCE_FILE).unlink()
    with pytest.raises(UnprovenTranslator, match=r"without evidence \(evidence.json is missing\)"):
        Relay.load(folder, device="cpu")
    relay = Relay.load(folder, device="cpu", allow_unproven=True)
    assert relay.evidence is None and not relay.verdict.passed


def test_tampered_maps_are_refused_even_when_unproven_is_allowed(proven, tmp_path):
    folder = copy_export(proven["export"], tmp_path / "tampered")
    data = bytearray((folder / "maps.safetensors").read_bytes())
    data[-1] ^= 0x01
    (folder / "maps.safetensors").write_bytes(bytes(data))
    for allow in (False, True):
        with pytest.raises(TranslatorError, match="does not match its manifest hash") as err:
            Relay.load(folder, device="cpu", allow_unproven=allow)
        assert not isinstance(err.value, UnprovenTranslator)


def test_a_pair_with_another_tokenizer_is_refused(toy_run, tiny_pair_paths, tmp_path):
    """The same weights in another folder load (a folder is named by its weights digest); with another
    tokenizer in both folders they are refused, whatever allow_unproven says."""
    moved = tmp_path / "moved"
    for role in ("large", "small"):
        shutil.copytree(toy_run["pair"] / role, moved / role)
    relay = Relay.load(
        toy_run["export"], device="cpu", allow_unproven=True, large=str(moved / "large"), small=str(moved / "small")
    )
    assert relay.pair.config.source["path"] == str((moved / "large").resolve())
    for role in ("large", "small"):
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(tiny_pair_paths[1] / f, moved / role / f)
    with pytest.raises(TranslatorError, match="its tokenizer .* is not the one these maps were trained with"):
        Relay.load(
            toy_run["export"], device="cpu", allow_unproven=True, large=str(moved / "large"), small=str(moved / "small")
        )


def test_a_hub_repo_that_cannot_be_fetched_is_named(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TranslatorError, match="nobody/no-such-translator.*revision abc123"):
        Relay.load("nobody/no-such-translator", revision="abc123")
    with pytest.raises(TranslatorError, match="no such folder"):
        Relay.load("./not/a/folder")


def test_bad_prompt_ids_are_refused_before_any_model_runs(proven, monkeypatch):
    """Ids are whole numbers inside the vocabulary and no longer than the models read, and max_new_tokens is not
    negative: each is refused with a message that names the value, before the source runs (an id past the
    vocabulary in the last position would otherwise pass the handoff and fail only in the reply)."""
    import numpy as np

    relay = Relay.load(proven["export"], device="cpu")
    vocab = relay.source.get_input_embeddings().num_embeddings
    limit = relay.source.config.max_position_embeddings
    monkeypatch.setattr(relay.pair.source, "forward", lambda *a, **k: pytest.fail("the source ran"))
    for ids, why in (
        ([1, 2, vocab], f"token id {vocab} is outside the models' vocabulary \\[0, {vocab}\\)"),
        ([1, -3, 4], "token id -3 is outside"),
        ([1, 2.5, 3], "prompt ids must be integers, got 2.5"),
        (torch.tensor([1.0, 2.0]), "torch.float32 tensor"),
        ([1] * (limit + 1), f"the prompt is {limit + 1} tokens, more than the models read"),
    ):
        with pytest.raises(ValueError, match=why):
            relay.handoff(ids)
    with pytest.raises(ValueError, match="token id"):
        relay.capture([1, vocab + 5])
    with pytest.raises(ValueError, match="max_new_tokens is -1"):
        relay.chat([{"role": "user", "content": "hi"}], max_new_tokens=-1)
    monkeypatch.undo()
    a = relay.translate(np.array([3, 4, 5]))  # NumPy integers are ids
    b = relay.translate(torch.tensor([[3, 4, 5]]))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# --------------------------------------------------------------------------- damaged folders and bad inputs
def rewrite_config(folder: Path, edit) -> Path:
    """config.json as `edit` makes it, sealed with its content hash as an export writes it: what other code (or
    a re-export) would leave, not a hand edit (test_an_edited_config_is_refused_whatever_the_field)."""
    cfg = edit(read_json(folder / CONFIG_FILE))
    (folder / CONFIG_FILE).write_text(json.dumps(sealed(cfg) if isinstance(cfg, dict) else cfg))
    return folder


def rehash_evidence(folder: Path, evidence_text: str) -> Path:
    (folder / EVIDENCE_FILE).write_text(evidence_text)
    return rewrite_config(folder, lambda c: {**c, "evidence_sha256": sha256_file(folder / EVIDENCE_FILE)})


def test_evidence_that_cannot_be_judged_fails_the_gate_in_words(proven, tmp_path):
    """A figure that is NaN, missing or not a number fails its check by name (a comparison with NaN would
    pass it); evidence that is not a mapping or does not parse is judged as no figures, so allow_unproven
    still loads the maps."""
    ev = read_json(proven["export"] / EVIDENCE_FILE)
    assert judge(ev).passed
    nan = json.loads(json.dumps(ev))
    nan["arms"]["translated"].update(top1_agreement=float("nan"), nll_delta_vs_native_target=float("nan"))
    failures = judge(nan).failures
    assert failures == (
        "evidence arms.translated.top1_agreement is nan, not a finite number",
        "evidence arms.translated.nll_delta_vs_native_target is nan, not a finite number",
    )
    no_control = json.loads(json.dumps(ev))
    del no_control["arms"]["control"]
    assert judge(no_control).failures == ("evidence arms.control.kl_token_mean is None, not a finite number",)
    assert judge(no_control, Gate(beat_control=False)).passed
    typed = json.loads(json.dumps(ev))
    typed["arms"]["translated"]["top1_agreement"] = "0.9"
    typed["benchmark"]["native_controls_passed"] = None
    assert judge(typed).failures == (
        "evidence arms.translated.top1_agreement is '0.9', not a finite number",
        "evidence benchmark.native_controls_passed is None, not true or false",
    )
    assert not judge([]).passed and len(judge([]).failures) == 5  # every figure and the controls

    folder = rehash_evidence(copy_export(proven["export"], tmp_path / "nan"), json.dumps(nan))
    with pytest.raises(UnprovenTranslator, match="top1_agreement is nan, not a finite number"):
        Relay.load(folder, device="cpu")
    assert not Relay.load(folder, device="cpu", allow_unproven=True).verdict.passed
    folder = rehash_evidence(copy_export(proven["export"], tmp_path / "cut"), json.dumps(ev)[:50])
    with pytest.raises(UnprovenTranslator, match="without evidence \\(evidence.json does not parse"):
        Relay.load(folder, device="cpu")
    assert Relay.load(folder, device="cpu", allow_unproven=True).evidence is None


def _pop(key):
    return lambda c: {k: v for k, v in c.items() if k != key}


@pytest.mark.parametrize(
    "edit, why",
    [
        (_pop("pair"), "pair None is not a mapping"),
        (_pop("direction"), "direction None is not l2s or s2l"),
        (lambda c: {**c, "pair": {**c["pair"], "large": {"id": "x"}}}, "pair.large {'id': 'x'} is neither"),
        (
            lambda c: {**c, "pair": {k: v for k, v in c["pair"].items() if k != "tokenizer_sha256"}},
            "pair.tokenizer_sha256 None is not a string",
        ),
        (lambda c: [1, 2], "is not a kvlingo-translator config \\(format 'list'\\)"),
        (lambda c: {**c, "format_version": "2"}, "format_version '2' is not a whole number"),
        (_pop("geometry"), "geometry None is not \\{source_layers"),
        (lambda c: {**c, "geometry": {**c["geometry"], "extra": 1}}, "geometry .* is not \\{source_layers"),
        (lambda c: {**c, "geometry": {**c["geometry"], "target_layers": 2.0}}, "as positive integers"),
        (_pop("key_space"), "key space None is not one of prenorm, cache"),
        (lambda c: {**c, "settings": {"bogus": 1}}, "settings \\{'bogus': 1\\} do not build a headwise translator"),
        (lambda c: {**c, "settings": "rank"}, "settings 'rank' are not a mapping"),
        (lambda c: {**c, "family": "crosshead"}, "does not hold this crosshead translator's state \\(missing"),
    ],
)
def test_a_damaged_config_is_refused_by_field_before_any_weights_load(proven, tmp_path, monkeypatch, edit, why):
    folder = rewrite_config(copy_export(proven["export"], tmp_path / "damaged"), edit)
    monkeypatch.setattr("kvlingo.relay.load_pair", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(TranslatorError, match=why) as err:
        Relay.load(folder, device="cpu", allow_unproven=True)
    assert "again" in str(err.value)  # the fix: export (or train) it again


@pytest.mark.parametrize(
    "edit",
    [
        lambda c: {**c, "key_space": "cache" if c["key_space"] == "prenorm" else "prenorm"},  # other answers
        lambda c: {**c, "pair": {**c["pair"], "dtype": "bfloat16"}},  # the evidence was measured in float32
        lambda c: {**c, "refresh": "tail:4"},  # the evidence was measured without it
        lambda c: {**c, "n_params": c["n_params"] + 1},
        lambda c: {**c, "training": {**c["training"], "stage": "closed_form"}},  # provenance
        lambda c: {**c, "origin": {**c["origin"], "run": "elsewhere"}},
    ],
)
def test_an_edited_config_is_refused_whatever_the_field(proven, tmp_path, monkeypatch, edit):
    """A folder's identity is all of its config.json: an edit of any field, not only the hashed maps and
    evidence, is refused before any weights load (its content hash no longer matches)."""
    folder = copy_export(proven["export"], tmp_path / "edited")
    (folder / CONFIG_FILE).write_text(json.dumps(edit(read_json(folder / CONFIG_FILE)), indent=2))
    monkeypatch.setattr("kvlingo.relay.load_pair", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(TranslatorError, match="config.json: it was edited after it was written .*export it again"):
        Relay.load(folder, device="cpu", allow_unproven=True)


def test_an_unknown_chat_role_is_refused(proven):
    relay = Relay.load(proven["export"], device="cpu")
    with pytest.raises(ValueError, match="chat message 1 has role 'wizard'; give one of system, user, assistant, tool"):
        relay.chat([{"role": "user", "content": "hi"}, {"role": "wizard", "content": "abracadabra"}])


def test_maps_of_another_layout_or_not_finite_are_refused(proven, tmp_path, monkeypatch):
    """A maps file re-hashed after an edit (a tensor reshaped, renamed or cut off, or NaN) is refused by name:
    the layout from the file's header before any weights load, non-finite values when the maps load."""
    from safetensors.torch import load_file, save_file

    def rewritten(name: str, edit) -> Path:
        folder = copy_export(proven["export"], tmp_path / name)
        state = edit(load_file(folder / "maps.safetensors"))
        if isinstance(state, bytes):
            (folder / "maps.safetensors").write_bytes(state)
        else:
            save_file(state, str(folder / "maps.safetensors"))
        return rewrite_config(folder, lambda c: {**c, "maps_sha256": sha256_file(folder / "maps.safetensors")})

    first = next(iter(load_file(proven["export"] / "maps.safetensors")))
    cases = [
        ("shape", lambda s: {**s, first: s[first][..., :1].contiguous()}, f"{first} is F32 \\["),
        ("dtype", lambda s: {**s, first: s[first].double()}, f"{first} is F64"),
        ("missing", lambda s: {k: v for k, v in s.items() if k != first}, f"missing {first}"),
        ("extra", lambda s: {**s, "bogus": torch.zeros(1)}, "unexpected bogus"),
        ("cut", lambda s: (proven["export"] / "maps.safetensors").read_bytes()[:40], "not a readable safetensors"),
    ]
    with monkeypatch.context() as m:
        m.setattr("kvlingo.relay.load_pair", lambda *a, **k: pytest.fail("weights loaded"))
        for name, edit, why in cases:
            with pytest.raises(TranslatorError, match=why):
                Relay.load(rewritten(name, edit), device="cpu", allow_unproven=True)
    folder = rewritten("nan", lambda s: {**s, first: torch.full_like(s[first], float("nan"))})
    with pytest.raises(TranslatorError, match=f"{first} hold NaN or infinite values"):
        Relay.load(folder, device="cpu", allow_unproven=True)


def test_threads_sharing_a_relay_get_what_each_would_alone(toy_run):
    """A capture of pre-norm keys hooks the shared source model, so concurrent calls once mixed their captures
    (wrong caches, or shape errors); a relay's calls now take its lock."""
    import threading
    import time

    relay = Relay.load(toy_run["export"], device="cpu", allow_unproven=True)
    assert relay.translator.needs_prenorm
    prompts = [list(range(3, 3 + n)) for n in (5, 9, 14)]
    alone = [relay.translate(ids) for ids in prompts]
    for layer in relay.source.model.layers:  # a pause inside every forward lets the other threads in
        layer.register_forward_pre_hook(lambda *_: time.sleep(0.002))
    got, errors = {}, []

    def worker(i: int) -> None:
        try:
            for _ in range(4):
                got.setdefault(i, []).append(relay.translate(prompts[i]))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i, runs in got.items():
        assert len(runs) == 4 and all(torch.equal(k, alone[i][0]) and torch.equal(v, alone[i][1]) for k, v in runs)


def test_a_capture_of_the_prompt_but_its_last_token_is_the_handoff_of_the_ids(proven):
    relay = Relay.load(proven["export"], device="cpu")
    ids = relay.prompt_ids([{"role": "user", "content": "the cat sat on a mat"}])
    for a, b in zip(relay.translate(relay.capture(ids[:-1])), relay.translate(ids)):
        assert torch.equal(a, b)


def test_a_cache_is_translated_with_the_ids_it_covers(toy_run):
    """A refresh (and a family) that reads the context's token ids takes them from the capture, or from ids= beside
    a DynamicCache; the result is the handoff of the prompt ids, bit for bit. Without ids, a cache is refused."""
    relay = Relay.load(toy_run["export"], device="cpu", allow_unproven=True)
    assert relay.refresh.active  # the toy run hands over with tail:2: its target recomputes from the ids
    ids = relay.prompt_ids([{"role": "user", "content": "Remember: my cat is called Pepper. What is my cat called?"}])
    want = relay.translate(ids)
    cap = relay.capture(ids[:-1])
    for got in (relay.translate(cap), relay.translate(cap, ids=ids[:-1])):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    bare = replace(cap, ids=None)
    with pytest.raises(ValueError, match="read the context's token ids, which a bare cache lacks: .*ids="):
        relay.translate(bare)
    assert all(torch.equal(a, b) for a, b in zip(relay.translate(bare, ids=ids[:-1]), want))
    with pytest.raises(ValueError, match=f"ids= has {len(ids)} token ids but the cache holds {len(ids) - 1}"):
        relay.translate(bare, ids=ids)
    with pytest.raises(ValueError, match="ids= differ from the ids the capture holds"):
        relay.translate(cap, ids=[i + 1 for i in ids[:-1]])
    with pytest.raises(ValueError, match="ids= goes with a cache"):
        relay.translate(ids, ids=ids)


def test_chats_with_nothing_to_answer_and_replies_past_the_positions_are_refused(proven, monkeypatch):
    relay = Relay.load(proven["export"], device="cpu")
    with monkeypatch.context() as m:
        m.setattr(relay.pair.source, "forward", lambda *a, **k: pytest.fail("the source ran"))
        for messages, why in (
            ([], "the chat is empty: give at least one"),
            ([{"role": "user", "content": ""}], "chat message 0 \\(user\\) is empty"),
            ([{"role": "assistant", "content": "Hello."}], "the chat has no user message"),
        ):
            with pytest.raises(ValueError, match=why):
                relay.chat(messages)
        limit = relay.target.config.max_position_embeddings
        long = [{"role": "user", "content": "the cat sat " * 4}]
        n = len(relay.prompt_ids(long))
        with pytest.raises(
            ValueError, match=f"run past the models' {limit} positions; give max_new_tokens={limit - n} or less$"
        ):
            relay.chat(long, max_new_tokens=limit)
        for net in (relay.source, relay.target):  # positions for the prompt and a few tokens at most
            m.setattr(net.config, "max_position_embeddings", n + 2)
        with pytest.raises(
            ValueError,
            match=f"the models' {n + 2} positions; give max_new_tokens=2 or less, or shorten the conversation to "
            f"at most {n - 2} tokens$",
        ):
            relay.chat(long, max_new_tokens=4)
        for limit, max_new in ((n, 4), (n - 3, 4), (n - 3, 0)):  # no positive max_new_tokens fits: none is offered
            for net in (relay.source, relay.target):
                m.setattr(net.config, "max_position_embeddings", limit)
            for call in (relay.chat, relay.native_chat):
                with pytest.raises(
                    ValueError, match=f"shorten the conversation to at most {limit - max_new} tokens$"
                ) as err:
                    call(long, max_new_tokens=max_new)
                assert "give max_new_tokens" not in str(err.value)
                assert ("prompt alone is" in str(err.value)) == (limit < n)


def test_a_training_run_folder_is_refused_naming_its_export(proven):
    run = proven["export"].parent  # ARTIFACTS/RUN, which holds export/
    with pytest.raises(TranslatorError, match=f"not a complete exported translator; load {proven['export']}, the"):
        Relay.load(run, device="cpu")


def test_api_refusals_name_the_api_s_arguments_not_the_command_line_s(proven, tmp_path):
    """Relay.load takes device=, dtype=, large= and small=: its refusals say those, never DEVICE= or --large."""
    from tinypair import tiny_model

    small = proven["small"]
    deep = tmp_path / "deep"  # the same tokenizer, one layer more: maps of the self pair do not fit it
    cfg = json.loads((small / "config.json").read_text())
    tiny_model("qwen3", vocab=cfg["vocab_size"], layers=3, eos_token_id=cfg["eos_token_id"]).save_pretrained(deep)
    for f in small.iterdir():
        if f.name not in ("config.json", "generation_config.json") and f.suffix != ".safetensors":
            shutil.copy(f, deep / f.name)
    for kwargs, why in (
        ({"device": "cpux"}, "device='cpux' is not a device .*; use 'cuda' \\(or 'cuda:N'\\), 'mps', 'cpu' or 'auto'"),
        ({"dtype": "fp8"}, "dtype='fp8' is not supported; use one of 'bfloat16', 'float32', 'float16'"),
        (
            {"large": str(deep)},
            "it was trained for another pair; give large= and small= the models it was trained for",
        ),
    ):
        with pytest.raises((ValueError, TranslatorError), match=why) as err:
            Relay.load(proven["export"], **kwargs)
        assert not any(flag in str(err.value) for flag in ("DEVICE", "DTYPE", "--large", "--direction"))


def test_a_model_folder_is_named_as_one_not_as_an_export(tiny_pair_paths):
    from kvlingo.core.translator import TranslatorError

    with pytest.raises(TranslatorError, match="is a model folder \\(qwen3\\), not an exported translator"):
        Relay.load(tiny_pair_paths[0], device="cpu")


def test_inputs_a_relay_cannot_take_are_refused_in_words(proven, toy_pair, monkeypatch):
    """Messages, ids, captures and arguments of the wrong kind get a ValueError (or TypeError) naming what is
    wrong, not a template or tensor error from deep inside."""
    from transformers import DynamicCache

    from kvlingo.core.cache import Capture

    relay = Relay.load(str(proven["export"]), device=torch.device("cpu"), gate=None)
    other = torch.zeros(relay.translator.geometry.source_layers + 1, 1, 4, 8)
    with monkeypatch.context() as m:
        m.setattr(relay.pair.source, "forward", lambda *a, **k: pytest.fail("the source ran"))
        for messages, why in (
            ("What is my name?", "chat messages are a list .* got str"),
            ([1, 2, 3], "chat message 0 is int 1.*token ids go to relay.handoff"),
            ([{"role": "user", "content": 123}], "chat message 0 has content 123; give it as a string"),
            ([{"content": "hi"}], "chat message 0 has role None"),
            ([{"role": "user", "content": ["hi"]}], "has content \\['hi'\\]"),
        ):
            with pytest.raises(ValueError, match=why):
                relay.chat(messages)
        for max_new, why in ((2.5, "max_new_tokens is 2.5"), (None, "max_new_tokens is None")):
            with pytest.raises(ValueError, match=why):
                relay.chat([{"role": "user", "content": "hi"}], max_new_tokens=max_new)
        for source, why in (
            (torch.tensor([[[3, 4, 5]]]), "shape \\(1, 1, 3\\); a relay is batch-one"),
            ([3, True, 5], "must be integers, got True"),
            (None, "got NoneType"),
            (5, "got int"),
            (DynamicCache(), "the source cache is empty"),
            (Capture(other, other, None, torch.empty(0)), "this relay's source caches \\[layers="),
        ):
            with pytest.raises(ValueError, match=why):
                relay.handoff(source)
        with pytest.raises(ValueError, match="a capture needs at least one token id"):
            relay.capture([])
    with pytest.raises(TypeError, match="gate must be a kvlingo.records.saved.Gate"):
        Relay.load(proven["export"], device="cpu", gate={"min_top1": 0.5})
    monkeypatch.setenv("HOME", str(Path(proven["export"]).parent))  # "~/export" names the folder
    assert Relay.load(f"~/{Path(proven['export']).name}", device="cpu").folder == Path(proven["export"])


def test_a_recorded_model_is_its_id_at_revision_or_its_folder_and_a_missing_folder_is_refused_by_each_caller(tmp_path):
    from kvlingo import relay as relay_module
    from kvlingo.core.translator import TranslatorError
    from kvlingo.serve.contract import Refused, recorded_model

    hub = {"id": "Qwen/Qwen3-0.6B", "revision": "abc123"}
    here = {"path": str(tmp_path), "weights_sha256": "f" * 64}
    gone = {"path": str(tmp_path / "gone"), "weights_sha256": "e" * 64}
    assert relay_module.recorded(hub, "small") == "Qwen/Qwen3-0.6B@abc123"
    assert relay_module.recorded(here, "small") == str(tmp_path)
    with pytest.raises(
        TranslatorError,
        match=r"small model was the local folder .*gone, which is not here; pass "
        r"small= a folder holding the same weights \(sha256 eeeeeeeeeeee…\)",
    ):
        relay_module.recorded(gone, "small")
    config = {"pair": {"direction": "l2s", "large": gone, "small": hub}}
    assert recorded_model(config, "target") == "Qwen/Qwen3-0.6B@abc123"
    with pytest.raises(
        Refused,
        match=r"source model was the local folder .*gone, which is not here; put the same "
        r"weights there",
    ):
        recorded_model(config, "source")
