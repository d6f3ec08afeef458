"""Training the translator: the closed-form fit, the distillation step, checkpoints and resume guards.

The stage script (train_translator.py) owns the loop and the files; this module owns what the
loop calls. Everything is batch-one: a batch is gradient accumulation over conversations.

Closed-form fit
  Tokens. Source and target each read one whole conversation (prefix + reply) in a single
  forward pass, so both caches hold the same tokens at the same positions, and every
  position is one training pair. Inputs: the source's key features
  (`Translator.key_features`) and values; outputs: `target_key_features` of the target and
  its values. Reply positions are kept: a later turn hands over a cache that holds earlier
  replies, and they double the tokens per conversation.
  Weighting "uniform": every position weighs 1.
  Weighting "attention": the positions the handed-over cache holds (context = prefix[:-1],
  see `cache.handoff_split`) are weighted by how much the scored positions (new =
  prefix[-1] + reply[:-1], whose logits predict the reply) attend to them in the native
  target reading the real conversation. For block (layer l, KV head h) and context position j:
      a[l,h,j] = mean over scored query positions i and over the query heads of KV group h
                 of softmax_{j' ≤ i}(q_i · k_j' · scaling)[j]
      w[l,h,j] = a[l,h,j] / mean_j' a[l,h,j']      (mean 1 over the context, per block and conversation)
  The last prefix token and the reply positions are never read from a handed-over cache in
  this split, so no attention measures them; they weigh 1, the context average.
  The probabilities are computed here from the target's own post-norm queries (hooked on
  q_norm, RoPE re-applied in FP32) and its cached keys, only for the scored rows, in FP32
  softmax. That equals eager attention's `output_attentions` (tested against it) without an
  eager copy of the target and without materialising [heads, T, T] for every layer, which at a
  16k-token prefix would not fit in memory.

Distillation
  Loss per conversation: mean over reply tokens of KL(native target || target on the
  translated cache), in FP32 (`kl.token_kl`). The native arm reads the real
  prefix + reply[:-1] in one pass; the translated arm reads the translated cache of
  prefix[:-1] and runs prefix[-1:] + reply[:-1] itself. A batch loss is the mean over its
  conversations. Gradients reach the FP32 maps through the frozen target and through the
  cast to the model dtype inside `Translator`.
  Validation KL: the same per-conversation mean, averaged over the validation conversations.

Checkpoints
  `ckpt_<update>.pt` (a torch.save buffer, written atomically), then `DONE_<update>` holding
  its sha256 in `sha256sum` format. Only a checkpoint with a DONE marker and a matching hash
  counts; a damaged one is skipped with a warning and the previous complete one is used.
"""

from __future__ import annotations

import hashlib
import io
import random
import re
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from .cache import Capture, capture, continue_from, handoff_split
from .fit import NormalEquations
from .handoff import as_ids
from .kl import token_kl
from .maps import HeadwiseMaps, Translator, target_key_features
from .maps import check_maps_for_pair as check_maps
from .maps import load_translator as load_translator_for
from .models import weights_fingerprint
from .report import atomic_write_bytes, atomic_write_text, read_jsonl, sha256_bytes
from .rope import RopeCache, apply_rope

FIT_WEIGHTINGS = ("uniform", "attention")
DEFAULT_LR = {"l2s": 1e-4, "s2l": 1e-3}
# Settings that decide only when things are measured or written, never the maps: resume may change them.
RESUME_SAFE = ("val_every", "checkpoint_every")
CHECKPOINT_FORMAT = 1


