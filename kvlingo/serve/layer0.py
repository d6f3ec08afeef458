"""The target's first layer from its checkpoint's layer-0 tensors alone: what a server computes of the target.

A token-input translator reads the target's layer-0 features of each token, and the exact:0 refresh hands over
the target's own layer-0 keys and values (kvlingo.core.layer0):

    h = input_layernorm(embed_tokens(token))            [hidden]
    k = RoPE_position(k_norm(k_proj(h)))                [kv_heads, head_dim]   (k_norm: Qwen3 only)
    v = v_proj(h)                                       [kv_heads, head_dim]

`Layer0` computes them from those tensors (the ones an export records under `reads.target_weights`, which the
serving contract reads from the served model's safetensors and checks against their sha256), in the engine's
dtype, with the operations of the models' own modules in their order (RMSNorm: FP32 statistics, the normed
input rounded to the run dtype, then the weight; RoPE: the family's own rotary module and rotation), so that its K/V
are `ContextFree`'s bits (tests/serve/test_layer0.py). A model stub carries it as `layer0`
(`kvlingo.core.layer0.of`), where a translator looks for the target's first layer.

RoPE takes its frequencies and attention scaling from the family's own rotary module built from the target's
config (no weights), so every static schedule (default, linear, llama3, yarn) is the model's; longrope, whose
tables switch with the length of a forward, and dynamic schedules are refused.
"""

from __future__ import annotations

import re
import sys

import torch
import torch.nn.functional as F

from ..core import arch
from ..core.layer0 import check
from ..core.rope import schedule_refusal

# The tensors of `Layer0`, by checkpoint name without the optional `model.` prefix (kvlingo.core.layer0 reads the
# same ones); k_norm exists in Qwen3 only, the projection biases in Qwen2 only.
PARTS = {
    "embed": "embed_tokens.weight",
    "norm": "layers.0.input_layernorm.weight",
    "k_proj": "layers.0.self_attn.k_proj.weight",
    "k_bias": "layers.0.self_attn.k_proj.bias",
    "v_proj": "layers.0.self_attn.v_proj.weight",
    "v_bias": "layers.0.self_attn.v_proj.bias",
    "k_norm": "layers.0.self_attn.k_norm.weight",
}
OPTIONAL = ("k_bias", "v_bias", "k_norm")


def parts_of(layer) -> tuple[str, ...]:
    """The optional parts (of `OPTIONAL`) a model's first decoder layer has: `layer` built from the config alone
    (on the meta device, as `kvlingo.serve.contract.model_stub` builds it), so the family's own modules say
    whether it has a key norm and projection biases."""
    attn = layer.self_attn
    has = {
        "k_bias": getattr(attn.k_proj, "bias", None) is not None,
        "v_bias": getattr(attn.v_proj, "bias", None) is not None,
        "k_norm": arch.k_norm(layer) is not None,
    }
    return tuple(part for part in OPTIONAL if has[part])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Qwen3's, Qwen2's and Llama's modules compute it: FP32 statistics, the normed input rounded back
    to x's dtype, then the weight (in the run dtype)."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class Layer0:
    """The target's layer 0 from its tensors: token features, and keys and values, of token ids."""

    def __init__(
        self,
        config,
        tensors: dict[str, torch.Tensor],
        rotary,
        dtype: torch.dtype = torch.float32,
        optional: tuple[str, ...] | None = None,
    ):
        """`config`: the target's transformers config; `tensors`: its layer-0 tensors by checkpoint name (see
        `PARTS`); `rotary`: the family's rotary module built from that config (its cos and sin tables; the
        family's `apply_rotary_pos_emb` beside it rotates); `dtype`: the run dtype (the engine's); `optional`: the
        optional parts the model's layer 0 has (`parts_of`), each then required (a Qwen3 layer 0 without its k_norm
        is refused, not run without it); None: those `tensors` hold."""
        check(config)  # NotContextFree, naming the architecture
        rope = dict(getattr(config, "rope_parameters", None) or {})
        why = schedule_refusal(rope)
        if why is None and rope.get("rope_type") == "longrope":
            why = "RoPE schedule 'longrope' switches its tables with the forward's length; serve a static schedule"
        if why:
            raise ValueError(why)
        found = {}
        for part, suffix in PARTS.items():
            names = [n for n in tensors if re.fullmatch(r"(model\.)?" + re.escape(suffix), n)]
            needed = part not in OPTIONAL or (optional is not None and part in optional)
            if not names and needed:
                raise ValueError(f"the target's layer 0 needs {suffix}, which the given tensors lack")
            used = names and (part not in OPTIONAL or optional is None or part in optional)
            found[part] = tensors[names[0]].to(dtype) if used else None
        self.embed, self.norm = found["embed"], found["norm"]  # [vocab, hidden], [hidden]
        self.k_proj, self.k_bias = found["k_proj"], found["k_bias"]  # [kv_heads · head_dim, hidden], [...] or None
        self.v_proj, self.v_bias = found["v_proj"], found["v_bias"]
        self.k_norm = found["k_norm"]  # [head_dim] or None (a family without a key norm)
        self.eps = config.rms_norm_eps  # both norms' (the families build them with the config's rms_norm_eps)
        self.head_dim = arch.head_dim(config)
        self.rotary = rotary
        self.apply_rope = sys.modules[type(rotary).__module__].apply_rotary_pos_emb  # the family's own rotation
        self.dtype = dtype

    def _ids(self, ids) -> torch.Tensor:
        return torch.as_tensor(ids, device=self.embed.device).view(1, -1)  # [1, tokens]

    @torch.no_grad()
    def hidden(self, ids) -> torch.Tensor:
        """input_layernorm(embed(ids)): [1, tokens, hidden] in the run dtype."""
        return rms_norm(F.embedding(self._ids(ids), self.embed), self.norm, self.eps)

    @torch.no_grad()
    def token_features(self, ids) -> torch.Tensor:
        """[k_proj(h), v_proj(h)] per token, [tokens, 2 · kv_heads · head_dim] (`ContextFree.token_features`)."""
        h = self.hidden(ids)
        return torch.cat([F.linear(h, self.k_proj, self.k_bias), F.linear(h, self.v_proj, self.v_bias)], -1)[0]

    @torch.no_grad()
    def kv(self, ids, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer-0 (keys, values) of `ids` at positions start.., each [kv_heads, tokens, head_dim]."""
        h = self.hidden(ids)
        return self.kv_of(F.linear(h, self.k_proj, self.k_bias)[0], F.linear(h, self.v_proj, self.v_bias)[0], start)

    @torch.no_grad()
    def kv_of(self, k_proj: torch.Tensor, v_proj: torch.Tensor, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer-0 (keys, values) from the ids' k_proj and v_proj outputs [tokens, kv_heads · head_dim]: the key
        through k_norm and RoPE at positions start.. (`ContextFree.kv_of`)."""
        T = k_proj.shape[0]
        k = k_proj.to(self.dtype).view(1, T, -1, self.head_dim)
        if self.k_norm is not None:
            k = rms_norm(k, self.k_norm, self.eps)
        k = k.transpose(1, 2)  # [1, kv_heads, T, head_dim]
        v = v_proj.to(self.dtype).view(1, T, -1, self.head_dim).transpose(1, 2)
        positions = torch.arange(start, start + T, device=k.device)[None]
        cos, sin = self.rotary(v, positions)  # [1, T, head_dim] in the run dtype, as the model's forward
        _, k = self.apply_rope(k, k, cos, sin)
        return k[0], v[0]
