"""The toy pair: a shared tokenizer and two small Qwen3 models trained from scratch on the toy world.

The pair is related the way Qwen3-0.6B and Qwen3-1.7B are: the same layer count, KV heads and
head_dim (so caches line up layer by layer and head by head), but different hidden sizes, query
heads, MLP widths and RoPE bases (rope_theta 10000 vs 50000), so a translator has to strip one
RoPE schedule and apply the other. Full attention, no sliding window, no RoPE scaling.

The full pair ships with the code, in kvlingo/toy/pair/ (BF16 safetensors in shards of at most
4 MB, ~10 MB in all, plus the tokenizer and the build's manifest; no corpus). Training it takes
~26 CPU-minutes, longer than the whole 15-minute demo and more than CI can spend on every run,
while installing it takes seconds: `install_pair` regenerates the corpus from the seed recorded
in the manifest, checks every corpus file against the sha256 the pair was trained on (so a
changed generator is caught, not silently paired with stale weights), checks the packaged
files, and copies them under artifacts/. `build_toy_world` is the command that reproduces it from scratch (`make
toy-train`,
which re-exports into kvlingo/toy/pair/; same seed and thread count, same bits on one machine).

`build_toy_world` writes a manifest holding a build key (the hash of config and code) and the
sha256 of every file; a second call with the same settings verifies the hashes and returns,
and each model folder carries its own key in meta.json, so an interrupted build resumes at the
first model not finished.

Training puts the loss on assistant tokens only (every assistant turn of a conversation, the
final reply included): on this data that is what makes the recall skill form within minutes.
The number of optimiser steps is fixed before training from a minutes budget and a measured
throughput constant, never by wall-clock stopping, so a seed gives the same weights each run.
Training and scoring run on one CPU thread: on a machine shared with other jobs, two OpenMP
threads spend most of their time waiting for each other at the barriers of these tiny ops, and
one thread also makes the weights independent of the machine's core count.

Exact-reply accuracy is scored by teacher forcing: greedy decoding reproduces a reference reply
exactly iff the argmax at every reply position is the reference token, so one batched forward
pass per conversation replaces token-by-token generation.
"""

from __future__ import annotations

import io
import math
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..inputs.models import local_weights_digest
from ..io import (
    atomic_write_bytes,
    atomic_write_json,
    not_ours,
    read_json,
    read_jsonl,
    sha256_file,
    sha256_json,
    sha256_tree,
)
from ..records.report import Report, fmt_table
from . import world as toyworld
from .tokenizer import save_tokenizer, train_chat_tokenizer

SHARD_SIZE = "4MB"  # largest safetensors shard the build writes
IGNORE = -100  # label for positions without loss (prompt tokens, padding)


# --------------------------------------------------------------------------- configs
@dataclass(frozen=True)
class ModelShape:
    hidden: int  # hidden size
    intermediate: int  # MLP width
    heads: int  # query heads
    rope_theta: float  # RoPE base; differs between the two models on purpose


