"""The compatibility contract between an exported translator and a served model, and the translation it allows.

A serving engine loads a translator folder once (`Contract.load`) and asks, per source cache,
whether it may translate it (`Contract.admit`). Every "no" is a `Refused` with one line naming
the field, both values and the fix; the connector logs it and lets the engine prefill as usual
(fail closed: an unproven or mismatched translator never serves a token).

Checked at load, as `kvlingo.Relay.load` checks them, but without loading either model's weights:
1. the maps against their recorded sha256;
2. the evidence against the gate (`allow_unproven` waives it, e.g. for a timing-only run);
3. the served model's tokenizer against the recorded digest (a cache is indexed by token ids);
4. the served model against the recorded target (weights digest of a folder, or Hub id and
   revision) and its cache geometry against the translator's target side;
5. the refresh setting the evidence was measured with: `none`; `tail:W`, which the engine
   serves by prefilling the last W context tokens itself; or `exact:0`, the target's own layer 0
   computed here from the token ids. The others need the target's own partial forward, which a
   KV connector cannot run, and are refused naming the family and the refresh;
6. the target weights the handoff reads (the export's `reads.target_weights`: none for most
   maps; the embedding, the first norm and layer 0's K/V projections for maps that read the
   target's token features and for exact:0, with layer 0's key norm; every layer's key norm for
   `prenorm` maps): only those tensors are read from the served model's safetensors, each is
   checked against the sha256 the export recorded, and a mismatch is refused naming the tensor.
Checked per source cache (`admit`): its model against the recorded source, its geometry and
tokenizer digest, and that it holds what the key space reads. An engine's cache holds post-RoPE
keys only, which serve the `cache` key space; `prenorm` maps read the source's k_proj outputs
before k_norm, which a normed key cannot give back (each head's scale is lost), so they need the
source model run beside the engine (`SourceModel`).

Each handoff (`Contract.translate`) carries the token ids the source cache covers: maps that read
the target's token features and exact:0 compute them from those ids (kvlingo.serve.layer0). The
translator runs on RoPE tables and the checked target tensors (`model_stub`), so a serving process
holds no second copy of either model. The code here runs on the serving environment's transformers
as well as the suite's.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..core import arch
from ..core.cache import Capture
from ..core.families import FAMILIES
from ..core.fused import strip_keys
from ..core.keyspace import TARGET_WEIGHTS, KeySpace
from ..core.layer0 import NotContextFree
from ..core.refresh import Refresh, RefreshError
from ..core.rope import apply_rope_into
from ..core.translator import Geometry, Translator, TranslatorError
from ..errors import Refusal
from ..inputs.models import (
    ModelSpec,
    PairError,
    checkpoint_files,
    pair_specs,
    read_tensors,
    tensor_digest,
    tensor_names,
    tokenizer_digest,
)
from ..inputs.reads import target_weight_names
from ..records.saved import (
    CONFIG_FILE,
    Gate,
    Verdict,
    judge,
    load_state,
    model_arg,
    read_export,
    read_manifest,
    same_model,
)
from .layer0 import Layer0, parts_of


class Refused(Refusal):
    """A reason, in one line, to serve a request with an ordinary prefill instead of a translation."""


SERVED_REFRESH = ("none", "tail", "exact")  # what a connector can run beside the engine's own prefill


# --------------------------------------------------------------------------- what an engine serves
@dataclass(frozen=True)
class ServedModel:
    """A model as an engine serves it: what the contract compares against a translator's record."""

    name: str  # the engine's model argument: Hub id or local folder
    identity: dict  # {"path", "weights_sha256"} for a folder, {"id", "revision"} for the Hub
    geometry: tuple[int, int, int]  # (layers, kv_heads, head_dim) of its cache
    tokenizer_sha256: str  # kvlingo.inputs.models.tokenizer_digest of the tokenizer it serves with

    @classmethod
    def describe(
        cls,
        model: str,
        revision: str | None = None,
        tokenizer: str | None = None,
        tokenizer_revision: str | None = None,
        config=None,
    ) -> ServedModel:
        """From an engine's model and tokenizer arguments (a folder's weights are hashed once, here)."""
        from transformers import AutoConfig, AutoTokenizer

        spec = ModelSpec.parse(model, revision)
        cfg = config if config is not None else AutoConfig.from_pretrained(model, revision=revision)
        tok = AutoTokenizer.from_pretrained(tokenizer or model, revision=tokenizer_revision or revision)
        return cls(model, spec.identity(), geometry_of(cfg), tokenizer_digest(tok))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "geometry": list(self.geometry)}

    @property
    def argument(self) -> str:
        """The model as a model argument at the revision it was served at: its folder, or id@revision."""
        ident = self.identity
        return f"{ident['id']}@{ident['revision']}" if "id" in ident else self.name


