"""The source/target pair: naming, resolving and checking it before any weights load, then loading it.

A model is named by a Hub id plus a pinned commit revision, or by a local folder saved
with `save_pretrained`. A Hub id without a pinned commit (no `id@sha`, not in
`PINNED_REVISIONS`) has its branch resolved to a commit at run time; that commit is what loads,
what every manifest records, and a warning says how to pin it. `resolve_pair` reads only the two configs and
tokenizers, refuses a
pair no translator can join (`check_pair`: each refusal names the field, both values and
the fix), and returns a `PairConfig` of resolved values (device, dtype, model identities,
tokenizer digest) that every stage config nests and every resume key includes.
`load_pair` then loads the weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..core.arch import MODEL_TYPES
from ..core.rope import schedule_refusal
from ..core.settings import DIRECTIONS  # noqa: F401  (re-exported)
from ..errors import Refusal

# Pinned Hub revisions (commit shas). Beyond the default pair, each is the snapshot folder
# (models--ORG--NAME/snapshots/<sha>) that several independent public projects load the model from.
LARGE_ID = "Qwen/Qwen3-1.7B"
SMALL_ID = "Qwen/Qwen3-0.6B"
PINNED_REVISIONS = {
    LARGE_ID: "70d244cc86ccca08cf5af4e1e306ecf908b1ad5e",
    SMALL_ID: "c1899de289a04d12100db370d81485cdf75e47ca",
    "Qwen/Qwen3-4B": "1cfa9a7208912126459214e8b04321603b3df60c",
    "Qwen/Qwen3-8B": "b968826d9c46dd6066d109eabc6255188de91218",
    "meta-llama/Llama-3.2-1B": "4e20de362430cd3b72f300e6b0f18e50e7166e08",
    "meta-llama/Llama-3.2-3B": "13afe5124825b4f3751f836b40dafda64c1ed062",
    "meta-llama/Llama-3.2-1B-Instruct": "9213176726f574b556790deb65791e0c5aa438b6",
    "meta-llama/Llama-3.2-3B-Instruct": "0cb88a4f764b7a12671c53f0838cd831a0843b95",
}
COMMIT = re.compile(r"[0-9a-f]{40}")


class PairError(Refusal, ValueError):
    """A source/target pair (or an input) the adapter cannot serve."""


@dataclass(frozen=True)
class ModelSpec:
    name_or_path: str  # Hub id or local folder
    revision: str | None = None  # commit sha for Hub ids; None for local folders

    @property
    def is_local(self) -> bool:
        return Path(self.name_or_path).exists()

    @classmethod
    def parse(cls, text: str, revision: str | None = None) -> ModelSpec:
        """`id`, `id@revision` or a local path. Known Hub ids get their pinned revision."""
        if Path(text).exists():
            return cls(str(Path(text)), None)
        if text.startswith(("/", ".", "~")) or text.count("/") > 1:  # a path, never a Hub id (owner/name)
            raise PairError(
                f"no model folder at {text}: give a folder saved with save_pretrained, or a Hub id "
                "such as Qwen/Qwen3-0.6B"
            )
        name, _, rev = text.partition("@")
        return cls(name, revision or rev or PINNED_REVISIONS.get(name, "main"))

    def identity(self) -> dict[str, Any]:
        """What a resume compares: id + revision for the Hub, a weights digest for folders."""
        if self.is_local:
            return {
                "path": str(Path(self.name_or_path).resolve()),
                "weights_sha256": local_weights_digest(self.name_or_path),
            }
        return {"id": self.name_or_path, "revision": self.revision}

    @property
    def pinned(self) -> bool:
        return self.is_local or bool(COMMIT.fullmatch(self.revision or ""))


def pin_revision(spec: ModelSpec) -> ModelSpec:
    """A Hub spec whose revision is a branch or tag, resolved to the commit it points to now (from the Hub,
    or the local cache when offline), with a warning on stderr to pin it. Pinned specs come back as they are;
    one that cannot be resolved keeps its revision, with a warning that the run is not reproducible."""
    if spec.pinned:
        return spec
    if hub_offline() and not in_hub_cache(spec):
        raise not_found(spec)
    from transformers.utils.hub import resolve_revision

    sha = getattr(resolve_revision(spec.name_or_path, spec.revision), "resolved", None)
    if not sha:
        print(
            f"warning: {spec.name_or_path} has no pinned revision and {spec.revision!r} could not be resolved to "
            f"a commit; this run records the branch name only. Pin it: {spec.name_or_path}@<commit sha>",
            file=sys.stderr,
        )
        return spec
    print(
        f"warning: {spec.name_or_path} has no pinned revision; {spec.revision!r} resolved to {sha} at run time "
        f"(recorded in every manifest). Pin it: pass {spec.name_or_path}@{sha}, or add it to PINNED_REVISIONS "
        "in kvlingo/inputs/models.py",
        file=sys.stderr,
    )
    return replace(spec, revision=sha)


def pair_specs(direction: str, large: ModelSpec, small: ModelSpec) -> tuple[ModelSpec, ModelSpec]:
    """(source, target) for a direction."""
    if direction not in DIRECTIONS:
        raise PairError(
            f"direction {direction!r} is not one of {DIRECTIONS}: l2s (the large model builds the cache, the small "
            "one continues) or s2l (the reverse)"
        )
    return (large, small) if direction == "l2s" else (small, large)


def local_weights_digest(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    files = sorted(p for p in Path(path).iterdir() if p.suffix in {".safetensors", ".bin"} or p.name == "config.json")
    if not files:
        raise PairError(f"{path} holds no weights (*.safetensors); save the model there with save_pretrained")
    for p in files:
        h.update(p.name.encode())
        with open(p, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
    return h.hexdigest()


def checkpoint_files(identity: dict[str, Any]) -> list[Path]:
    """The *.safetensors files of a model as a run's identity records it: a local folder's, or the local Hub
    cache's snapshot of id@revision. PairError when there are none."""
    if "path" in identity:
        files = sorted(Path(identity["path"]).glob("*.safetensors"))
    else:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(identity["id"], "config.json", revision=identity.get("revision"))
        files = sorted(Path(found).parent.glob("*.safetensors")) if isinstance(found, str) else []
    if not files:
        raise PairError(f"no *.safetensors for {identity.get('path') or identity.get('id')} on this machine")
    return files


