"""Before a run: peak memory per rank and time per update of distillation, estimated from shapes alone.

Inputs are the two model configs (parameter counts, layers, heads, head_dim, vocabulary), the
translator (its parameters and FLOPs per token), the profile's caps, the batch, the dtype and the
number of ranks N. Nothing is loaded or measured. One conversation at the caps is the worst case:
the handed-over context is C = prefix_cap - 1 tokens (the cache holds prefix[:-1]) and the target
runs n = reply_cap new tokens on it (`cache.handoff_split`).

Memory on one rank (a distillation update accumulates conversation by conversation, so its peak
is one conversation's, whatever the batch and N):
  weights          both models' parameters in the run dtype
  translator       FP32 parameters, gradients and AdamW's two moments: 4 copies
  native logits    the native target's [n, vocab] logits, kept until the KL
  source capture   the source's K and V of the context (and its pre-norm keys in prenorm space)
  translation      what autograd keeps of the FP32 translation (its K and V input features, the key
                   norm's FP32 input) and the translated K, V in the run dtype
  target graph     the target's cache grown by the new tokens (K, V of C + n) and what its layers keep
                   for the backward over the n new tokens: FP32 RMSNorm inputs (two per layer, plus
                   q/k norms), the MLP's gate, activation and up projections, the attention's queries
                   and output (frozen weights keep no input for a weight gradient)
  logits and KL    the peak of the KL: both arms' FP32 log-softmaxes, exp(log p), the difference and
                   the judged arm's logits and FP32 copy; or, if larger, the backward's gradient of
                   the grown cache (run dtype) and of the FP32 translation
plus `RESERVE` (CUDA context, cuBLAS workspace, NCCL buffers) and `FRAGMENTATION` on the tensors.
On a CPU the N ranks share the host's memory, so N × the per-rank peak must fit.

Time per update: the FLOPs of one conversation (the native target's forward over C + n; the
source's prefill of C; the target's forward and backward over n on the translated cache, the
backward taking input gradients only; the translation's forward and backward) times the busiest
rank's conversations, ceil(batch / N), over an assumed sustained throughput (`DEVICES`: a fraction
`MFU` of the dense peak), plus `PASS_OVERHEAD_S` per model pass for eager kernel launches, plus
one gradient all-reduce. Attention FLOPs are causal: 4·head_dim·q_heads·layers·(q·start + q²/2).
"""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass, field
from typing import Any

from ..errors import RunRefused
from ..inputs.argtypes import number

GIB = 1024**3
RESERVE = {"cuda": 1.0 * GIB, "mps": 1.0 * GIB, "cpu": 1.0 * GIB}  # runtime outside the tensors, per process
FRAGMENTATION = 1.10  # allocator slack on the tensors' total
MFU = 0.35  # sustained share of a GPU's dense peak: eager transformers, batch one, long sequences
PASS_OVERHEAD_S = {"cuda": 0.03, "mps": 0.05, "cpu": 0.0}  # per forward or backward of a model (eager launches)
PASSES_PER_CONVERSATION = 4  # native forward, source prefill, target forward and backward on the translated cache
ALLREDUCE_GBPS = 100.0  # assumed ring all-reduce bandwidth between GPUs of one node (NVLink-class), GB/s

# Dense peak TFLOP/s (bf16/fp16 tensor cores, fp32 without TF32 as torch's default) and memory in GiB. A planned
# GPU (--gpu) is named whole, in any case (`planned_gpu`); the name a CUDA device reports holds one (`detected_card`).
DEVICES: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.0, "fp32": 67.0, "memory_gib": 140.0},
    "H100": {"bf16": 989.0, "fp32": 67.0, "memory_gib": 79.6},
    "A100": {"bf16": 312.0, "fp32": 19.5, "memory_gib": 79.2},
    "L40S": {"bf16": 362.0, "fp32": 91.6, "memory_gib": 44.4},
    "A10": {"bf16": 125.0, "fp32": 31.2, "memory_gib": 22.1},
    "4090": {"bf16": 165.0, "fp32": 82.6, "memory_gib": 23.6},
}
# Sustained TFLOP/s assumed where no table entry applies: a CPU (measured ~0.18 FP32 / 0.40 BF16
# on a 2-core AVX-512 host), Apple GPUs, and unnamed CUDA devices.
FALLBACK_TFLOPS = {
    "cpu": {"bf16": 0.40, "fp32": 0.18},
    "mps": {"bf16": 10.0, "fp32": 5.0},
    "cuda": {"bf16": 100.0 * MFU, "fp32": 15.0 * MFU},
}