@dataclass(frozen=True)
class ToyConfig:
    world: toyworld.WorldConfig  # the corpus
    vocab_size: int = 3072  # BPE vocabulary incl. the 5 special tokens; smaller splits the world's words
    layers: int = 4  # shared by both models
    kv_heads: int = 2  # shared by both models
    head_dim: int = 32  # shared by both models
    large: ModelShape = ModelShape(hidden=256, intermediate=768, heads=8, rope_theta=10_000.0)  # cache builder
    small: ModelShape = ModelShape(hidden=128, intermediate=384, heads=4, rope_theta=50_000.0)  # continuer
    max_position_embeddings: int = 2048  # RoPE table size; training sequences are far shorter
    max_len: int = 512  # training conversations longer than this (tokens) are skipped
    batch: int = 32  # conversations per optimiser step
    lr: float = 3e-3  # AdamW peak learning rate
    warmup_frac: float = 0.05  # linear warm-up share of the steps
    min_lr_frac: float = 0.1  # cosine decays to this fraction of lr
    weight_decay: float = 0.01  # AdamW decoupled weight decay
    grad_clip: float = 1.0  # global grad-norm clip
    autocast_bf16: bool = True  # bf16 matmuls in training (about 1.5x faster on AVX-512 CPUs)
    # Step budgets in CPU-minutes, turned into step counts with the throughput constants below.
    # The large model gets the larger share: with equal minutes (12 each) the small one took
    # 2.4x the steps (2811 vs 1189) and ended up the better model, unlike the real pair.
    large_minutes: float = 18.0  # training budget of the large model
    small_minutes: float = 7.0  # training budget of the small model
    threads: int = 1  # torch CPU threads for training and scoring (see the module docstring)
    # Measured single-thread training throughput (bf16 autocast, padded tokens per second) in a
    # full build on a 2-core x86 CPU; turning a minutes budget into a fixed step count keeps
    # training deterministic (wall time then varies with the machine, the step count does not).
    large_tokens_per_s: float = 4_150.0  # throughput constant of the large model
    small_tokens_per_s: float = 10_300.0  # throughput constant of the small model
    min_steps: int = 20  # floor on the step count
    eval_per_kind: int = 64  # held-out context-dependent chats scored per kind
    eval_task_items: int = 96  # items scored per evaluation file (ifeval/arc/gsm8k)


def full_config(seed: int = 0, minutes_per_model: float | None = None) -> ToyConfig:
    """The full build; `minutes_per_model`, when given, replaces both models' budgets."""
    cfg = ToyConfig(world=toyworld.WorldConfig(seed=seed))
    if minutes_per_model is None:
        return cfg
    return replace(cfg, large_minutes=minutes_per_model, small_minutes=minutes_per_model)


def mini_config(seed: int = 0) -> ToyConfig:
    """Seconds instead of minutes: a few hundred chats, tiny models, a few dozen steps."""
    world = toyworld.WorldConfig(seed=seed, n_train=256, n_chats=48, n_ifeval=24, n_arc=24, n_gsm8k=24)
    return ToyConfig(
        world=world,
        vocab_size=512,
        layers=2,
        kv_heads=2,
        head_dim=16,
        large=ModelShape(hidden=64, intermediate=128, heads=4, rope_theta=10_000.0),
        small=ModelShape(hidden=32, intermediate=64, heads=2, rope_theta=50_000.0),
        max_position_embeddings=1024,
        batch=8,
        large_minutes=0.0,
        small_minutes=0.0,
        min_steps=24,
        eval_per_kind=6,
        eval_task_items=8,
    )


def qwen3_config(cfg: ToyConfig, shape: ModelShape, tok):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tok),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        use_sliding_window=False,
        sliding_window=None,
        tie_word_embeddings=True,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=None,
    )


# --------------------------------------------------------------------------- tokenizer and encoding
def tokenizer_texts(rows: list[dict]) -> list[str]:
    """What the BPE sees: every message and reply, the role names the chat template writes, and
    an all-capitals copy of each reply, so that IFEval's capital-letters replies stay short
    enough for a demo-sized generation budget."""
    texts = []
    for row in rows:
        texts += [m["role"] + "\n" + m["content"] for m in row["input"]]
        texts += ["assistant\n" + row["output"], row["output"].upper()]
    return texts


def train_tokenizer(rows: list[dict], vocab_size: int):
    return train_chat_tokenizer(tokenizer_texts(rows), vocab_size=vocab_size, min_frequency=2)


def render_prefix(tok, row: dict) -> str:
    """The chat through the final generation prompt, as prepare.py renders it."""
    msgs = list(row["input"])
    if row.get("system_prompt"):
        msgs = [{"role": "system", "content": row["system_prompt"]}] + msgs
    return tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True, enable_thinking=row["reasoning"] == "on"
    )


def _assistant_spans(prefix: str) -> list[tuple[int, int]]:
    """Character spans of earlier assistant turns' content plus their <|im_end|>."""
    marker, end = "<|im_start|>assistant\n", "<|im_end|>"
    spans, pos = [], 0
    while (i := prefix.find(marker, pos)) >= 0:
        start = i + len(marker)
        j = prefix.find(end, start)
        if j < 0:  # the open generation prompt at the end
            break
        spans.append((start, j + len(end)))
        pos = j
    return spans