def tensor_digests(files: Sequence[Path], select) -> dict[str, str]:
    """{name: sha256} of the tensors `select(names)` picks from safetensors `files`, each hashed over its dtype,
    shape and bytes as stored (so a loader in another dtype still compares like with like)."""
    return {name: tensor_digest(t) for name, t in read_tensors(files, select).items()}


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes as stored (what `tensor_digests` records per tensor)."""
    t = t.contiguous()
    h = hashlib.sha256(f"{t.dtype}:{tuple(t.shape)}:".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def tensor_names(files: Sequence[Path]) -> list[str]:
    """The tensor names safetensors `files` hold (their headers only)."""
    from safetensors import safe_open

    names: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    return sorted(names)


def read_tensors(files: Sequence[Path], select) -> dict[str, torch.Tensor]:
    """{name: tensor as stored} of the tensors `select(names)` picks from safetensors `files` (the others are
    never read: a safetensors header lists the names, and each tensor is read on its own)."""
    from safetensors import safe_open

    out = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in select(list(f.keys())):
                out[name] = f.get_tensor(name)
    return dict(sorted(out.items()))


# --------------------------------------------------------------------------- device and dtype
@dataclass(frozen=True)
class Naming:
    """How a refusal names the input it refuses and the values to give instead, as the caller's user writes
    them: make variables on the command line (`COMMAND_LINE`: DEVICE=cpux; use cpu or auto) or keyword
    arguments in Python (`PYTHON_API`, kvlingo.Relay: device='cpux'; use 'cpu' or 'auto'). One check, two
    wordings: the caller passes its naming down."""

    setting: str  # an input set to a value, formatted from {NAME} (upper case), {name} and {value}
    value: str  # a value on its own, formatted from {value}

    def given(self, name: str, value: Any) -> str:
        return self.setting.format(NAME=name.upper(), name=name, value=value)

    def shown(self, value: Any) -> str:
        return self.value.format(value=value)

    def choices(self, *values: Any) -> str:
        """'a, b or c' as this naming writes each value."""
        words = [self.shown(v) for v in values]
        return ", ".join(words[:-1]) + " or " + words[-1]


COMMAND_LINE = Naming(setting="{NAME}={value}", value="{value}")
PYTHON_API = Naming(setting="{name}={value!r}", value="{value!r}")


def resolve_device(device: str | None = None, naming: Naming = COMMAND_LINE) -> str:
    """'auto' (or None/'') picks cuda, then mps, then cpu."""
    if device and device != "auto":
        if not (device in ("cpu", "cuda", "mps") or (device.startswith("cuda:") and device[5:].isdigit())):
            raise PairError(
                f"{naming.given('device', device)} is not a device this suite runs on; use "
                f"{naming.shown('cuda')} (or {naming.shown('cuda:N')}), {naming.choices('mps', 'cpu', 'auto')}"
            )
        instead = f"use {naming.given('device', 'cpu')} or {naming.given('device', 'auto')}"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise PairError(f"{naming.given('device', device)} but torch sees no CUDA device; {instead}")
        if device == "mps" and not torch.backends.mps.is_available():
            raise PairError(f"{naming.given('device', device)} but MPS is not available; {instead}")
        return device
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype, naming: Naming = COMMAND_LINE) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise PairError(
            f"{naming.given('dtype', dtype)} is not supported; use one of "
            + ", ".join(naming.shown(d) for d in ("bfloat16", "float32", "float16"))
        )
    return DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------- loading
def hub_offline() -> bool:
    """Whether the environment switches Hugging Face Hub access off (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)."""
    on = {"1", "true", "yes", "on"}
    return any(os.environ.get(v, "").strip().lower() in on for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _hub_hint(spec: ModelSpec, err: Exception) -> PairError:
    if spec.is_local:  # nothing to download: the folder itself is incomplete or damaged
        first = (str(err).strip().splitlines() or [""])[0]
        return PairError(
            f"could not load the model folder {spec.name_or_path}: {type(err).__name__}: {first}\n"
            "A model folder holds config.json, the tokenizer files and *.safetensors, as "
            "save_pretrained writes them; save or copy the model there again."
        )
    return not_found(spec, err)


def not_found(spec: ModelSpec, err: Exception | None = None) -> PairError:
    """One line for a Hub id that did not load: there is no such folder, the Hub cache lacks it, the Hub is off
    (or what it said), and the command that downloads it."""
    why = "HF_HUB_OFFLINE=1, so the Hub is not reached" if hub_offline() else None
    if why is None and err is not None:
        why = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"
    return PairError(
        f"no model folder {spec.name_or_path} here, and as a Hub id it is not in the local cache"
        + (f" ({why})" if why else "")
        + f": pass a folder that exists, or download it once with network access "
        f"(hf download {spec.name_or_path} --revision {spec.revision})"
    )


def in_hub_cache(spec: ModelSpec) -> bool:
    """Whether the local Hub cache holds the model's config.json at its revision."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(spec.name_or_path, "config.json", revision=spec.revision), str)