class DoesNotFit(RunRefused):
    """A run whose estimated peak memory exceeds the device's (refused before any work)."""


# --------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class Shape:
    """What the estimate reads of a model config."""

    layers: int
    hidden: int
    intermediate: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def of(cls, cfg: Any) -> Shape:
        """From a transformers config or a dict of its fields."""
        get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
        head_dim = get("head_dim") or get("hidden_size") // get("num_attention_heads")
        return cls(
            get("num_hidden_layers"),
            get("hidden_size"),
            get("intermediate_size"),
            get("num_attention_heads"),
            get("num_key_value_heads"),
            head_dim,
            get("vocab_size"),
            bool(get("tie_word_embeddings", False)),
        )

    @property
    def layer_matmul_params(self) -> int:
        h, d = self.hidden, self.head_dim
        return h * self.q_heads * d * 2 + h * self.kv_heads * d * 2 + 3 * h * self.intermediate

    @property
    def n_params(self) -> int:
        h = self.hidden
        per_layer = self.layer_matmul_params + 2 * self.head_dim + 2 * h
        return self.vocab * h * (1 if self.tied else 2) + self.layers * per_layer + h

    def dense_flops(self, tokens: int) -> float:
        """Forward matmul FLOPs of the decoder layers over `tokens` (no LM head)."""
        return 2.0 * self.layers * self.layer_matmul_params * tokens

    def head_flops(self, tokens: int) -> float:
        return 2.0 * self.hidden * self.vocab * tokens

    def attention_flops(self, queries: int, start: int) -> float:
        """Causal attention of `queries` tokens at positions start.. over everything before them."""
        return 4.0 * self.head_dim * self.q_heads * self.layers * (queries * start + queries * (queries + 1) / 2)

    def cache_elements(self, tokens: int) -> int:
        """Elements of one of K or V for `tokens` tokens, all layers."""
        return self.layers * self.kv_heads * tokens * self.head_dim

    def saved_per_token(self, b: int) -> int:
        """Bytes per token and layer kept for the backward (see the module docstring)."""
        h, d = self.hidden, self.head_dim
        return 2 * 4 * h + 4 * (self.q_heads + self.kv_heads) * d + 3 * self.intermediate * b + 2 * self.q_heads * d * b


# --------------------------------------------------------------------------- the device
@dataclass(frozen=True)
class Device:
    kind: str  # cuda, mps or cpu
    name: str  # what the device calls itself
    memory_bytes: float  # memory one rank may use (a GPU's; a CPU's is shared by the ranks)
    tflops: float  # assumed sustained TFLOP/s in the run dtype
    basis: str  # where the throughput figure comes from, for the printout


def planned_gpu(name: str, needed: bool = True) -> str | None:
    """The table's name for a GPU named by the user (--gpu): the whole name, in any case, or refused naming the
    nearest, so that a typo never plans with another card's figures. An unknown name passes (None) only where the
    table would supply nothing (`needed` False: memory and throughput both given), as a label."""
    key = {k.lower(): k for k in DEVICES}.get(name.strip().lower())
    if key is not None or not needed:
        return key
    near = difflib.get_close_matches(name.strip().upper(), list(DEVICES), n=1, cutoff=0.6)
    raise RunRefused(
        f"--gpu {name!r} is not a GPU the estimate knows"
        + (f" (did you mean {near[0]}?)" if near else "")
        + f": name one of {', '.join(DEVICES)} (any case), or, for another GPU or memory size, "
        "pass --memory-limit-gib and --assume-tflops"
    )