@dataclass
class Encoded:
    ids: list[int]  # prefix + final reply tokens
    loss: list[bool]  # True where the token is an assistant token (a training target)
    n_prefix: int  # tokens before the final reply


def encode_rows(tok, rows: list[dict], all_assistant_turns: bool = True) -> list[Encoded]:
    """Tokenise rows; the loss mask covers the final reply (incl. <|im_end|>) and, optionally,
    the earlier assistant turns."""
    prefixes = [render_prefix(tok, r) for r in rows]
    replies = [r["output"] + tok.eos_token for r in rows]
    enc_p = tok(prefixes, add_special_tokens=False, return_offsets_mapping=True)
    enc_r = tok(replies, add_special_tokens=False)
    out = []
    for prefix, p_ids, offsets, r_ids in zip(prefixes, enc_p["input_ids"], enc_p["offset_mapping"], enc_r["input_ids"]):
        mask = [False] * len(p_ids)
        if all_assistant_turns:
            for lo, hi in _assistant_spans(prefix):
                for t, (s, _) in enumerate(offsets):
                    if lo <= s < hi:
                        mask[t] = True
        out.append(Encoded(list(p_ids) + list(r_ids), mask + [True] * len(r_ids), len(p_ids)))
    return out


# --------------------------------------------------------------------------- training
def batch_plan(lengths: list[int], batch: int, steps: int, seed: int) -> list[list[int]]:
    """`steps` batches of indices: epochs of shuffled data, length-bucketed to cut padding."""
    rng = random.Random(f"toytrain/batches/{seed}")
    plan: list[list[int]] = []
    while len(plan) < steps:
        order = list(range(len(lengths)))
        rng.shuffle(order)
        epoch = []
        group = batch * 32
        for g in range(0, len(order), group):
            chunk = sorted(order[g : g + group], key=lambda i: lengths[i])
            epoch += [chunk[b : b + batch] for b in range(0, len(chunk) - batch + 1, batch)]
        rng.shuffle(epoch)
        plan += epoch
    return plan[:steps]