def load_tokenizer(spec: ModelSpec):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(spec.name_or_path, revision=spec.revision)
    except (OSError, ValueError) as err:
        raise _hub_hint(spec, err) from err


def load_model(spec: ModelSpec, device: str = "cpu", dtype: torch.dtype = torch.float32, attn: str = "sdpa"):
    """A frozen model in eval mode. Built outside inference_mode: CPU BF16 kernels are far slower inside it."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            spec.name_or_path, revision=spec.revision, dtype=dtype, attn_implementation=attn
        )
    except (OSError, ValueError, SafetensorError) as err:  # SafetensorError: a weights file cut short
        raise _hub_hint(spec, err) from err
    model.to(device).eval()
    model.requires_grad_(False)
    return model


def weights_fingerprint(model) -> str:
    """sha256 over every parameter's bytes: proves the frozen models were not touched."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------- the pair check
def tokenizer_digest(tok) -> str:
    """sha256 over vocabulary, merges and special/added tokens (not the chat template text)."""
    state = json.loads(tok.backend_tokenizer.to_str())
    model = state.get("model", {})
    payload = {
        "type": model.get("type"),
        "vocab": sorted(model.get("vocab", {}).items(), key=lambda kv: kv[1]),
        "merges": model.get("merges", []),
        "added": sorted((t["id"], t["content"], t.get("special", False)) for t in state.get("added_tokens", [])),
        "special_ids": sorted(set(tok.all_special_ids)),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def tokenizer_difference(a, b) -> str:
    """What differs between two tokenizers, in words: vocabulary size, the first differing ids, added tokens."""
    sa, sb = json.loads(a.backend_tokenizer.to_str()), json.loads(b.backend_tokenizer.to_str())
    va, vb = sa.get("model", {}).get("vocab", {}), sb.get("model", {}).get("vocab", {})
    added_a = {(t["id"], t["content"]) for t in sa.get("added_tokens", [])}
    added_b = {(t["id"], t["content"]) for t in sb.get("added_tokens", [])}
    parts = []
    if len(va) != len(vb) or len(added_a) != len(added_b):
        parts.append(f"vocabulary {len(va)}+{len(added_a)} added vs {len(vb)}+{len(added_b)} added")
    ids_a, ids_b = {i: t for t, i in va.items()}, {i: t for t, i in vb.items()}
    diff = sorted(i for i in set(ids_a) | set(ids_b) if ids_a.get(i) != ids_b.get(i))
    if diff:
        i = diff[0]
        parts.append(f"{len(diff)} ids map to other tokens, first id {i}: {ids_a.get(i)!r} vs {ids_b.get(i)!r}")
    only = sorted(added_a ^ added_b)
    if only:
        parts.append(f"added tokens differ, e.g. {only[0]}")
    if not parts and sa.get("model", {}).get("merges") != sb.get("model", {}).get("merges"):
        parts.append("same vocabulary, different merges")
    if not parts:
        parts.append("special token ids differ")
    return "; ".join(parts)


PROBE_CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Remember the code K7-42 and the name Ada."},
    {"role": "assistant", "content": "Noted: K7-42, Ada."},
    {"role": "user", "content": "What was the code?"},
]


