"""The target's first layer from its token ids alone: the keys and values no context changes.

In the families of `arch.MODEL_TYPES` (Qwen3, Qwen2, Llama) the first decoder layer's cached
key and value of a token depend on that token and its position only:

    h = input_layernorm(embed_tokens(token))            [hidden]
    k = RoPE_position(k_norm(k_proj(h)))                [kv_heads, head_dim]   (k_norm: Qwen3 only)
    v = v_proj(h)                                       [kv_heads, head_dim]

Tokens first mix in that layer's attention, after its K/V are written. So the target's own
layer-0 cache of a context is one projection of its token ids, 2 · hidden · 2 · kv_heads ·
head_dim FLOPs per token (`flops_per_token`; about 0.3% of a re-prefill at Qwen3-0.6B's
shapes), where `refresh.py`'s `layer:0` runs the model's forward through layer 0. `ContextFree`
calls the model's own modules in the forward's order, on the same [1, tokens, hidden] shapes,
so its K/V are the bits a forward caches. Its normed embedding h is also a per-token feature a
translator may read beside the source's (kvlingo.core.families.tokeninput).

Any other architecture is refused by name (`check`): a first layer that is linear attention,
a convolution or a state-space block (Qwen3-Next, LFM2, Mamba hybrids) mixes tokens before or
instead of attention K/V, and an architecture not listed is not assumed to be context-free.
"""

from __future__ import annotations

import sys

import torch

from ..errors import Refusal
from . import arch

# The target parameters the token path reads (checkpoint names, a `model.` prefix or none): the embedding and the
# first norm (the token features h), layer 0's key and value projections (a tokeninput translator's features, and
# exact:0's K/V), and with exact:0 the key norm (Qwen3's k_norm). Nothing else of the target is read before it runs.
FEATURE_WEIGHTS = (
    r"(model\.)?embed_tokens\.weight",
    r"(model\.)?layers\.0\.input_layernorm\.weight",
    r"(model\.)?layers\.0\.self_attn\.[kv]_proj\.(weight|bias)",
)
EXACT_WEIGHTS = (*FEATURE_WEIGHTS, r"(model\.)?layers\.0\.self_attn\.k_norm\.weight")


def read_weight_names(names, exact: bool) -> list[str]:
    """Of a checkpoint's tensor `names`, those the token path reads: for the token features (`exact` False), or
    for the exact layer 0 as well (`exact` True)."""
    import re

    patterns = [re.compile(p) for p in (EXACT_WEIGHTS if exact else FEATURE_WEIGHTS)]
    return sorted(n for n in names if any(p.fullmatch(n) for p in patterns))


class NotContextFree(Refusal, ValueError):
    """A model whose first layer's keys and values are not known to depend on the token and position alone."""


def check(model) -> None:
    """Refuse (NotContextFree, naming the architecture and the fix) a model whose layer 0 is not context-free."""
    cfg = getattr(model, "config", model)
    kind = getattr(cfg, "model_type", None)
    first = (getattr(cfg, "layer_types", None) or [None])[0]
    if kind not in arch.MODEL_TYPES or first not in (None, "full_attention", "sliding_attention"):
        what = f"{kind!r}" + (f" (first layer {first!r})" if first not in (None, "full_attention") else "")
        raise NotContextFree(
            f"the first layer of a {what} model is not known to be context-free (keys and values from the token "
            f"and its position alone: {', '.join(arch.MODEL_TYPES)} only); use layer:0, which runs the target's "
            "layer-0 forward, instead of exact:0"
        )


def flops_per_token(cfg) -> float:
    """k_proj and v_proj of one token (the embedding lookup, the norms and RoPE are not counted)."""
    cfg = getattr(cfg, "config", cfg)
    return 2.0 * cfg.hidden_size * 2 * cfg.num_key_value_heads * arch.head_dim(cfg)


def of(model):
    """The evaluator of `model`'s first layer from token ids: the one a model stub carries (`model.layer0`: a
    server's, built from the checkpoint's layer-0 tensors alone, kvlingo.serve.layer0), else `ContextFree(model)`."""
    own = getattr(model, "layer0", None)
    return own if own is not None else ContextFree(model)