def detected_card(name: str) -> dict[str, float] | None:
    """The table's card for the name a CUDA device reports ("NVIDIA H100 80GB HBM3"): the first listed name in it
    (A100 is listed before A10); None for an unlisted device, whose throughput is then assumed."""
    return next((v for k, v in DEVICES.items() if k in name), None)


def describe_device(
    kind: str,
    dtype_bytes: int,
    local_rank: int = 0,
    memory_gib: float | None = None,
    tflops: float | None = None,
    name: str | None = None,
) -> Device:
    """The device a run will use, its memory and an assumed throughput; `memory_gib`, `tflops` and
    `name` override what is read or assumed (a planned device, or a share of a busy one)."""
    precision = "fp32" if dtype_bytes == 4 else "bf16"
    memory = None
    name = name or None  # an empty --gpu: this machine's device
    planned = name is not None
    if kind == "cuda" and name is None:
        import torch

        props = torch.cuda.get_device_properties(local_rank)
        name, memory = props.name, float(props.total_memory)
    elif kind == "mps" and name is None:
        import torch

        name, memory = "Apple GPU (MPS)", float(torch.mps.recommended_max_memory())
    elif kind == "cpu" and name is None:
        name, memory = "CPU", float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    name = name or kind
    entry = None
    if kind == "cuda" and planned:
        name = planned_gpu(name, memory_gib is None or tflops is None) or name
        entry = DEVICES.get(name)
    elif kind == "cuda":
        entry = detected_card(name)
    if memory_gib is not None:
        memory = memory_gib * GIB
    elif memory is None:
        if entry is None:
            raise RunRefused(
                f"no memory figure for a planned {name!r}: name one of {', '.join(DEVICES)}, "
                "or pass --memory-limit-gib (and --assume-tflops)"
            )
        memory = entry["memory_gib"] * GIB
    if tflops is not None:
        rate, basis = tflops, "given (--assume-tflops)"
    elif entry is not None:
        rate, basis = entry[precision] * MFU, f"{MFU:.0%} of the {entry[precision]:g} TFLOP/s dense {precision} peak"
    else:
        rate = FALLBACK_TFLOPS[kind][precision]
        basis = f"assumed for an unlisted {kind} device ({precision}); set --assume-tflops"
    return Device(kind, name, memory, rate, basis)


# --------------------------------------------------------------------------- the estimate
@dataclass
class Estimate:
    memory: dict[str, float]  # bytes per rank by component (the breakdown printed)
    peak_bytes: float  # per rank, with reserve and fragmentation
    host_bytes: float  # what the device's memory must hold: the peak, × N ranks when they share a CPU host
    flops_per_conversation: float
    conversations_per_rank: int
    seconds_per_update: float
    seconds_per_validation_conversation: float  # forward only, one conversation at the caps
    device: Device
    assumptions: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.host_bytes <= self.device.memory_bytes


