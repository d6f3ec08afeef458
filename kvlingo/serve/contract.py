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
5. the refresh setting the evidence was measured with: `none`, or `tail:W`, which the engine
   serves by prefilling the last W context tokens itself; the others need the target's own
   partial forward, which a KV connector cannot run.
Checked per source cache (`admit`): its model against the recorded source, its geometry and
tokenizer digest, and that it holds what the key space reads. An engine's cache holds post-RoPE
keys only, which serve the `cache` key space; `prenorm` maps read the source's k_proj outputs
before k_norm, which a normed key cannot give back (each head's scale is lost), so they need the
source model run beside the engine (`SourceModel`).

The translator runs on RoPE tables and (for `prenorm`) the target's k_norm weights, built from the
models' configs and weights files (`model_stub`), so a serving process holds no second copy of
either model. The code here runs on the serving environment's transformers as well as the suite's.
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.cache import Capture
from ..core.keyspace import KeySpace
from ..core.refresh import Refresh, RefreshError
from ..core.rope import apply_rope_into
from ..core.translator import Geometry, Translator, TranslatorError
from ..errors import Refusal
from ..inputs.models import ModelSpec, PairError, pair_specs, tokenizer_digest
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


class Refused(Refusal):
    """A reason, in one line, to serve a request with an ordinary prefill instead of a translation."""


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
    translator: Translator  # bound to RoPE-only stubs of the pair (`model_stub`)
    refresh: Refresh  # none or tail:W
    target: ServedModel
    source_name: str  # the recorded source model argument (folder or id@revision)
    source_config: Any  # its transformers config

    @classmethod
    def load(
        cls, folder: str | Path, target: ServedModel, *, allow_unproven: bool = False, gate: Gate | None = None
    ) -> Contract:
        """Accept `folder` for `target`, or raise `Refused` naming the first check that fails."""
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
        if refresh.kind not in ("none", "tail"):
            raise Refused(
                f"the maps were measured with refresh {refresh}, which needs the target's own partial "
                "forward; a KV connector can only leave the last tokens to the engine (none or tail:W)"
            )
        source_name = recorded_model(config, "source")
        try:
            source_cfg = load_config(source_name)
            source = model_stub(source_cfg)
            target_stub = model_stub(
                load_config(target.argument), weights=target.argument if manifest["key_space"] == "prenorm" else None
            )
            translator = load_state(folder, manifest).bind(source, target_stub)
            translator.space = ReusingKeySpace.of(translator.space)
        except (TranslatorError, PairError, OSError, ValueError) as err:
            raise Refused(f"translator {folder}: {err}") from None
        translator.requires_grad_(False)
        return cls(folder, config, verdict, translator, refresh, target, source_name, source_cfg)

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
    def translate(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        out_dtype: torch.dtype,
        prenorm: torch.Tensor | None = None,
        precision: str | None = None,
        token_major: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Target (keys, values) [layers, kv_heads, tokens, head_dim] of a source cache's first tokens (keys as
        cached, post-RoPE; `prenorm` the k_proj outputs where the key space reads them). `token_major`: the
        results are views of [layers, tokens, kv_heads, head_dim] tensors, whose per-layer slices are what an
        engine's cache writer takes (no copy between them)."""
        cap = Capture(keys, values, prenorm, torch.empty(0))
        g = self.translator.geometry
        if not token_major or type(self.translator).map_into is not Translator.map_into:
            # head-wise maps write each head's rows in one strided matmul, which needs head-major outputs
            out = self.translator(cap, out_dtype, precision=precision)
            if not token_major:
                return out
            return tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in out)
        k, v = (
            torch.empty(g.target_layers, cap.n_tokens, g.target_kv_heads, g.target_head_dim, dtype=out_dtype)
            for _ in "kv"
        )
        return self.translator(cap, out=(k.transpose(1, 2), v.transpose(1, 2)), precision=precision)


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

    def source_keys(self, cap: Capture, layers=slice(None), dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.name != "cache":
            return super().source_keys(cap, layers, dtype)
        keys = cap.keys[layers]  # [n, heads, tokens, head_dim] as cached
        cos, sin = self.source_rope.inverse(cap.n_tokens, device=keys.device)
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
            buf = self._buffers[name] = torch.empty(n, dtype=dtype, device=device)
        return buf[:n].view(shape)


# --------------------------------------------------------------------------- RoPE-only models
class _Namespace:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def model_stub(config, weights: str | None = None):
    """What a translator reads of a model, without its weights: `.config`, `.model.rotary_emb` (the family's
    own rotary module, so the tables are the model's) and, with `weights` (a folder or Hub id), each layer's
    k_norm (`.model.layers[i].self_attn.k_norm`), the only weights a `prenorm` translation applies."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(config)  # allocates nothing: only to find the family's modules
    rotary = type(shell.model.rotary_emb)(config=config)
    layers = []
    if weights is not None:
        norms = k_norm_weights(weights, len(shell.model.layers))
        for i, layer in enumerate(shell.model.layers):
            norm = getattr(layer.self_attn, "k_norm", None)
            if norm is None:
                layers.append(_Namespace(self_attn=_Namespace()))
                continue
            norm = type(norm)(norms[i].shape[0], eps=norm.variance_epsilon)
            with torch.no_grad():
                norm.weight.copy_(norms[i])
            layers.append(_Namespace(self_attn=_Namespace(k_norm=norm)))
    else:
        layers = [_Namespace(self_attn=_Namespace()) for _ in shell.model.layers]
    return _Namespace(config=config, model=_Namespace(rotary_emb=rotary, layers=layers))


def k_norm_weights(name: str, n_layers: int) -> dict[int, torch.Tensor]:
    """Each layer's k_norm weight [head_dim] from a model's safetensors files (a folder or a Hub snapshot)."""
    from safetensors import safe_open

    spec = ModelSpec.parse(name)
    folder = Path(spec.name_or_path)
    if not spec.is_local:
        from huggingface_hub import snapshot_download

        folder = Path(
            snapshot_download(spec.name_or_path, revision=spec.revision, allow_patterns=["*.safetensors", "*.json"])
        )
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                parts = key.split(".")
                if key.endswith("self_attn.k_norm.weight") and "layers" in parts:
                    out[int(parts[parts.index("layers") + 1])] = f.get_tensor(key).float()
    if sorted(out) != list(range(n_layers)):
        raise Refused(f"{name}: found k_norm weights for layers {sorted(out)}, expected 0..{n_layers - 1}")
    return out


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