def collate(data: list[Encoded], idx: list[int], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids and next-token labels (IGNORE off the loss mask). Right padding
    needs no attention mask under causal attention: real tokens never see the pads."""
    T = max(len(data[i].ids) for i in idx)
    x = torch.full((len(idx), T), pad_id, dtype=torch.long)  # [batch, T]
    y = torch.full((len(idx), T), IGNORE, dtype=torch.long)  # [batch, T], y[:, t] is the target at t
    for b, i in enumerate(idx):
        ids = torch.tensor(data[i].ids)
        x[b, : len(ids)] = ids
        keep = torch.tensor(data[i].loss)
        y[b, : len(ids)] = torch.where(keep, ids, torch.full_like(ids, IGNORE))
    return x, y


def lm_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over labelled targets; x, y [batch, T].

    The LM head runs only where there is a target (about a third of the positions): with a
    3k vocabulary that is a sizeable share of a tiny model's FLOPs.
    """
    h = model.model(input_ids=x, use_cache=False).last_hidden_state  # [batch, T, hidden]
    targets = y[:, 1:]  # [batch, T-1]
    keep = targets != IGNORE
    logits = model.lm_head(h[:, :-1][keep])  # [n_targets, vocab]
    return F.cross_entropy(logits.float(), targets[keep])


def lr_at(step: int, steps: int, cfg: ToyConfig) -> float:
    warm = max(1, int(cfg.warmup_frac * steps))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def steps_for(cfg: ToyConfig, minutes: float, tokens_per_s: float, mean_len: float) -> int:
    """A fixed step count from a minutes budget: deterministic, unlike wall-clock stopping."""
    return max(cfg.min_steps, int(minutes * 60 * tokens_per_s / (cfg.batch * mean_len)))


def train_model(
    qcfg,
    data: list[Encoded],
    steps: int,
    cfg: ToyConfig,
    seed: int,
    pad_id: int,
    desc: str = "train",
    progress: bool = True,
    init: Callable[[Any], None] | None = None,
    checkpoint: Path | None = None,
    checkpoint_key: str = "",
    checkpoint_every: int = 200,
) -> tuple[Any, list[dict]]:
    """Train a fresh Qwen3ForCausalLM; return (model in eval mode, loss log). `init(model)`, when given,
    changes the freshly initialised weights before training.

    With `checkpoint` (a file), the weights, the optimiser state and the loss log are written there
    atomically every `checkpoint_every` steps under `checkpoint_key`, and a training that finds a
    checkpoint of the same key goes on from it: nothing else is random (the batch plan is fixed by the
    seed, dropout is off), so a killed and resumed training ends with the same weights as one that ran
    through. A checkpoint of another key is ignored and replaced."""
    from tqdm import tqdm
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    # Eager attention: at these tiny head counts it trains faster on CPU than SDPA (and much
    # faster under bf16 autocast). The saved config does not keep the choice.
    model = Qwen3ForCausalLM._from_config(qcfg, attn_implementation="eager")
    if init is not None:
        with torch.no_grad():
            init(model)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    plan = batch_plan([len(d.ids) for d in data], cfg.batch, steps, seed)
    log, running, start = [], [], 0
    if checkpoint is not None and checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=False)
        if state.get("key") == checkpoint_key:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            log, running, start = state["log"], state["running"], state["step"]
    bar = tqdm(plan, desc=desc, disable=not progress, mininterval=5, initial=start, total=steps)
    for step, idx in enumerate(plan[start:], start):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, cfg)
        x, y = collate(data, idx, pad_id)
        # bf16 autocast runs the matmuls in bf16 (weights and optimiser state stay fp32); the
        # cross-entropy is taken in fp32.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast_bf16):
            loss = lm_loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        running.append(loss.item())
        if (step + 1) % 50 == 0 or step + 1 == steps:
            log.append({"step": step + 1, "loss": sum(running) / len(running), "lr": opt.param_groups[0]["lr"]})
            bar.set_postfix(loss=f"{log[-1]['loss']:.3f}")
            running = []
        bar.update(1)
        if checkpoint is not None and (step + 1) % checkpoint_every == 0 and step + 1 < steps:
            state = {
                "key": checkpoint_key,
                "step": step + 1,
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "log": log,
                "running": running,
            }
            buf = io.BytesIO()
            torch.save(state, buf)
            atomic_write_bytes(checkpoint, buf.getvalue())
    bar.close()
    model.eval()
    return model, log


# --------------------------------------------------------------------------- scoring
@torch.no_grad()
def reply_token_hits(model, data: list[Encoded], pad_id: int, batch: int = 32) -> list[list[bool]]:
    """Per sequence, per reply token: is it the argmax given everything before it?"""
    hits = []
    for b in range(0, len(data), batch):
        chunk = data[b : b + batch]
        x, _ = collate(chunk, list(range(len(chunk))), pad_id)
        pred = model(input_ids=x, use_cache=False).logits.argmax(-1)  # [batch, T]
        for k, d in enumerate(chunk):
            target = torch.tensor(d.ids[d.n_prefix :])  # [reply tokens]
            hits.append((pred[k, d.n_prefix - 1 : len(d.ids) - 1] == target).tolist())
    return hits


def exact_replies(model, tok, rows: list[dict], batch: int = 32) -> list[bool]:
    """Per row: would greedy decoding reproduce row["output"] + <|im_end|> exactly?"""
    data = encode_rows(tok, rows, all_assistant_turns=False)
    return [all(h) for h in reply_token_hits(model, data, tok.pad_token_id, batch)]


