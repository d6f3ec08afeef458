"""Reply quality after a handoff, arm by arm, on the same conversations.

Every arm scores the true reply with `cache.handoff_split`: a cache of `prefix[:-1]` is
handed over, and the continuing model reads `prefix[-1] + reply[:-1]` itself, so that its
logits predict every reply token. The arms differ only in which cache it gets:

    native_source  the source's own cache; the source continues (how far apart the models are)
    native_target  the target's own cache; the target continues (the reference: KL 0)
    closed_form    the source's cache through the closed-form maps; the target continues
    distilled      the source's cache through the distilled maps; the target continues
    control        the control maps applied to *another* conversation's source cache of the
                   same length (see `control_contexts`): a map that ignores its input scores
                   as well here as in its own arm, so this arm shows it
    no_context     no cache at all: the target reads only `prefix[-1] + reply[:-1]`, i.e. the
                   last prefix token (the generation prompt's final token) and the reply. The
                   floor: what the target predicts with none of the conversation

Every cache, native ones included, is captured and injected through the same code
(`core.handoff`: capture_source / translate / continue_target), so arms differ in cache
contents only; the reconstruction control (`controls.py`) checks that this path equals
ordinary split execution. KL is KL(native target ‖ arm) per reply token, in FP32 (`kl.token_kl`).
Beside it every arm carries the context metrics (`context.py`): KL and top-1 on the reply tokens
the context decides, the context-weighted KL, and (arms the target continues) the agreement of
each layer's attention output with the native cache's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..core.cache import handoff_split
from ..core.handoff import as_ids, attention_outputs, capture_source, continue_target, device_of, translate
from ..core.kl import token_kl, token_nll, top1_agreement
from ..core.translator import Translator
from . import context as ctx
from .stats import mean_se, paired_t

ARMS = ("native_source", "native_target", "closed_form", "distilled", "control", "no_context")
TRANSLATED = ("closed_form", "distilled")
CHUNK = 256  # reply positions scored at a time: bounds the FP32 [tokens, vocab] work tensors


# --------------------------------------------------------------------------- the control's contexts
def control_contexts(convs: Sequence[dict]) -> list[dict]:
    """For each conversation, the context the control arm translates instead of its own.

    Conversation i (context length n = len(prefix) - 1) is paired with the next conversation
    in order, cyclically, whose own context is at least n tokens long, cropped to its first n
    tokens ("cropped"). When no other conversation is long enough, the contexts of the others
    are joined in that order (going round them again if they are still too short) and
    cropped to n ("joined"). Either way the control context
    comes from other conversations only and has exactly the length of the one it replaces.
    Returns one {"ids": [conversation ids used], "kind", "context_ids"} per conversation.
    """
    if len(convs) < 2:
        raise ValueError("the control arm needs at least two conversations (it translates another one's cache)")
    contexts = [list(c["prefix_ids"][:-1]) for c in convs]
    out = []
    for i, conv in enumerate(convs):
        n = len(contexts[i])
        order = [(i + j) % len(convs) for j in range(1, len(convs))]
        match = next((j for j in order if len(contexts[j]) >= n), None)
        if match is not None:
            out.append({"ids": [convs[match]["id"]], "kind": "cropped", "context_ids": contexts[match][:n]})
            continue
        if not any(contexts[j] for j in order):
            raise ValueError(f"conversation {conv['id']}: the other conversations have empty contexts")
        joined, used = [], []
        while len(joined) < n:  # few, short others: go round them again
            for j in order:
                joined += contexts[j]
                used.append(convs[j]["id"])
                if len(joined) >= n:
                    break
        out.append({"ids": used, "kind": "joined", "context_ids": joined[:n]})
    return out


# --------------------------------------------------------------------------- scoring
def score_logits(ref: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Sums over reply tokens of KL(ref ‖ logits), NLL of the true tokens and top-1 agreement.

    ref/logits [tokens, vocab] (vocabularies cropped to the shorter: rows past the shared
    tokenizer's ids are padding), targets [tokens]. Scored CHUNK positions at a time.
    """
    v = min(ref.shape[-1], logits.shape[-1])
    kl = nll = top1 = 0.0
    for s in range(0, targets.shape[0], CHUNK):
        r, q, t = ref[s : s + CHUNK, :v], logits[s : s + CHUNK, :v], targets[s : s + CHUNK]
        kl += token_kl(r, q).sum().item()
        nll += token_nll(q, t).sum().item()
        top1 += top1_agreement(r, q).sum().item()
    return {"kl_sum": kl, "nll_sum": nll, "top1_sum": top1, "n_tokens": int(targets.shape[0])}