def geometry_of(cfg) -> tuple[int, int, int]:
    g = Geometry.of(cfg, cfg)
    return g.source_layers, g.source_kv_heads, g.source_head_dim


def describe_identity(identity: dict[str, Any]) -> str:
    if "id" in identity:
        return f"{identity['id']} @ {identity.get('revision')}"
    return f"{Path(identity.get('path', '?')).name} (weights sha256 {str(identity.get('weights_sha256'))[:12]}…)"


# --------------------------------------------------------------------------- the contract
@dataclass
class Contract:
    """A translator folder accepted for one served target (build it with `Contract.load`)."""

    folder: Path
    config: dict[str, Any]  # the export's config.json
    verdict: Verdict  # the gate's verdict on its evidence
    translator: Translator  # bound to stubs of the pair (`model_stub`): RoPE tables and the checked target tensors
    refresh: Refresh  # none, tail:W or exact:0
    target: ServedModel
    source_name: str  # the recorded source model argument (folder or id@revision)
    source_config: Any  # its transformers config
    target_weights: tuple[str, ...] = ()  # the target tensors read and checked (checkpoint names)
    layer0: Layer0 | None = None  # the target's layer 0 from those tensors (token-feature maps, exact:0)

    @classmethod
    def load(
        cls,
        folder: str | Path,
        target: ServedModel,
        *,
        allow_unproven: bool = False,
        gate: Gate | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> Contract:
        """Accept `folder` for `target`, or raise `Refused` naming the first check that fails. `dtype`: the
        engine's, in which the target's layer 0 is computed (as `kvlingo.Relay` computes it in the pair's)."""
        folder = Path(folder)
        try:
            config, evidence, why_none = read_export(folder)
            manifest = read_manifest(folder, CONFIG_FILE)  # the maps' hash, before anything else
        except TranslatorError as err:
            raise Refused(f"translator {folder}: {err}") from None
        verdict = judge(evidence, gate or Gate())
        if not verdict.passed and not allow_unproven:
            why = why_none or "; ".join(verdict.failures)
            raise Refused(
                f"translator {folder} is unproven ({why}): benchmark and export it with its evidence, or "
                "set allow_unproven (timing runs only)"
            )
        pair = config["pair"]
        if target.tokenizer_sha256 != pair["tokenizer_sha256"]:
            raise Refused(
                f"the served tokenizer (sha256 {target.tokenizer_sha256[:16]}…) is not the one the maps were "
                f"trained with ({pair['tokenizer_sha256'][:16]}…); serve the recorded pair's tokenizer"
            )
        recorded = config.get("models", {}).get("target")
        if recorded is not None and not same_model(recorded, target.identity):
            raise Refused(
                f"the served model {describe_identity(target.identity)} is not the translator's target "
                f"{describe_identity(recorded)}; serve that model (same weights, or the recorded revision)"
            )
        g = Geometry(**manifest["geometry"])
        want = (g.target_layers, g.target_kv_heads, g.target_head_dim)
        if target.geometry != want:
            raise Refused(
                f"the served model caches [layers, kv_heads, head_dim] = {list(target.geometry)}, the "
                f"translator writes {list(want)}; use maps trained for this model"
            )
        try:
            refresh = Refresh.parse(config.get("refresh"))
        except RefreshError as err:
            raise Refused(f"translator {folder}: {err}") from None
        family, key_space = manifest["family"], manifest["key_space"]
        if family not in FAMILIES:
            raise Refused(f"translator {folder} is of family {family!r}, which this kvlingo does not know; update it")
        if refresh.kind not in SERVED_REFRESH:
            raise Refused(
                f"the {family} maps were measured with refresh {refresh}, which needs the target's own forward over "
                "the context; a KV connector serves none, tail:W (the engine prefills the last W tokens) and exact:0 "
                "(the target's layer 0 from the token ids): export maps measured with one of those"
            )
        wants_layer0 = FAMILIES[family].reads_layer0 or refresh.kind == "exact"
        tensors = checked_target_weights(folder, config, target, family, refresh, key_space)
        source_name = recorded_model(config, "source")
        try:
            source_cfg = load_config(source_name)
            source = model_stub(source_cfg)
            target_stub = model_stub(
                load_config(target.argument),
                tensors=tensors,
                key_norms=key_space == "prenorm",
                layer0_dtype=dtype if wants_layer0 else None,
            )
            translator = load_state(folder, manifest).bind(source, target_stub)
            translator.use_space(ReusingKeySpace.of(translator.space))  # a token-input base's maps read it too
        except NotContextFree as err:
            raise Refused(
                f"the {family} maps with refresh {refresh} read the target's layer 0 from the token ids, and "
                f"{str(err).split(';')[0]}; serve them with a {'/'.join(arch.MODEL_TYPES)} target, or export maps "
                "of a family that reads no token features, measured with refresh none or tail:W"
            ) from None
        except (TranslatorError, PairError, OSError, ValueError) as err:
            raise Refused(f"translator {folder}: {err}") from None
        translator.requires_grad_(False)
        layer0 = getattr(target_stub, "layer0", None)
        return cls(
            folder, config, verdict, translator, refresh, target, source_name, source_cfg, tuple(tensors), layer0
        )

    # ------------------------------------------------------------------ per source cache
    @property
    def key_space(self) -> str:
        return self.translator.key_space

    def admit(self, source: dict[str, Any], with_prenorm: bool = False) -> None:
        """Raise `Refused` unless a cache described by `source` (a `ServedModel.to_dict()`) may be translated;
        `with_prenorm`: the cache comes with the source's k_proj outputs (`SourceModel`)."""
        recorded = self.config.get("models", {}).get("source")
        if recorded is not None and not same_model(recorded, source["identity"]):
            raise Refused(
                f"the source cache is {describe_identity(source['identity'])}'s, the translator reads "
                f"{describe_identity(recorded)}'s"
            )
        g = self.translator.geometry
        want = [g.source_layers, g.source_kv_heads, g.source_head_dim]
        if list(source["geometry"]) != want:
            raise Refused(
                f"the source cache is [layers, kv_heads, head_dim] = {list(source['geometry'])}, the "
                f"translator reads {want}"
            )
        if source["tokenizer_sha256"] != self.config["pair"]["tokenizer_sha256"]:
            raise Refused(
                f"the source engine's tokenizer (sha256 {source['tokenizer_sha256'][:16]}…) is not the maps' tokenizer"
            )
        if self.key_space == "prenorm" and not with_prenorm:
            raise Refused(
                "these maps read the source's pre-norm key features (prenorm key space), which an engine's "
                "cache does not hold; run the source model in the connector (source: model) or export "
                "maps trained with --key-space cache"
            )

    def usable_tokens(self, available: int, prompt_tokens: int, granule: int = 1) -> int:
        """Context tokens the translation may fill: at most `available` (what the source cache covers), never the
        prompt's last token (the engine computes it, as the target reads the last token in `Relay`), less the
        refresh's tail (which the engine prefills on top), rounded down to a multiple of `granule` (an engine's
        block size, where it takes whole blocks only)."""
        context = prompt_tokens - 1
        tail = self.refresh.tail_tokens(context) if self.refresh.kind == "tail" else 0
        return max(0, min(available, context - tail)) // granule * granule

    # ------------------------------------------------------------------ the translation
    @property
    def reads_ids(self) -> bool:
        """Whether a handoff reads the token ids (maps that read the target's token features, or exact:0)."""
        return self.layer0 is not None

    def translate(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        out_dtype: torch.dtype,
        prenorm: torch.Tensor | None = None,
        precision: str | None = None,
        token_major: bool = False,
        ids=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Target (keys, values) [layers, kv_heads, tokens, head_dim] of a source cache's first tokens (keys as
        cached, post-RoPE; `prenorm` the k_proj outputs where the key space reads them; `ids` the token ids they
        cover, which token-feature maps and exact:0 read). Under exact:0, layer 0 is the target's own from the
        ids and the maps write layers 1.. (as `kvlingo.Relay` hands over). `token_major`: the results are views
        of [layers, tokens, kv_heads, head_dim] tensors, whose per-layer slices are what an engine's cache
        writer takes (no copy between them)."""
        n = keys.shape[2]
        if ids is not None:
            ids = torch.as_tensor(ids, dtype=torch.long, device=keys.device).view(-1)  # [tokens]
            if ids.numel() != n:
                raise ValueError(f"{ids.numel()} token ids for a source cache of {n} tokens; pass the ids it covers")
        elif self.reads_ids:
            raise ValueError(
                f"the {self.translator.family} maps with refresh {self.refresh} read the token ids the cache covers; "
                "pass ids="
            )
        cap = Capture(keys, values, prenorm, torch.empty(0), ids)
        k, v = self._result(cap, out_dtype, token_major)
        if self.refresh.kind != "exact":
            return self.translator(cap, out=(k, v), precision=precision)
        return self._with_own_layer0(cap, k, v, precision)

    def _result(self, cap: Capture, dtype: torch.dtype, token_major: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Empty target (keys, values) [layers, kv_heads, tokens, head_dim] on the cache's device; `token_major`:
        views of [layers, tokens, kv_heads, head_dim] tensors (the keys' finish writes those rows itself, the
        values' token term goes straight in, `Translator.map_into_via`)."""
        g, T = self.translator.geometry, cap.n_tokens
        L, H, d, device = g.target_layers, g.target_kv_heads, g.target_head_dim, cap.keys.device
        if token_major:
            return tuple(torch.empty(L, T, H, d, dtype=dtype, device=device).transpose(1, 2) for _ in "kv")
        return tuple(torch.empty(L, H, T, d, dtype=dtype, device=device) for _ in "kv")

    def _with_own_layer0(
        self, cap: Capture, k: torch.Tensor, v: torch.Tensor, precision: str | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """exact:0 into (k, v): layer 0 from the token ids (from the translator's own layer-0 projections where its
        maps read them: computed once), layers 1.. translated straight into the result."""
        if self.translator.reads_layer0:
            k0, v0 = self.layer0.kv_of(*self.translator.layer0_projections(cap))
        else:
            k0, v0 = self.layer0.kv(cap.ids)
        k[0].copy_(k0)  # [kv_heads, tokens, head_dim]
        v[0].copy_(v0)
        rest = slice(1, k.shape[0])
        if rest.start < rest.stop:
            self.translator(cap, target_layers=rest, out=(k[rest], v[rest]), precision=precision)
        return k, v


def recorded_model(config: dict[str, Any], role: str) -> str:
    """The export's recorded source or target model as a model argument: its folder, or id@revision."""
    pair = config["pair"]
    source, target = pair_specs(pair["direction"], "large", "small")
    return model_arg(pair[source] if role == "source" else pair[target], role, "put the same weights there", Refused)


def load_config(name: str):
    from transformers import AutoConfig

    spec = ModelSpec.parse(name)
    return AutoConfig.from_pretrained(spec.name_or_path, revision=spec.revision)


class ReusingKeySpace(KeySpace):
    """A translator's key space whose `cache`-space source side (RoPE stripped off the cached keys) writes into
    buffers reused from one layer chunk to the next, instead of half a dozen fresh tensors per chunk (each a
    round of page faults on a CPU). The same operations: `rope.apply_rope_into` with the strip tables' sine
    negated computes `rope.strip_rope` bit for bit (x·(−s) = −(x·s) and a − (−b) = a + b exactly).

    Its result is overwritten by the next call, so a family must consume it before asking again (every
    family maps a chunk's source features before it reads the next chunk's)."""

    @classmethod
    def of(cls, space: KeySpace) -> ReusingKeySpace:
        reusing = cls.__new__(cls)
        reusing.__dict__.update(space.__dict__)
        reusing._buffers, reusing._negated = {}, None
        return reusing

    def source_keys(
        self, cap: Capture, layers=slice(None), dtype: torch.dtype = torch.float32, fused: bool = False
    ) -> torch.Tensor:
        if self.name != "cache":
            return super().source_keys(cap, layers, dtype, fused)
        keys = cap.keys[layers]  # [n, heads, tokens, head_dim] as cached
        cos, sin = self.source_rope.inverse(cap.n_tokens, device=keys.device)
        if fused:  # one compiled pass from the cache's dtype into the maps' input dtype
            out = self._take("out" if dtype == torch.float32 else "low", keys.shape, dtype, keys.device)
            if strip_keys(keys, cos, sin, out):
                return out
        if self._negated is None or self._negated.shape != sin.shape or self._negated.device != sin.device:
            self._negated = -sin
        x = self._take("x", keys.shape, torch.float32, keys.device)
        x.copy_(keys)
        out = self._take("out", keys.shape, torch.float32, keys.device)
        half = self._take("half", (*keys.shape[:-1], keys.shape[-1] // 2), torch.float32, keys.device)
        apply_rope_into(x, cos, self._negated, out, half)
        if dtype == torch.float32:
            return out
        low = self._take("low", keys.shape, dtype, keys.device)
        return low.copy_(out)

    def _take(self, name: str, shape, dtype: torch.dtype, device) -> torch.Tensor:
        n = torch.Size(shape).numel()
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != device:
            # an ordinary tensor even under inference mode (the engine's forward), so that a call outside it may
            # write the buffer too
            with torch.inference_mode(False):
                buf = self._buffers[name] = torch.empty(n, dtype=dtype, device=device)
        return buf[:n].view(shape)


# --------------------------------------------------------------------------- the target's checked tensors
def checked_target_weights(
    folder: Path, config: dict[str, Any], target: ServedModel, family: str, refresh: Refresh, key_space: str
) -> dict[str, torch.Tensor]:
    """{checkpoint name: tensor as stored} of the target tensors the handoff reads (`reads.target_weights` of the
    export), read from the served model's safetensors (no other tensor is read) and each checked against the
    sha256 recorded there; {} when the handoff reads none. Refused, naming the tensor and the fix: a recorded
    tensor the served checkpoint lacks or holds otherwise, and an export that does not record a tensor the
    handoff reads (one of an earlier version)."""
    recorded = (config.get("reads") or {}).get("target_weights")
    if recorded == "all":  # a refresh that runs the target's layers (refused before this)
        raise Refused(f"translator {folder} reads every target weight (refresh {refresh}); a KV connector cannot")
    if not (FAMILIES[family].reads_layer0 or refresh.kind == "exact" or TARGET_WEIGHTS[key_space]):
        return {}  # RoPE tables only: the checkpoint is not opened
    try:
        files = checkpoint_files(target.identity)
        names = tensor_names(files)
    except (PairError, OSError) as err:
        raise Refused(f"the served model's checkpoint cannot be read: {err}") from None
    needed = target_weight_names(names, family, refresh, key_space)
    if not needed:
        return {}
    if not isinstance(recorded, dict):
        raise Refused(
            f"the {family} maps with refresh {refresh} read the target's {needed[0]} (and {len(needed) - 1} more "
            f"tensors), but translator {folder} records no sha256 of them (reads.target_weights in config.json: an "
            "export of an earlier version); export it again"
        )
    unrecorded = [n for n in needed if n not in recorded]
    if unrecorded:
        raise Refused(
            f"translator {folder} records no sha256 of the target tensor {unrecorded[0]}, which its {family} maps "
            f"with refresh {refresh} read; export it again"
        )
    absent = [n for n in recorded if n not in names]
    if absent:
        raise Refused(
            f"the served model's checkpoint has no tensor {absent[0]}, which translator {folder} reads of its "
            "target; serve the recorded target"
        )
    tensors = read_tensors(files, lambda found: [n for n in found if n in recorded])
    for name, want in recorded.items():
        got = tensor_digest(tensors[name])
        if got != want:
            raise Refused(
                f"the served model's tensor {name} (sha256 {got[:12]}…) is not the one translator {folder} was "
                f"exported against ({want[:12]}…); serve the recorded target's weights, or export maps for this one"
            )
    return tensors


# --------------------------------------------------------------------------- model stubs
class _Namespace:
    def __init__(self, **kw):
        self.__dict__.update(kw)


KEY_NORM = re.compile(r"(?:model\.)?layers\.(\d+)\.self_attn\.k_norm\.weight")


def model_stub(
    config,
    tensors: dict[str, torch.Tensor] | None = None,
    key_norms: bool = False,
    layer0_dtype: torch.dtype | None = None,
):
    """What a translator reads of a model, without its weights: `.config` and `.model.rotary_emb` (the family's
    own rotary module, so the tables are the model's); from `tensors` (checked checkpoint tensors by name), with
    `key_norms` each layer's k_norm (`.model.layers[i].self_attn.k_norm`, which `prenorm` keys are finished with),
    and with `layer0_dtype` the model's layer 0 (`.layer0`, `kvlingo.serve.layer0.Layer0` in that dtype, where
    `kvlingo.core.layer0.of` finds it: token features and exact:0)."""
    from transformers import AutoModelForCausalLM

    tensors = tensors or {}
    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(config)  # allocates nothing: only to find the family's modules
    rotary = type(shell.model.rotary_emb)(config=config)
    layers = [_Namespace(self_attn=_Namespace()) for _ in shell.model.layers]
    norm = arch.k_norm(shell.model.layers[0])
    if key_norms and norm is not None:
        found = {int(m.group(1)): t for name, t in tensors.items() if (m := KEY_NORM.fullmatch(name))}
        if sorted(found) != list(range(len(layers))):
            raise Refused(f"found k_norm weights of the target's layers {sorted(found)}, expected 0..{len(layers) - 1}")
        for i, layer in enumerate(layers):
            module = type(norm)(found[i].shape[0], eps=norm.variance_epsilon)
            with torch.no_grad():
                module.weight.copy_(found[i].float())
            layer.self_attn.k_norm = module
    stub = _Namespace(config=config, model=_Namespace(rotary_emb=rotary, layers=layers))
    if layer0_dtype is not None:
        stub.layer0 = Layer0(config, tensors, rotary, layer0_dtype, parts_of(shell.model.layers[0]))
    return stub


# --------------------------------------------------------------------------- the source model, run here
class SourceModel:
    """The source model run beside the engine, for maps that read what its cache lacks (prenorm key space):
    it prefills the context and keeps its k_proj outputs, as `kvlingo.core.handoff.capture_source` does."""

    def __init__(self, name: str, dtype: torch.dtype, recorded: dict[str, Any] | None = None):
        from transformers import AutoModelForCausalLM

        spec = ModelSpec.parse(name)
        if recorded is not None and not same_model(recorded, spec.identity()):
            raise Refused(f"the source model at {name} is not the translator's source {describe_identity(recorded)}")
        self.model = AutoModelForCausalLM.from_pretrained(spec.name_or_path, revision=spec.revision, dtype=dtype)
        self.model.eval().requires_grad_(False)

    @torch.no_grad()
    def capture(self, ids: list[int]) -> Capture:
        """keys, values and prenorm [layers, kv_heads, tokens, head_dim] of a prefill of `ids`."""
        from transformers import DynamicCache

        cfg = self.model.config
        heads, dim = cfg.num_key_value_heads, Geometry.of(cfg, cfg).source_head_dim
        pre: list[torch.Tensor] = []
        hooks = [
            layer.self_attn.k_proj.register_forward_hook(lambda _m, _i, out: pre.append(out))
            for layer in self.model.model.layers
        ]
        cache = DynamicCache(config=cfg)
        # transformers 5.24 calls the cache argument `cache` (the suite's); the serving environment's 5.19
        # `past_key_values`
        name = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        try:
            self.model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1, **{name: cache})
        finally:
            for h in hooks:
                h.remove()
        keys = torch.stack([layer.keys[0] for layer in cache.layers])  # [layers, kv_heads, tokens, head_dim]
        values = torch.stack([layer.values[0] for layer in cache.layers])
        t = len(ids)
        prenorm = torch.stack([p[0].view(t, heads, dim).transpose(0, 1) for p in pre])
        return Capture(keys, values, prenorm, torch.empty(0))