def _task_rows(files: dict[str, Path], n: int) -> dict[str, list[dict]]:
    """The first n rows of each evaluation file as Nemotron rows holding their reference reply."""

    def row(prompt: str, reply: str) -> dict:
        return {
            "input": [{"role": "user", "content": prompt}],
            "output": reply,
            "reasoning": "off",
            "system_prompt": "",
            "category": "chat",
        }

    refs = {r["key"]: r["reply"] for r in read_jsonl(files["ifeval.ref"])}
    arc_refs = {r["id"]: r["reply"] for r in read_jsonl(files["arc.ref"])}
    return {
        "ifeval_file": [row(r["prompt"], refs[r["key"]]) for r in read_jsonl(files["ifeval"])[:n]],
        "arc_file": [row(toyworld.arc_prompt(r), arc_refs[r["id"]]) for r in read_jsonl(files["arc"])[:n]],
        "gsm8k_file": [row(toyworld.gsm8k_prompt(r), toyworld.gsm8k_reply(r)) for r in read_jsonl(files["gsm8k"])[:n]],
    }


def evaluation_sets(files: dict[str, Path], cfg: ToyConfig) -> dict[str, dict[str, list[dict]]]:
    """{set name: {condition: rows}}. Held-out context-dependent chats per kind are scored with
    their context, without it (only the final user turn) and with another chat's context."""
    chats, meta = read_jsonl(files["chats"]), read_jsonl(files["chats.meta"])
    sets: dict[str, dict[str, list[dict]]] = {}
    for kind in toyworld.KINDS:
        rows = [r for r, m in zip(chats, meta) if m["kind"] == kind and m["context_dependent"]][: cfg.eval_per_kind]
        # The wrong document: the next chat's context in front of this chat's final question.
        wrong = [{**r, "input": rows[(i + 1) % len(rows)]["input"][:-1] + r["input"][-1:]} for i, r in enumerate(rows)]
        sets[f"chat_{kind}"] = {
            "context": rows,
            "no_context": [toyworld.drop_context(r) for r in rows],
            "wrong_context": wrong,
        }
    for name, rows in _task_rows(files, cfg.eval_task_items).items():
        sets[name] = {"context": rows}
    return sets


def score_model(model, tok, sets: dict[str, dict[str, list[dict]]]) -> dict[str, dict[str, float]]:
    return {
        name: {
            cond: (sum(h := exact_replies(model, tok, rows)) / len(h) if rows else float("nan"))
            for cond, rows in conds.items()
        }
        for name, conds in sets.items()
    }


# --------------------------------------------------------------------------- the build
SOURCES = [Path(__file__), Path(toyworld.__file__), Path(__file__).with_name("tokenizer.py")]


def code_sha() -> str:
    """Hash of the code that determines the toy world (not the whole library: unrelated edits
    elsewhere must not trigger a retrain)."""
    return sha256_tree(SOURCES)


def _files_ok(out: Path, files: dict[str, str]) -> bool:
    return all((out / rel).is_file() and sha256_file(out / rel) == sha for rel, sha in files.items())


def round_to_bf16(model) -> None:
    """Round every weight to the nearest BF16 value, keeping FP32 tensors.

    The pair is stored in BF16 (half the bytes, so both models fit in git); rounding before
    scoring makes the manifest's scores those of the stored weights, which load back into
    FP32 exactly.
    """
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))


def _save_model(model, tok, path: Path, meta: dict) -> None:
    """Save (BF16) into a temp folder, write meta.json (the completion marker) last, then swap it in."""
    tmp = path.parent / f".{path.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.generation_config.pad_token_id = model.config.pad_token_id
    model.generation_config.bos_token_id = None
    # Lossless: the weights were rounded by round_to_bf16. Shards of at most 4 MB keep every
    # committed file of the packaged pair small; from_pretrained reads them as one model.
    model.to(torch.bfloat16).save_pretrained(tmp, max_shard_size=SHARD_SIZE)
    save_tokenizer(tok, tmp)
    atomic_write_json(tmp / "meta.json", {**meta, "weights_sha256": local_weights_digest(tmp)})
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)


WORLD_ENTRIES = (
    "manifest.json",
    "corpus",
    "tokenizer",
    "large",
    "small",
    "mismatched",
    "deep",
)  # what a toy world folder holds