def render_ids(tok, messages, enable_thinking: bool) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, enable_thinking=enable_thinking)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _refuse(field: str, src: Any, tgt: Any, fix: str) -> None:
    raise PairError(f"pair refused: {field} differs (source={src!r}, target={tgt!r}). {fix}")


def check_pair(src_cfg, tgt_cfg, src_tok=None, tgt_tok=None) -> None:
    """Refuse a pair no translator can join. Configs are model.config objects.

    Depths, KV-head counts and head_dim may differ: each translator family refuses the
    geometries it cannot map (head-wise maps need equal depth and KV-head counts), naming the
    family that would work.
    """
    for name, cfg in (("source", src_cfg), ("target", tgt_cfg)):
        if getattr(cfg, "model_type", None) not in MODEL_TYPES:
            raise PairError(
                f"pair refused: the {name} model is {getattr(cfg, 'model_type', None)!r}, not one of "
                f"{', '.join(map(repr, MODEL_TYPES))}. The adapter handles dense Qwen3, Qwen2/2.5 and Llama models "
                "(kvlingo/core/arch.py); pick a checkpoint of one of those families."
            )
        layer_types = getattr(cfg, "layer_types", None) or []
        if getattr(cfg, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
            raise PairError(
                f"pair refused: the {name} model uses non-full attention (use_sliding_window="
                f"{getattr(cfg, 'use_sliding_window', None)}, layer_types={sorted(set(layer_types))}). "
                "A sliding-window cache holds a different token set per layer; set use_sliding_window=false."
            )
        # transformers v5 folds any legacy `rope_scaling` into rope_parameters["rope_type"]
        refusal = schedule_refusal(getattr(cfg, "rope_parameters", None))
        if refusal:
            raise PairError(f"pair refused: the {name} model's {refusal}.")
    if src_tok is not None and tgt_tok is not None:
        a, b = tokenizer_digest(src_tok), tokenizer_digest(tgt_tok)
        if a != b:
            _refuse(
                f"tokenizer ({tokenizer_difference(src_tok, tgt_tok)})",
                a[:16],
                b[:16],
                "a cache is indexed by token ids, so both models must share one tokenizer.",
            )
        for thinking in (True, False):
            ra, rb = (
                render_ids(src_tok, PROBE_CONVERSATION, thinking),
                render_ids(tgt_tok, PROBE_CONVERSATION, thinking),
            )
            if ra != rb:
                first = next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), min(len(ra), len(rb)))
                _refuse(
                    f"chat template rendering (enable_thinking={thinking}, first differing token {first})",
                    ra[first : first + 8],
                    rb[first : first + 8],
                    "both chat templates must render identical token ids; use the same chat_template.",
                )