def estimate(
    source: Shape,
    target: Shape,
    translator_params: int,
    translator_flops_per_token: float,
    *,
    prefix_cap: int,
    reply_cap: int,
    batch: int,
    dtype_bytes: int,
    prenorm: bool,
    nproc: int,
    device: Device,
) -> Estimate:
    b, C, n = dtype_bytes, prefix_cap - 1, reply_cap
    kv_s, kv_t, kv_grown = source.cache_elements(C), target.cache_elements(C), target.cache_elements(C + n)
    logits = n * target.vocab
    memory = {
        "weights": (source.n_params + target.n_params) * b,
        "translator + AdamW": translator_params * 4 * 4,
        "native logits": logits * b,
        "source capture": (2 + prenorm) * kv_s * b,
        "translation": 2 * kv_s * 4 + kv_t * 4 + 2 * kv_t * b,
        "target graph": 2 * kv_grown * b + n * target.layers * target.saved_per_token(b),
        "logits and KL (or backward)": max(logits * (5 * 4 + b), 2 * kv_grown * b + 2 * kv_t * 4),
    }
    tensors = sum(memory.values())
    peak = tensors * FRAGMENTATION + RESERVE[device.kind]
    host = peak * nproc if device.kind == "cpu" else peak
    forward = (
        target.dense_flops(C + n)
        + target.head_flops(n)
        + target.attention_flops(C + n, 0)  # native arm
        + source.dense_flops(C)
        + source.head_flops(1)
        + source.attention_flops(C, 0)  # source prefill
        + translator_flops_per_token * C  # translation
        + target.dense_flops(n)
        + target.head_flops(n)
        + target.attention_flops(n, C)
    )  # target on it
    backward = (
        2 * translator_flops_per_token * C
        + target.dense_flops(n)
        + target.head_flops(n)
        + 2.5 * target.attention_flops(n, C)
    )
    flops = forward + backward
    rate, overhead = device.tflops * 1e12, PASS_OVERHEAD_S[device.kind]
    per_rank = math.ceil(batch / nproc)
    allreduce = 0.0 if nproc == 1 else 2 * translator_params * 4 / (ALLREDUCE_GBPS * 1e9)
    seconds = per_rank * (flops / rate + PASSES_PER_CONVERSATION * overhead) + allreduce
    validation = forward / rate + (PASSES_PER_CONVERSATION - 1) * overhead
    assumptions = [
        f"one conversation at the caps: context {C:,} + new {n:,} tokens (prefix cap {prefix_cap:,}, "
        f"reply cap {reply_cap:,})",
        f"throughput {device.tflops:.3g} TFLOP/s sustained: {device.basis}",
        f"+{PASS_OVERHEAD_S[device.kind] * 1000:.0f} ms per model pass ({PASSES_PER_CONVERSATION} per conversation), "
        f"+{RESERVE[device.kind] / GIB:.1f} GiB runtime reserve, ×{FRAGMENTATION:.2f} allocator slack",
    ]
    return Estimate(memory, peak, host, flops, per_rank, seconds, validation, device, assumptions)


def fmt_bytes(x: float) -> str:
    return f"{x / GIB:.1f} GiB"


def report_lines(est: Estimate, nproc: int, batch: int, updates: int, validations: int, n_validation: int) -> list[str]:
    """The printout: peak, time per update, the whole distillation (`validations` passes over
    `n_validation` conversations included), the memory breakdown and the assumptions."""
    dev = est.device
    share = f"{nproc} ranks sharing " if dev.kind == "cpu" and nproc > 1 else "on "
    val_s = validations * math.ceil(n_validation / nproc) * est.seconds_per_validation_conversation
    total_h = (est.seconds_per_update * updates + val_s) / 3600
    lines = [
        f"estimate: peak {fmt_bytes(est.peak_bytes)} per rank ({share}{dev.name}, {fmt_bytes(dev.memory_bytes)}); "
        f"{est.seconds_per_update:.3g} s per update ({est.conversations_per_rank} of {batch} conversations on the "
        f"busiest of {nproc} rank(s), {est.flops_per_conversation / 1e12:.3g} TFLOP each); "
        f"{updates:,} updates + {validations} validations of {n_validation} ≈ {total_h:.3g} h",
        "  memory: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in est.memory.items()),
    ]
    return lines + [f"  assumes {a}" for a in est.assumptions]


def refusal(est: Estimate, fits_with: list[str], dtype_bytes: int) -> str:
    """The one-line refusal of a run that does not fit, with what to change."""
    dev = est.device
    need = f"{fmt_bytes(est.host_bytes)}" + (
        " (all ranks on one host)" if dev.kind == "cpu" and est.host_bytes != est.peak_bytes else ""
    )
    fixes = []
    if dtype_bytes == 4:
        fixes.append("--dtype bfloat16 (halves weights, caches and activations)")
    fixes.append(f"a device with at least {fmt_bytes(est.host_bytes)}")
    if fits_with:
        fixes.append("a profile with shorter caps that fits: " + ", ".join(fits_with))
    fixes.append("--memory-limit-gib to plan against another figure, or --no-memory-check to try anyway")
    return f"estimated peak {need} exceeds the {fmt_bytes(dev.memory_bytes)} of {dev.name}; use " + "; or ".join(fixes)