@torch.no_grad()
def score_conversation(
    source,
    target,
    translators: dict[str, Translator],
    control_translator: str | None,
    conv: dict,
    control_context: Sequence[int],
    out_dtype: torch.dtype,
    refresh=None,
    kind: str = "preallocated",
) -> dict[str, dict]:
    """Per-arm sums for one conversation. Arms whose maps are absent from `translators` are left out;
    the control arm runs when `control_translator` names one of them. A `refresh` (kvlingo.core.refresh)
    applies to every translated cache, the control's included; every arm builds caches of `kind`."""
    device = device_of(target)
    context, new, targets = handoff_split(conv["prefix_ids"], conv["reply_ids"])
    new_t, tgt = as_ids(new, device), torch.as_tensor(targets, device=device)
    if control_translator is not None and len(control_context) != len(context):
        raise ValueError(
            f"the control context has {len(control_context)} tokens, not the {len(context)} of the "
            "context it stands in for (see control_contexts)"
        )

    native_attn: list = []
    own_t = capture_source(target, context, kind=kind)
    with attention_outputs(target, len(new), native_attn):
        ref = continue_target(target, (own_t.keys, own_t.values), new_t, kind).logits[0]  # [reply tokens, vocab]
    del own_t
    no_ctx = target(input_ids=new_t, use_cache=False).logits[0]
    change = ctx.context_change(ref, no_ctx)  # [reply tokens]: how much the context moves each prediction

    def on_target(kv) -> dict:  # an arm whose cache the target continues: the sums, context metrics included
        attn: list = []
        with attention_outputs(target, len(new), attn):
            logits = continue_target(target, kv, new_t, kind).logits[0]
        return {
            **score_logits(ref, logits, tgt),
            **ctx.score(ref, logits, change),
            **ctx.attention_agreement(native_attn, attn),
        }

    src = capture_source(source, context, translators.values(), kind)
    arms = {"native_target": {**score_logits(ref, ref, tgt), **ctx.score(ref, ref, change)}}
    source_logits = continue_target(source, (src.keys, src.values), new_t, kind).logits[0]
    arms["native_source"] = {**score_logits(ref, source_logits, tgt), **ctx.score(ref, source_logits, change)}
    for name, translator in translators.items():
        arms[name] = on_target(
            translate(source, translator, context, out_dtype, cap=src, refresh=refresh, target=target, kind=kind)
        )
    del src
    if control_translator is not None:
        arms["control"] = on_target(
            translate(
                source,
                translators[control_translator],
                control_context,
                out_dtype,
                refresh=refresh,
                target=target,
                kind=kind,
            )
        )
    arms["no_context"] = {**score_logits(ref, no_ctx, tgt), **ctx.score(ref, no_ctx, change)}
    for a in arms.values():
        n = a["n_tokens"]
        a.update(kl_mean=a["kl_sum"] / n, nll_mean=a["nll_sum"] / n, top1=a["top1_sum"] / n)
    return {arm: arms[arm] for arm in ARMS if arm in arms}


# --------------------------------------------------------------------------- summaries
def summarize_arm(rows: Sequence[dict], arm: str) -> dict:
    """The arm's metrics over conversations (rows as written by the benchmark stage)."""
    items = [r["arms"][arm] for r in rows]
    ref = [r["arms"]["native_target"] for r in rows]
    tokens = sum(a["n_tokens"] for a in items)
    nll = sum(a["nll_sum"] for a in items) / tokens
    ref_nll = sum(a["nll_sum"] for a in ref) / tokens
    return {
        "kl_token_mean": sum(a["kl_sum"] for a in items) / tokens,  # token-weighted
        "kl_conversation": mean_se([a["kl_mean"] for a in items]),  # per-conversation mean ± SE
        "perplexity": math.exp(nll),
        "nll_token_mean": nll,
        "nll_delta_vs_native_target": nll - ref_nll,  # token-weighted; > 0 means worse than the reference
        "nll_delta_conversation": mean_se([a["nll_mean"] - b["nll_mean"] for a, b in zip(items, ref)]),
        "top1_agreement": sum(a["top1_sum"] for a in items) / tokens,
        "n_conversations": len(items),
        "n_tokens": tokens,
        **ctx.summarize(items),  # KL and top-1 on the tokens the context decides; attention-output agreement
    }


PAIRED = (
    ("distilled", "native_target"),
    ("closed_form", "native_target"),
    ("distilled", "control"),
    ("closed_form", "control"),
)


def paired_tests(rows: Sequence[dict]) -> dict[str, dict]:
    """Paired t-tests over conversations on per-conversation mean reply NLL (a − b).

    Only pairs whose arms were both scored appear.
    """
    out = {}
    for a, b in PAIRED:
        if rows and a in rows[0]["arms"] and b in rows[0]["arms"]:
            test = paired_t([r["arms"][a]["nll_mean"] for r in rows], [r["arms"][b]["nll_mean"] for r in rows])
            out[f"{a}_vs_{b}"] = {"metric": "nll_mean_per_conversation", **test}
    return out


def summarize(rows: Sequence[dict]) -> dict:
    """{"arms": {arm: metrics}, "paired": {...}} for every arm present in all rows."""
    arms = [a for a in ARMS if rows and all(a in r["arms"] for r in rows)]
    return {"arms": {a: summarize_arm(rows, a) for a in arms}, "paired": paired_tests(rows)}