def check_world_folder(out: Path) -> None:
    """Refuse (ValueError) a `--out` that is not a toy world's: building or installing replaces its corpus,
    tokenizer and model folders and its manifest.json, so a folder holding anything else, or another
    stage's manifest, is left alone. A new or empty folder, or a toy world (even a half-built one), is fine."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a new or empty folder, or a toy world")
    folders = [e for e in WORLD_ENTRIES if e != "manifest.json"]
    shown = not_ours(out, ["manifest.json"], "manifest.json", "stage", "toy_world", folders=folders)  # cut short
    if shown:
        raise ValueError(
            f"--out {out} holds what is not a toy world's ({shown}); building or installing there would "
            "replace or delete it. Give a new or empty folder, or a toy world"
        )


def build_toy_world(
    out: str | Path,
    seed: int = 0,
    mini: bool = False,
    minutes_per_model: float | None = None,
    force: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict:
    """Build (or verify and reuse) the toy world under `out`; return the manifest.

    Writes out/corpus/*.jsonl, out/tokenizer/, out/large/, out/small/ and out/manifest.json (last).
    """
    from transformers import AutoTokenizer

    t0 = time.time()
    out = Path(out)
    check_world_folder(out)
    cfg = mini_config(seed) if mini else full_config(seed, minutes_per_model)
    if minutes_per_model is not None and mini:
        cfg = replace(cfg, large_minutes=minutes_per_model, small_minutes=minutes_per_model)
    build_key = sha256_json({"config": asdict(cfg), "code": code_sha()})
    manifest_path = out / "manifest.json"
    if not force and manifest_path.is_file():
        old = read_json(manifest_path)
        if build_key_of(old) == build_key and _files_ok(out, old.get("files", {})):
            log(f"toy world at {out} is up to date (build key {build_key[:12]}); nothing to do")
            return old

    # --- corpus and evaluation files
    files = toyworld.write_world(out / "corpus", cfg.world)
    train_rows = read_jsonl(files["train_chats"])
    log(f"corpus: {len(train_rows)} training chats, files in {out / 'corpus'}")

    # --- tokenizer (shared by both models)
    tok = train_tokenizer(train_rows, cfg.vocab_size)
    save_tokenizer(tok, out / "tokenizer")
    tok = AutoTokenizer.from_pretrained(out / "tokenizer")  # what every stage will load
    data = [d for d in encode_rows(tok, train_rows) if len(d.ids) <= cfg.max_len]
    mean_len = sum(len(d.ids) for d in data) / len(data)
    log(f"tokenizer: vocab {len(tok)}; {len(data)} training sequences, mean {mean_len:.1f} tokens")

    corpus_sha = {name: sha256_file(p) for name, p in files.items()}
    tok_sha = sha256_file(out / "tokenizer" / "tokenizer.json")
    sets = evaluation_sets(files, cfg)
    results: dict[str, Any] = {}
    model_info: dict[str, Any] = {}
    threads_before = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        _build_models(
            out,
            cfg,
            build_key,
            tok,
            data,
            mean_len,
            corpus_sha,
            tok_sha,
            sets,
            seed,
            force,
            progress,
            log,
            results,
            model_info,
        )
    finally:
        torch.set_num_threads(threads_before)

    # --- manifest (written last: its presence with matching hashes means "built")
    rel_files = sorted(
        p.relative_to(out).as_posix()
        for p in out.rglob("*")
        if p.is_file() and p.name != "manifest.json" and not p.name.startswith(".")
    )
    n_samples = {name: {cond: len(rows) for cond, rows in conds.items()} for name, conds in sets.items()}
    return Report(
        "toy_world",
        config=cfg,
        inputs={"code_sha256": code_sha()},
        results={
            "exact_reply": results,
            "models": model_info,
            "mini": mini,
            "paths": {
                "large": "large",
                "small": "small",
                "tokenizer": "tokenizer",
                **{name: f"corpus/{p.name}" for name, p in files.items()},
            },
        },
        n_samples=n_samples,
        seeds={"world": seed, "large": seed, "small": seed + 1},
        wall_time_s=time.time() - t0,
        device="cpu",
        dtype="float32",
        resume_key=build_key,
        files={rel: sha256_file(out / rel) for rel in rel_files},
    ).write(manifest_path)


def build_key_of(manifest: dict) -> str | None:
    """A toy manifest's build key (`resume_key`; `build_key` in manifests of schema 1, as the packaged one)."""
    return manifest.get("resume_key") or manifest.get("build_key")


def is_mini(manifest: dict) -> bool:
    return bool(manifest.get("results", {}).get("mini", manifest.get("mini")))


def _build_models(
    out: Path,
    cfg: ToyConfig,
    build_key: str,
    tok,
    data: list[Encoded],
    mean_len: float,
    corpus_sha: dict,
    tok_sha: str,
    sets: dict,
    seed: int,
    force: bool,
    progress: bool,
    log: Callable[[str], None],
    results: dict,
    model_info: dict,
) -> None:
    """Train (or reuse, by key and weights hash) each model, score it, and fill results/model_info."""
    for i, (name, shape, minutes, rate) in enumerate(
        [
            ("large", cfg.large, cfg.large_minutes, cfg.large_tokens_per_s),
            ("small", cfg.small, cfg.small_minutes, cfg.small_tokens_per_s),
        ]
    ):
        qcfg = qwen3_config(cfg, shape, tok)
        steps = steps_for(cfg, minutes, rate, mean_len)
        model_key = sha256_json(
            {"build_key": build_key, "name": name, "steps": steps, "corpus": corpus_sha, "tokenizer": tok_sha}
        )
        path = out / name
        meta_path = path / "meta.json"
        meta = read_json(meta_path) if meta_path.is_file() else {}
        reuse = (
            not force
            and meta.get("model_key") == model_key
            and any(path.glob("*.safetensors"))
            and local_weights_digest(path) == meta.get("weights_sha256")
        )
        if reuse:
            log(f"{name}: reusing trained weights ({meta['train_steps']} steps)")
        else:
            log(
                f"{name}: training {steps} steps (hidden {shape.hidden}, {qcfg.num_attention_heads} heads, "
                f"rope_theta {shape.rope_theta:g})"
            )
            t1 = time.time()
            model, loss_log = train_model(
                qcfg, data, steps, cfg, seed + i, tok.pad_token_id, desc=name, progress=progress
            )
            train_s = time.time() - t1
            round_to_bf16(model)  # scored exactly as stored
            t2 = time.time()
            scores = score_model(model, tok, sets)
            meta = {
                "model_key": model_key,
                "name": name,
                "train_steps": steps,
                "train_wall_s": train_s,
                "eval_wall_s": time.time() - t2,
                "n_params": sum(p.numel() for p in model.parameters()),
                "threads": torch.get_num_threads(),
                "seed": seed + i,
                "loss_log": loss_log,
                "exact_reply": scores,
                "config": asdict(cfg),
            }
            _save_model(model, tok, path, meta)
        results[name] = meta["exact_reply"]
        model_info[name] = {k: meta[k] for k in ("train_steps", "train_wall_s", "eval_wall_s", "n_params", "threads")}
        model_info[name]["final_loss"] = meta["loss_log"][-1]["loss"] if meta["loss_log"] else None
        model_info[name]["qwen3_config"] = {
            k: getattr(qcfg, k)
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "rope_parameters",
                "tie_word_embeddings",
                "max_position_embeddings",
            )
        }


# --------------------------------------------------------------------------- the packaged pair
PACKAGED = Path(__file__).with_name("pair")  # the committed full build: tokenizer, BF16 models, manifest
PACKAGED_PARTS = ("tokenizer", "large", "small")
RETRAIN_HINT = (
    "retrain and re-export the pair with `make toy-train` "
    "(python toy_world.py --out artifacts/toy --train --export kvlingo/toy/pair; ~26 CPU-minutes)"
)


def _copy_tree_atomic(src: Path, dest: Path) -> None:
    tmp = dest.parent / f".{dest.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def export_pair(built: str | Path, dest: str | Path = PACKAGED, log: Callable[[str], None] = print) -> dict:
    """Copy a verified full build's tokenizer, models and manifest (not its corpus) into `dest`."""
    built, dest = Path(built), Path(dest)
    manifest = read_json(built / "manifest.json")
    if is_mini(manifest):
        raise ValueError(f"{built} is a mini build; only a full build is exported")
    bad = [
        rel for rel, sha in manifest["files"].items() if not (built / rel).is_file() or sha256_file(built / rel) != sha
    ]
    if bad:
        raise ValueError(f"{built}: {len(bad)} file(s) differ from its manifest (first: {bad[0]}); rebuild it first")
    dest.mkdir(parents=True, exist_ok=True)
    for part in PACKAGED_PARTS:
        _copy_tree_atomic(built / part, dest / part)
    atomic_write_json(dest / "manifest.json", manifest)  # last: marks the export complete
    log(f"exported the pair of {built} to {dest}")
    return manifest


def install_pair(out: str | Path, packaged: str | Path = PACKAGED, log: Callable[[str], None] = print) -> dict:
    """Materialise the packaged pair under `out` as a complete toy world; return its manifest.

    The corpus is regenerated from the world config in the packaged manifest and must match the
    sha256 of the corpus the pair was trained on; the packaged files must match their hashes.
    Either failure raises ValueError naming the file and the fix, before anything in `out` is
    replaced. A second call finds everything in place and returns.
    """
    out, packaged = Path(out), Path(packaged)
    check_world_folder(out)
    if not (packaged / "manifest.json").is_file():
        raise ValueError(f"no packaged toy pair at {packaged}; {RETRAIN_HINT}")
    manifest = read_json(packaged / "manifest.json")
    files: dict[str, str] = manifest["files"]
    if (out / "manifest.json").is_file():
        old = read_json(out / "manifest.json")
        if build_key_of(old) == build_key_of(manifest) and _files_ok(out, files):
            log(f"toy world at {out} is up to date (build key {build_key_of(manifest)[:12]}); nothing to do")
            return old
    bad = [
        rel
        for rel, sha in files.items()
        if rel.split("/")[0] in PACKAGED_PARTS
        and (not (packaged / rel).is_file() or sha256_file(packaged / rel) != sha)
    ]
    if bad:
        raise ValueError(
            f"{packaged / bad[0]} differs from the packaged manifest ({len(bad)} file(s)); "
            f"restore it (git checkout -- {packaged}) or {RETRAIN_HINT}"
        )
    world = toyworld.WorldConfig(
        **{**manifest["config"]["world"], "kind_weights": tuple(manifest["config"]["world"]["kind_weights"])}
    )
    staging = out.parent / f".{out.name}.corpus.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    written = toyworld.write_world(staging, world)
    changed = [f"corpus/{p.name}" for p in written.values() if sha256_file(p) != files.get(f"corpus/{p.name}")]
    if changed:
        shutil.rmtree(staging, ignore_errors=True)
        raise ValueError(
            f"the corpus generator no longer reproduces the corpus the packaged pair was trained on "
            f"({', '.join(changed)} differ); {RETRAIN_HINT}"
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").unlink(missing_ok=True)  # incomplete until the new one is written
    shutil.rmtree(out / "corpus", ignore_errors=True)
    staging.rename(out / "corpus")
    for part in PACKAGED_PARTS:
        _copy_tree_atomic(packaged / part, out / part)
    atomic_write_json(out / "manifest.json", {**manifest, "installed_from": str(packaged)})
    log(f"installed the packaged toy pair into {out} (corpus regenerated and verified, {len(files)} files)")
    return read_json(out / "manifest.json")


def summary_table(manifest: dict) -> str:
    """Exact-reply accuracy per evaluation set and condition, one column per model."""
    res = manifest["results"]["exact_reply"]
    names = list(res)
    rows = []
    for set_name, conds in res[names[0]].items():
        for cond in conds:
            rows.append([set_name, cond, *(res[n][set_name][cond] for n in names)])
    return fmt_table(["set", "condition", *names], rows, floatfmt=".3f")