@dataclass(frozen=True)
class TrainConfig:
    profile: str  # run profile name (data budget, updates, batch)
    direction: str  # l2s: the large model builds the cache, the small one continues; s2l the reverse
    key_space: str  # prenorm or cache: what the key maps read and write (see maps.py)
    fit_weighting: str  # uniform, or attention: context positions weighted by the target's reply-time attention
    ridge: float  # ridge λ of the closed-form fit (the bias is not shrunk)
    n_fit: int  # train conversations in the closed-form fit (the first n_fit of a seeded order)
    updates: int  # distillation optimiser updates
    batch: int  # conversations accumulated per update (the adapter is batch-one)
    lr: float  # AdamW learning rate, constant
    weight_decay: float  # AdamW decoupled weight decay; 0 so that the maps are not pulled toward zero, away from the fit
    max_grad_norm: float  # clip of the maps' gradient norm per update; 0 turns it off
    val_every: int  # validation KL every N updates (and at the end)
    checkpoint_every: int  # checkpoint every N updates (and at the end)
    seed: int  # data order and every RNG
    device: str  # device the models and maps run on
    dtype: str  # model dtype; the maps stay FP32


class ResumeRefused(ValueError):
    """A checkpoint that belongs to different data, code, models or settings."""


class CheckpointError(ValueError):
    """No intact checkpoint to resume from."""


class FrozenWeightsChanged(RuntimeError):
    """A frozen model's weights changed during training."""


