"""Distillation: the translator learns to make the frozen target behave as on its own cache.

Loss per conversation: mean over reply tokens of KL(native target || target on the
translated cache), in FP32 (`kl.token_kl`). The native arm reads the real prefix + reply[:-1]
in one pass; the translated arm reads the translated cache of prefix[:-1] and runs
prefix[-1:] + reply[:-1] itself (`cache.handoff_split`, `handoff.translate`). A batch loss is
the mean over its conversations (gradient accumulation: the adapter is batch-one).
Gradients reach the FP32 translator through the frozen target and through the cast to the
model dtype inside `Translator.forward`.

Auxiliary objective (`aux_weight` > 0): at every target layer, the attention block's output
over the scored positions (its o_proj output, hooked) with the native cache and with the
translated one; the loss adds aux_weight × the mean over layers of the relative squared error
|a_translated − a_native|² / |a_native|² (scale-free, so one weight fits every layer and pair).

Objectives aimed at the context-dependent tokens (`objectives.py`): `context_weight` weights each
reply token's KL by how much the context changes the native prediction; `onpolicy` scores a share
of the conversations on replies the target samples from the translated cache. A `refresh`
setting (kvlingo.core.refresh, e.g. exact:0) applies to the translated cache as at evaluation.

Validation KL: the same per-conversation mean KL (without the auxiliary term and the context
weights), averaged over the validation conversations.

Data parallel (`distributed.World`): a rank runs its share of the rows, still dividing each loss
by the global batch size, and the ranks' gradients are summed before the clip, so each update is
the single process's. Validation sums the ranks' KL sums.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext

import torch

from ..core.cache import handoff_split
from ..core.handoff import as_ids, attention_outputs, continue_target, device_of, translate
from ..core.kl import token_kl
from ..core.translator import Translator
from .distributed import SINGLE, World
from .objectives import context_change, context_weights, onpolicy_at, onpolicy_row
from .rng import preserved_rng


def distill_loss(
    source,
    target,
    translator: Translator,
    row: dict,
    dtype: torch.dtype,
    aux_weight: float = 0.0,
    refresh=None,
    context_weight: float = 0.0,
    kind: str = "preallocated",
) -> torch.Tensor:
    """Mean over reply tokens of KL(native target || target on the translated cache) (weighted by the context's
    change of each prediction when context_weight > 0), plus the weighted attention-output term when
    aux_weight > 0; FP32 scalar with grad."""
    context, new, _ = handoff_split(row["prefix_ids"], row["reply_ids"])
    native_attn, ours_attn = [], []
    with torch.no_grad(), attention_outputs(target, len(new), native_attn) if aux_weight else nullcontext():
        # The native arm reads the real prefix and the reply; its last len(new) positions predict the reply.
        native = target(
            input_ids=as_ids(context + new, device_of(target)), use_cache=False, logits_to_keep=len(new)
        ).logits[0]
    # [layers, kv_heads, context, head_dim] each, differentiable
    kv = translate(source, translator, context, dtype, refresh=refresh, target=target, kind=kind)
    with attention_outputs(target, len(new), ours_attn) if aux_weight else nullcontext():
        out = continue_target(target, kv, new, kind)
    kl = token_kl(native, out.logits[0])  # [new]
    if context_weight:
        kl = kl * context_weights(context_change(target, new, native), context_weight)
    loss = kl.mean()
    if aux_weight:
        rel = [
            (a - b).pow(2).sum() / b.pow(2).sum().clamp_min(1e-12)  # FP32 (attention_outputs)
            for a, b in zip(ours_attn, native_attn)
        ]
        loss = loss + aux_weight * torch.stack(rel).mean()
    return loss


def distill_step(
    source,
    target,
    translator: Translator,
    rows: list[dict],
    optimizer,
    dtype: torch.dtype,
    max_grad_norm: float = 0.0,
    world: World = SINGLE,
    aux_weight: float = 0.0,
    refresh=None,
    context_weight: float = 0.0,
    onpolicy: float = 0.0,
    first_index: int = 0,
    eos_ids: set[int] | None = None,
    kind: str = "preallocated",
) -> float:
    """One optimiser update over the batch `rows` (gradient accumulation); returns the batch's mean loss.

    `first_index`: the position of rows[0] in the data order (the on-policy schedule's index).
    With a distributed `world`, this rank runs its share of `rows` and the gradients are summed over the ranks."""
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    if onpolicy:
        rows = [
            onpolicy_row(source, target, translator, r, dtype, refresh, eos_ids=eos_ids, kind=kind)
            if onpolicy_at(first_index + i, onpolicy)
            else r
            for i, r in enumerate(rows)
        ]
    for row in world.share(rows):
        loss = distill_loss(source, target, translator, row, dtype, aux_weight, refresh, context_weight, kind) / len(
            rows
        )
        loss.backward()
        total += loss.item()
    world.sum_grads(translator)
    total = world.sum_float(total)
    if max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(translator.parameters(), max_grad_norm)
    optimizer.step()
    return total


def validation_kl(
    source,
    target,
    translator: Translator,
    rows: list[dict],
    dtype: torch.dtype,
    progress: Callable | None = None,
    world: World = SINGLE,
    refresh=None,
    kind: str = "preallocated",
) -> tuple[float, list[float]]:
    """(the mean over conversations of each one's mean reply-token KL, each conversation's part of it in row order
    gathered over the ranks): the parts give the figure's SE over conversations. Leaves every RNG as it found it."""
    mine = world.share(range(len(rows)))  # this rank's rows, by index
    parts = torch.zeros(len(rows), dtype=torch.float64)  # [conversations]: this rank's, zeros elsewhere
    with preserved_rng(), torch.no_grad():
        for i in progress(mine) if progress else mine:
            parts[i] = distill_loss(source, target, translator, rows[i], dtype, refresh=refresh, kind=kind).item()
    local = sum(parts[i].item() for i in mine)  # this rank's sum in row order, then the sum over ranks
    mean = world.sum_float(local) / len(rows)
    return mean, world.sum_(parts).tolist()


LR_SCHEDULES = ("constant", "linear", "cosine")


def lr_at(lr: float, schedule: str, update: int, updates: int) -> float:
    """The learning rate of update `update` (0-based) of `updates`: `lr` throughout (constant), or decayed toward 0
    over the run, linearly or on a half cosine, as torch's LinearLR(1 → 0) and CosineAnnealingLR(η_min 0) step it.
    A function of the update alone, so a resumed run sets each update's rate as the run it continues would have."""
    if schedule == "constant":
        return lr
    done = update / updates
    if schedule == "linear":
        return lr * (1.0 - done)
    if schedule == "cosine":
        return lr * 0.5 * (1.0 + math.cos(math.pi * done))
    raise ValueError(f"learning-rate schedule {schedule!r}: one of {', '.join(LR_SCHEDULES)}")


def make_optimizer(translator: Translator, lr: float, weight_decay: float) -> torch.optim.AdamW:
    return torch.optim.AdamW(translator.parameters(), lr=lr, weight_decay=weight_decay)