class ContextFree:
    """The first layer of a (checked) model, evaluated from token ids."""

    def __init__(self, model):
        check(model)
        self.model = model
        self.layer = model.model.layers[0]
        attn = self.layer.self_attn
        self.rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb  # the model family's own RoPE
        self.head_dim = arch.head_dim(model.config)

    def _ids(self, ids) -> torch.Tensor:
        device = next(self.model.parameters()).device
        ids = torch.as_tensor(ids, device=device)
        return ids.view(1, -1)  # [1, tokens]

    def embeddings(self, ids) -> torch.Tensor:
        """The token embeddings [1, tokens, hidden] in the model's dtype."""
        return self.model.model.embed_tokens(self._ids(ids))

    def features(self, ids) -> torch.Tensor:
        """input_layernorm(embed(ids)): the layer-0 attention's input, [tokens, hidden] in the model's dtype."""
        with torch.no_grad():
            return self.layer.input_layernorm(self.embeddings(ids))[0]

    def prenorm(self, ids) -> torch.Tensor:
        """k_proj outputs (pre k_norm, pre RoPE): [kv_heads, tokens, head_dim]."""
        with torch.no_grad():
            h = self.layer.input_layernorm(self.embeddings(ids))
            return self.layer.self_attn.k_proj(h).view(h.shape[1], -1, self.head_dim).transpose(0, 1)

    def token_features(self, ids) -> torch.Tensor:
        """[k_proj(h), v_proj(h)] per token, [tokens, 2 · kv_heads · head_dim]: the layer-0 key (pre k_norm and
        RoPE) and value, a linear image of h that keeps all of it when 2 · kv width ≥ hidden (Qwen3-0.6B, 1.7B)."""
        with torch.no_grad():
            h = self.layer.input_layernorm(self.embeddings(ids))
            attn = self.layer.self_attn
            return torch.cat([attn.k_proj(h), attn.v_proj(h)], -1)[0]

    def feature_span(self) -> torch.Tensor | None:
        """An orthonormal basis [2 · kv width, k] (FP64, CPU) of the directions `token_features` take: the column
        space of [W_k; W_v] (beside their biases, where the family has them), as the features are that map of h.
        None when it is all of them (2 · kv width ≤ hidden). Where it is not (Qwen3-0.6B: 2,048 > 1,024), the
        other directions hold the features' rounding alone, in any dtype, which a least-squares fit must not read."""
        attn = self.layer.self_attn
        m = torch.cat([attn.k_proj.weight, attn.v_proj.weight]).detach().cpu().double()  # [2 · kv width, hidden]
        if attn.k_proj.bias is not None:
            bias = torch.cat([attn.k_proj.bias, attn.v_proj.bias]).detach().cpu().double()
            m = torch.cat([m, bias[:, None]], 1)
        if m.shape[1] >= m.shape[0]:
            return None
        return torch.linalg.svd(m, full_matrices=False).U  # [2 · kv width, hidden (+ 1)]

    def kv(self, ids, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer-0 (keys, values) a forward of `ids` at positions start.. caches, each [kv_heads, tokens,
        head_dim]."""
        with torch.no_grad():
            h = self.layer.input_layernorm(self.embeddings(ids))  # [1, T, hidden]
            attn = self.layer.self_attn
            return self.kv_of(attn.k_proj(h)[0], attn.v_proj(h)[0], start)

    def kv_of(self, k_proj: torch.Tensor, v_proj: torch.Tensor, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer-0 (keys, values) from the token ids' k_proj and v_proj outputs [tokens, kv_heads · head_dim]
        (what `token_features` holds): the key through k_norm and RoPE at positions start.., the same bits as
        `kv` (a translator that read the projections for its own features computes them once)."""
        with torch.no_grad():
            T = k_proj.shape[0]
            shape = (1, T, -1, self.head_dim)
            dtype = self.layer.self_attn.k_proj.weight.dtype
            k = k_proj.to(dtype).view(shape)
            norm = arch.k_norm(self.layer)
            if norm is not None:
                k = norm(k)
            k = k.transpose(1, 2)  # [1, kv_heads, T, head_dim]
            v = v_proj.to(dtype).view(shape).transpose(1, 2)
            positions = torch.arange(start, start + T, device=k.device)[None]
            cos, sin = self.model.model.rotary_emb(v, positions)
            _, k = self.rope(k, k, cos, sin)
            return k[0], v[0]


def exact_kv(model, ids, k_out: torch.Tensor, v_out: torch.Tensor, projections=None) -> None:
    """The exact:0 refresh into a cache: `model`'s own layer-0 keys and values of `ids` written into k_out and v_out
    [kv_heads, tokens, head_dim] (a preallocated cache's layer-0 context views); from `projections` (k_proj,
    v_proj of the ids: a token-input translator's own features) when given. A model whose layer 0 is not
    context-free is refused (NotContextFree, naming it)."""
    layer = ContextFree(model)
    k, v = layer.kv(ids) if projections is None else layer.kv_of(*projections)
    k_out.copy_(k)
    v_out.copy_(v)