# --------------------------------------------------------------------------- data
def read_rows(path: str | Path, vocab_size: int | None = None) -> list[dict]:
    """Rows of a prepared split file, each checked for what training reads (ids in range)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path} not found; prepare the data first (python paper_data.py --profile ...)")
    rows = read_jsonl(path)
    if not rows:
        raise ValueError(f"{path} holds no rows; prepare the data again (python paper_data.py --profile ... --force)")
    for n, r in enumerate(rows, 1):
        p, q = r.get("prefix_ids"), r.get("reply_ids")
        if not isinstance(p, list) or len(p) < 2 or not isinstance(q, list) or not q:
            raise ValueError(f"{path} line {n}: needs prefix_ids (≥2 ids) and reply_ids (≥1 id); re-run paper_data.py")
        if vocab_size is not None and max(p + q) >= vocab_size:
            raise ValueError(
                f"{path} line {n}: token id {max(p + q)} ≥ vocabulary {vocab_size}: the data was tokenized "
                "for another tokenizer; prepare it with the pair's tokenizer"
            )
    return rows


def seeded_order(n: int, seed: int, stream: str) -> list[int]:
    """A permutation of range(n) that is a pure function of (seed, stream), independent of global RNG."""
    digest = hashlib.sha256(f"{seed}/{stream}".encode()).digest()
    order = list(range(n))
    random.Random(int.from_bytes(digest[:8], "big")).shuffle(order)
    return order


def fit_selection(n_rows: int, n_fit: int, seed: int) -> list[int]:
    """Row indices of the closed-form fit: the first n_fit of a seeded order."""
    return seeded_order(n_rows, seed, "fit")[:n_fit]


def data_order(n_rows: int, seed: int, length: int) -> list[int]:
    """Distillation row indices: seeded permutations of the train rows, one per epoch, concatenated."""
    order: list[int] = []
    epoch = 0
    while len(order) < length:
        order += seeded_order(n_rows, seed, f"distill/{epoch}")
        epoch += 1
    return order[:length]


# --------------------------------------------------------------------------- attention weighting
def capture_with_queries(model, ids: torch.Tensor, want_prenorm: bool, q_start: int, n_q: int
                         ) -> tuple[Capture, torch.Tensor]:
    """`cache.capture` plus each layer's post-q_norm, pre-RoPE queries at positions q_start..q_start+n_q-1.

    Returns (capture, queries [layers, q_heads, n_q, head_dim]).
    """
    rows: list[torch.Tensor] = []
    # q_norm sees [1, tokens, q_heads, head_dim]: keep only the scored rows.
    hooks = [layer.self_attn.q_norm.register_forward_hook(lambda _m, _i, out: rows.append(out[0, q_start:q_start + n_q]))
             for layer in model.model.layers]
    try:
        cap = capture(model, ids, want_prenorm=want_prenorm, logits_to_keep=1)
    finally:
        for h in hooks:
            h.remove()
    return cap, torch.stack(rows).transpose(1, 2)


def scored_attention(model, keys: torch.Tensor, queries: torch.Tensor, q_start: int, n_keys: int,
                     rope: RopeCache, chunk: int = 256) -> torch.Tensor:
    """Mean attention probability from the scored queries to each of the first `n_keys` positions.

    keys [layers, kv_heads, tokens, head_dim] (cached: post-norm, post-RoPE);
    queries [layers, q_heads, n_q, head_dim] (post-norm, pre-RoPE) at positions q_start.. .
    Returns [layers, kv_heads, n_keys] in FP64: averaged over the queries and over the query
    heads that share each KV head (Qwen3's GQA: query head q reads KV head q // group).
    """
    L, n_heads, n_q, d = queries.shape
    kv_heads, T = keys.shape[1], keys.shape[2]
    group = n_heads // kv_heads
    scaling = model.model.layers[0].self_attn.scaling
    cos, sin = rope(q_start + n_q, device=keys.device)
    out = torch.zeros(L, kv_heads, n_keys, dtype=torch.float64)
    with torch.autocast(device_type=keys.device.type, enabled=False):
        for l in range(L):
            k = keys[l].float().repeat_interleave(group, dim=0)  # [q_heads, tokens, head_dim]
            q = apply_rope(queries[l].float(), cos[q_start:], sin[q_start:])  # [q_heads, n_q, head_dim]
            acc = torch.zeros(n_heads, n_keys, dtype=torch.float64, device=keys.device)
            for c0 in range(0, n_q, chunk):
                c1 = min(n_q, c0 + chunk)
                scores = (q[:, c0:c1] @ k.transpose(1, 2)) * scaling  # [q_heads, c, tokens]
                pos = torch.arange(q_start + c0, q_start + c1, device=keys.device)
                future = torch.arange(T, device=keys.device)[None, :] > pos[:, None]  # causal mask [c, tokens]
                p = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
                acc += p[..., :n_keys].sum(1).double()
            out[l] = (acc / n_q).view(kv_heads, group, n_keys).mean(1).cpu()
    return out


def attention_fit_weights(attn: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """attn [layers, kv_heads, n_context] → per-position fit weights [layers, kv_heads, n_tokens].

    Context positions: attention normalised to mean 1 per block; the rest: 1.
    """
    L, H, n_ctx = attn.shape
    w = torch.ones(L, H, n_tokens, dtype=torch.float64)
    w[..., :n_ctx] = attn / attn.mean(-1, keepdim=True).clamp_min(1e-30)
    return w


# --------------------------------------------------------------------------- closed-form fit
def fit_closed_form(source, target, rows: list[dict], key_space: str, weighting: str = "uniform",
                    ridge: float = 0.0, progress: Callable | None = None) -> tuple[HeadwiseMaps, dict[str, Any]]:
    """FP64 least squares of the head-wise maps over `rows`; returns (FP32 maps on the source's device, stats)."""
    if weighting not in FIT_WEIGHTINGS:
        raise ValueError(f"fit weighting {weighting!r} is not one of {FIT_WEIGHTINGS}")
    device = next(source.parameters()).device
    maps = HeadwiseMaps.for_pair(source, target, key_space).to(device)
    translator = Translator(maps, source, target)
    target_rope = RopeCache(target)
    L, H, d_in, d_out = maps.shape
    ne = NormalEquations(L, H, d_in, d_out, device="cuda" if device.type == "cuda" else "cpu")
    prenorm = key_space == "prenorm"
    for row in (progress(rows) if progress else rows):
        prefix, reply = row["prefix_ids"], row["reply_ids"]
        ids = as_ids(prefix + reply, device)  # [1, tokens]
        with torch.no_grad():
            src = capture(source, ids, want_prenorm=prenorm, logits_to_keep=1)
            if weighting == "attention":
                n_ctx = len(prefix) - 1  # handoff_split: the cache holds prefix[:-1], the target scores from prefix[-1]
                tgt, queries = capture_with_queries(target, ids, prenorm, q_start=n_ctx, n_q=len(reply))
                attn = scored_attention(target, tgt.keys, queries, n_ctx, n_ctx, target_rope)
                weights = attention_fit_weights(attn, ids.shape[1])  # [layers, kv_heads, tokens]
            else:
                tgt, weights = capture(target, ids, want_prenorm=prenorm, logits_to_keep=1), None
            ne.update(0, translator.key_features(src), target_key_features(tgt, key_space, target_rope), weights)
            ne.update(1, src.values, tgt.values, weights)
    W, b = ne.solve(ridge)
    with torch.no_grad():
        maps.weight.copy_(W.float())
        maps.bias.copy_(b.float())
    return maps, {"n_conversations": len(rows), "n_tokens": ne.n_tokens, "key_space": key_space,
                  "weighting": weighting, "ridge": ridge}


# --------------------------------------------------------------------------- distillation
def distill_loss(source, target, translator: Translator, row: dict, dtype: torch.dtype) -> torch.Tensor:
    """Mean over reply tokens of KL(native target || target on the translated cache); FP32 scalar with grad."""
    context, new, _ = handoff_split(row["prefix_ids"], row["reply_ids"])
    device = next(target.parameters()).device
    with torch.no_grad():
        # The native arm reads the real prefix and the reply; its last len(new) positions predict the reply.
        native = target(input_ids=as_ids(context + new, device), use_cache=False, logits_to_keep=len(new)).logits[0]
        cap = capture(source, as_ids(context, device), want_prenorm=translator.maps.key_space == "prenorm",
                      logits_to_keep=1)
    keys, values = translator(cap, dtype)  # [layers, kv_heads, context, head_dim], model dtype, differentiable
    out = continue_from(target, keys, values, as_ids(new, device))
    return token_kl(native, out.logits[0]).mean()  # [new] → scalar


def distill_step(source, target, translator: Translator, rows: list[dict], optimizer, dtype: torch.dtype,
                 max_grad_norm: float = 0.0) -> float:
    """One optimiser update over `rows` (gradient accumulation); returns the batch's mean loss."""
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for row in rows:
        loss = distill_loss(source, target, translator, row, dtype) / len(rows)
        loss.backward()
        total += loss.item()
    if max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(translator.maps.parameters(), max_grad_norm)
    optimizer.step()
    return total


def validation_kl(source, target, translator: Translator, rows: list[dict], dtype: torch.dtype,
                  progress: Callable | None = None) -> float:
    """Mean over conversations of the per-conversation mean reply-token KL. Leaves every RNG as it found it."""
    with preserved_rng(), torch.no_grad():
        kls = [distill_loss(source, target, translator, r, dtype).item() for r in (progress(rows) if progress else rows)]
    return sum(kls) / len(kls)


def make_optimizer(maps: HeadwiseMaps, cfg: TrainConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(maps.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


# --------------------------------------------------------------------------- frozen models
def check_frozen(models: dict[str, Any]) -> None:
    for name, model in models.items():
        live = [n for n, p in model.named_parameters() if p.requires_grad]
        if live:
            raise FrozenWeightsChanged(f"the {name} model has trainable parameters ({live[:3]}...); it must be frozen")


def fingerprints(models: dict[str, Any]) -> dict[str, str]:
    return {name: weights_fingerprint(m) for name, m in models.items()}


def verify_frozen(models: dict[str, Any], before: dict[str, str]) -> dict[str, Any]:
    """Fingerprints after training against `before`; raises FrozenWeightsChanged on any difference."""
    check_frozen(models)
    after = fingerprints(models)
    report = {name: {"before": before[name], "after": after[name], "match": before[name] == after[name]} for name in before}
    changed = [f"{n} {r['before'][:12]}… → {r['after'][:12]}…" for n, r in report.items() if not r["match"]]
    if changed:
        raise FrozenWeightsChanged("frozen model weights changed during training: " + "; ".join(changed))
    return {"requires_grad_off": True, "models": report, "verified": True}


# --------------------------------------------------------------------------- RNG state
def rng_state() -> dict[str, Any]:
    """Python, numpy, torch (and cuda/mps where present) RNG states, in a form torch.load(weights_only) accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "mps": torch.mps.get_rng_state() if torch.backends.mps.is_available() else None,
    }
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if state.get("mps") is not None and torch.backends.mps.is_available():
        torch.mps.set_rng_state(state["mps"])


@contextmanager
def preserved_rng():
    saved = rng_state()
    try:
        yield
    finally:
        set_rng_state(saved)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# --------------------------------------------------------------------------- checkpoints
CKPT_RE = re.compile(r"^DONE_(\d+)$")


def checkpoint_paths(folder: str | Path, update: int) -> tuple[Path, Path]:
    folder = Path(folder)
    return folder / f"ckpt_{update:06d}.pt", folder / f"DONE_{update:06d}"


def save_checkpoint(folder: str | Path, update: int, state: dict[str, Any]) -> Path:
    """Write the checkpoint atomically, then its DONE marker (sha256) last."""
    path, marker = checkpoint_paths(folder, update)
    buf = io.BytesIO()
    torch.save({"format": CHECKPOINT_FORMAT, "update": update, **state}, buf)
    data = buf.getvalue()
    atomic_write_bytes(path, data)
    atomic_write_text(marker, f"{sha256_bytes(data)}  {path.name}\n")
    return path


def load_checkpoint(path: str | Path, marker: str | Path) -> dict[str, Any]:
    """Load one checkpoint after checking it against its marker; CheckpointError if damaged."""
    path, marker = Path(path), Path(marker)
    try:
        want = marker.read_text().split()[0]
        data = path.read_bytes()
    except (OSError, IndexError) as e:
        raise CheckpointError(f"{path.name}: unreadable ({type(e).__name__}: {e})") from e
    got = sha256_bytes(data)
    if got != want:
        raise CheckpointError(f"{path.name}: sha256 {got[:12]}… does not match its DONE marker {want[:12]}… "
                              "(truncated or corrupted)")
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 — any unpickling failure means a damaged file
        raise CheckpointError(f"{path.name}: does not load ({type(e).__name__}: {e})") from e
    if state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path.name}: checkpoint format {state.get('format')} is not {CHECKPOINT_FORMAT}")
    return state


def complete_checkpoints(folder: str | Path) -> list[tuple[int, Path, Path]]:
    """(update, checkpoint, marker) for every DONE marker, newest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        m = CKPT_RE.match(p.name)
        if m:
            update = int(m.group(1))
            found.append((update, checkpoint_paths(folder, update)[0], p))
    return sorted(found, reverse=True)


def newest_checkpoint(folder: str | Path, warn: Callable[[str], None] = print) -> dict[str, Any] | None:
    """The newest intact checkpoint. A damaged one is skipped with a warning; None if there are none at all.

    Raises CheckpointError when checkpoints exist but none is intact.
    """
    candidates = complete_checkpoints(folder)
    problems = []
    for update, path, marker in candidates:
        try:
            state = load_checkpoint(path, marker)
        except CheckpointError as e:
            problems.append(str(e))
            warn(f"warning: skipping damaged checkpoint {e}")
            continue
        if problems:
            warn(f"warning: resuming from the previous complete checkpoint, {path.name} (update {update})")
        return state
    if problems:
        raise CheckpointError(
            f"no intact checkpoint in {folder}: " + "; ".join(problems)
            + ". Start a fresh run (drop --resume)."
        )
    return None


TEMP_RE = re.compile(r"^\.(ckpt_\d+\.pt|DONE_\d+)\..*\.tmp$")  # atomic_write_bytes' temp files, left by a kill
FILE_RE = re.compile(r"^(ckpt_\d+\.pt|DONE_\d+)$")


def clear_checkpoints(folder: str | Path, temp_only: bool = False) -> int:
    """Remove this module's checkpoint files (a fresh run must not resume into an old one's), or only temp files."""
    folder = Path(folder)
    if not folder.is_dir():
        return 0
    n = 0
    for p in folder.iterdir():
        if TEMP_RE.match(p.name) or (not temp_only and FILE_RE.match(p.name)):
            p.unlink()
            n += 1
    return n


# --------------------------------------------------------------------------- resume guards
def run_identity(cfg: TrainConfig, data: dict[str, str], code_sha256: str, models: dict[str, Any],
                 weights: dict[str, str]) -> dict[str, Any]:
    """What a checkpoint must agree on to be resumed: data hashes, code hash, model identities, settings."""
    return {"config": asdict(cfg), "data": dict(data), "code_sha256": code_sha256, "models": models, "weights": weights}


def _short(v: Any) -> str:
    s = str(v)
    return s[:12] + "…" if len(s) == 64 and all(c in "0123456789abcdef" for c in s) else s


def resume_mismatches(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Every difference between a checkpoint's identity and this run's, one phrase each."""
    out = []
    for name in sorted(set(saved["data"]) | set(current["data"])):
        a, b = saved["data"].get(name), current["data"].get(name)
        if a != b:
            out.append(f"data changed: {name} sha256 {_short(a)} → {_short(b)}")
    if saved["code_sha256"] != current["code_sha256"]:
        a, b = _short(saved["code_sha256"]), _short(current["code_sha256"])
        out.append(f"code changed: kvlingo + script sha256 {a} → {b}")
    for role in sorted(set(saved["models"]) | set(current["models"])):
        a, b = saved["models"].get(role) or {}, current["models"].get(role) or {}
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                out.append(f"models changed: {role} {k} {_short(a.get(k))} → {_short(b.get(k))}")
    for role in sorted(set(saved["weights"]) | set(current["weights"])):
        a, b = saved["weights"].get(role), current["weights"].get(role)
        if a != b:
            out.append(f"models changed: {role} weights fingerprint {_short(a)} → {_short(b)}")
    for k in sorted(set(saved["config"]) | set(current["config"])):
        if k in RESUME_SAFE:
            continue
        a, b = saved["config"].get(k), current["config"].get(k)
        if a != b:
            out.append(f"settings changed: {k} {a} → {b}")
    return out


def check_resume(saved: dict[str, Any], current: dict[str, Any]) -> None:
    problems = resume_mismatches(saved, current)
    if problems:
        raise ResumeRefused(
            "refusing to resume: " + "; ".join(problems)
            + "; start a fresh run (drop --resume) or restore the original inputs"
        )


# --------------------------------------------------------------------------- maps for a pair
def load_translator(folder: str | Path, pair, key_space: str | None = None) -> tuple[Translator, dict[str, Any]]:
    """Maps saved by the training stage (closed_form/ or distilled/), checked against `pair`, as a Translator."""
    models = {"source": pair.source_spec.identity(), "target": pair.target_spec.identity()}
    return load_translator_for(folder, pair.source, pair.target, pair.direction, models, key_space)


def check_maps_for_pair(manifest: dict[str, Any], direction: str, models: dict[str, Any],
                        key_space: str | None = None) -> None:
    """An --init-from start must come from this pair, direction and key space."""
    shape = tuple(manifest["shape"][k] for k in ("layers", "kv_heads", "d_in", "d_out"))
    if manifest.get("direction") != direction:
        raise ValueError(f"maps are for direction {manifest.get('direction')!r}, this run is {direction!r}; "
                         "train maps for this direction")
    check_maps(manifest, shape, shape, direction, models, key_space)