# --------------------------------------------------------------------------- the resolved pair
@dataclass(frozen=True)
class PairConfig:
    """A pair as every stage config records it: resolved values only, never "auto"."""

    large: str  # larger model: Hub id[@rev] as given, or a local folder as its absolute path (`as_named`)
    small: str  # smaller model, the same way
    direction: str  # l2s: large builds the cache, small continues; s2l the reverse
    device: str  # resolved device (cuda, mps or cpu)
    dtype: str  # model dtype name (bfloat16, float32, float16)
    source: dict  # identity of the source: {"id", "revision"} (Hub) or {"path", "weights_sha256"} (folder)
    target: dict  # identity of the target, the same way
    tokenizer_sha256: str  # tokenizer_digest of the shared tokenizer (vocab, merges, special ids)
    chat_template_sha256: str  # sha256 of the target tokenizer's chat template text
    geometry: dict  # cache shapes on both sides (kvlingo.core.translator.Geometry as a dict)
    cache: str = "preallocated"  # the KV cache every handoff builds: preallocated or dynamic (core.cache.CACHE_KINDS)

    def specs(self) -> tuple[ModelSpec, ModelSpec]:
        """(source, target) specs at the commits this pair resolved to (for Hub ids given without one)."""
        src, tgt = pair_specs(self.direction, ModelSpec.parse(self.large), ModelSpec.parse(self.small))
        return tuple(
            s if s.is_local else replace(s, revision=ident.get("revision", s.revision))
            for s, ident in ((src, self.source), (tgt, self.target))
        )

    def identities(self) -> dict[str, Any]:
        return {"source": self.source, "target": self.target}


def as_named(model: str) -> str:
    """A model argument as a setting records it: a local folder by its resolved absolute path (so the same folder
    named relatively or absolutely is one setting), a Hub id[@rev] as given."""
    return str(Path(model).resolve()) if Path(model).exists() else model


def load_config(spec: ModelSpec):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(spec.name_or_path, revision=spec.revision)
    except (OSError, ValueError) as err:
        raise _hub_hint(spec, err) from err