def add_estimate_args(parser) -> None:
    parser.add_argument(
        "--memory-limit-gib",
        type=number(above=0),
        default=None,
        help="memory per rank to plan against (default: the device's own)",
    )
    parser.add_argument(
        "--assume-tflops",
        type=number(above=0),
        default=None,
        help="sustained TFLOP/s for the time estimate (default: a share of the device's dense peak)",
    )
    parser.add_argument(
        "--no-memory-check", action="store_true", help="run even when the estimated peak memory exceeds the device's"
    )


# --------------------------------------------------------------------------- before a run
def shapes_of(pair_cfg) -> tuple[Shape, Shape]:
    """(source, target) shapes of a resolved pair, from its configs (no weights)."""
    from ..inputs.models import load_config

    return tuple(Shape.of(load_config(spec)) for spec in pair_cfg.specs())


def check_run(
    source: Shape,
    target: Shape,
    translator,
    *,
    profile,
    batch: int,
    updates: int,
    val_every: int,
    n_validation: int,
    dtype_bytes: int,
    device_kind: str,
    nproc: int,
    local_rank: int = 0,
    memory_limit_gib: float | None = None,
    assume_tflops: float | None = None,
    device_name: str | None = None,
    memory_check: bool = True,
    say=print,
) -> Estimate:
    """Print the estimate for `profile`'s caps; raise DoesNotFit (naming what to change) when it cannot fit."""
    from ..inputs.profiles import PROFILES

    device = describe_device(device_kind, dtype_bytes, local_rank, memory_limit_gib, assume_tflops, device_name)

    def at(prefix_cap: int, reply_cap: int) -> Estimate:
        return estimate(
            source,
            target,
            translator.n_params(),
            translator.flops_per_token(),
            prefix_cap=prefix_cap,
            reply_cap=reply_cap,
            batch=batch,
            dtype_bytes=dtype_bytes,
            prenorm=translator.needs_prenorm,
            nproc=nproc,
            device=device,
        )

    est = at(profile.prefix_cap, profile.reply_cap)
    validations = 1 + updates // val_every + (updates % val_every != 0)  # before the first update, then every val_every
    for line in report_lines(est, nproc, batch, updates, validations, n_validation):
        say(line)
    if memory_check and not est.fits:
        smaller = [p for p in PROFILES.values() if p.prefix_cap < profile.prefix_cap]
        fits_with = [
            f"{p.name} (prefix cap {p.prefix_cap:,})"
            for p in sorted(smaller, key=lambda p: -p.prefix_cap)
            if at(p.prefix_cap, p.reply_cap).fits
        ]
        raise DoesNotFit(refusal(est, fits_with[:2], dtype_bytes))
    return est


def before_training(pair_cfg, translator, cfg, profile, world, args, say=print) -> Estimate | None:
    """train_translator's check before weights load: the ranks against the batch, then the printed
    estimate of distillation at the profile's caps, refused when it cannot fit (None: nothing to
    distil). `args` holds the flags of `add_estimate_args`."""
    from ..inputs.models import resolve_dtype
    from .distributed import WorldRefused

    distils = cfg.updates > 0 and not args.closed_form_only
    if distils and world.size > cfg.batch:
        raise WorldRefused(
            f"{world.size} ranks but {cfg.batch} conversations per update: ranks would idle; "
            f"use at most {cfg.batch} processes (NPROC / --nproc-per-node)"
        )
    if not distils:
        return None
    return check_run(
        *shapes_of(pair_cfg),
        translator,
        profile=profile,
        batch=cfg.batch,
        updates=cfg.updates,
        val_every=cfg.val_every,
        n_validation=profile.n_validation,
        dtype_bytes=resolve_dtype(pair_cfg.dtype).itemsize,
        device_kind=pair_cfg.device.split(":")[0],
        nproc=world.size,
        local_rank=world.local_rank,
        memory_limit_gib=args.memory_limit_gib,
        assume_tflops=args.assume_tflops,
        memory_check=not args.no_memory_check,
        say=say,
    )