def resolve_pair(
    large: str,
    small: str,
    direction: str = "l2s",
    device: str = "auto",
    dtype: str = "bfloat16",
    cache: str = "preallocated",
    naming: Naming = COMMAND_LINE,
) -> tuple[PairConfig, Any]:
    """Check a pair from its configs and tokenizers alone (no weights), and resolve it.

    Returns (PairConfig, the target's tokenizer). Raises PairError before any weights load, naming a bad
    device or dtype as `naming` says the caller's user gives them.
    """
    src_spec, tgt_spec = pair_specs(direction, ModelSpec.parse(large), ModelSpec.parse(small))
    device, dt = resolve_device(device, naming), resolve_dtype(dtype, naming)
    src_spec, tgt_spec = pin_revision(src_spec), pin_revision(tgt_spec)
    src_tok, tgt_tok = load_tokenizer(src_spec), load_tokenizer(tgt_spec)
    src_cfg, tgt_cfg = load_config(src_spec), load_config(tgt_spec)
    check_pair(src_cfg, tgt_cfg, src_tok, tgt_tok)
    from dataclasses import asdict

    from ..core.translator import Geometry
    from ..io import sha256_json

    cfg = PairConfig(
        large=as_named(large),
        small=as_named(small),
        direction=direction,
        device=device,
        dtype=dtype_name(dt),
        source=src_spec.identity(),
        target=tgt_spec.identity(),
        tokenizer_sha256=tokenizer_digest(tgt_tok),
        chat_template_sha256=sha256_json(getattr(tgt_tok, "chat_template", None)),
        geometry=asdict(Geometry.of(src_cfg, tgt_cfg)),
        cache=cache,
    )
    return cfg, tgt_tok


@dataclass
class Pair:
    """A checked source/target pair, resident on one device."""

    source: Any
    target: Any
    tokenizer: Any  # the shared tokenizer (None for random-weight pairs)
    config: PairConfig

    @property
    def direction(self) -> str:
        return self.config.direction

    @property
    def device(self) -> str:
        return self.config.device

    @property
    def dtype(self) -> torch.dtype:
        return resolve_dtype(self.config.dtype)

    @property
    def cache(self) -> str:
        """The KV cache kind every handoff of this pair builds."""
        return self.config.cache

    @property
    def source_spec(self) -> ModelSpec:
        return self.config.specs()[0]

    @property
    def target_spec(self) -> ModelSpec:
        return self.config.specs()[1]

    def identities(self) -> dict[str, Any]:
        return self.config.identities()


def load_pair(cfg: PairConfig, tokenizer=None, attn: str = "sdpa") -> Pair:
    """Load both models' weights for a resolved (already checked) pair."""
    src_spec, tgt_spec = cfg.specs()
    dtype = resolve_dtype(cfg.dtype)
    source = load_model(src_spec, cfg.device, dtype, attn)
    target = load_model(tgt_spec, cfg.device, dtype, attn)
    return Pair(source, target, tokenizer if tokenizer is not None else load_tokenizer(tgt_spec), cfg)


def pair_config_from_args(args, refresh: Sequence[Any] = ()) -> tuple[PairConfig, Any]:
    """`resolve_pair` of the --large/--small/--direction/--device/--dtype (and --cache) flags. A stage's --refresh
    setting and any other `refresh` settings (the frontier's grid), each a `Refresh` as the flags parsed it or
    text from a file, are checked against the target's depth here, before any work."""
    from ..core.refresh import Refresh

    cfg, tok = resolve_pair(
        args.large, args.small, args.direction, args.device, args.dtype, getattr(args, "cache", "preallocated")
    )
    for setting in (getattr(args, "refresh", None), *refresh):
        if setting is not None:
            setting = setting if isinstance(setting, Refresh) else Refresh.parse(setting)
            setting.check_layers(cfg.geometry["target_layers"])
    return cfg, tok
