"""What differs between the model families the adapter serves, in one place.

    qwen3   k_norm and q_norm (RMSNorm over head_dim) before RoPE; no projection biases
    qwen2   q/k/v projection biases; no norms on queries or keys (Qwen2 and Qwen2.5)
    llama   no norms on queries or keys; head_dim set in the config (Llama 3.x)

In every family the cached key is RoPE(k_norm(k_proj(x))) with k_norm absent where a family
has none, and the cached value is v_proj(x): a capture hooks k_proj in all of them.
"""

from __future__ import annotations

MODEL_TYPES = ("qwen3", "qwen2", "llama")


def head_dim(cfg) -> int:
    """A config's (or model's) head_dim; Qwen2 configs leave it implicit as hidden_size / heads."""
    cfg = getattr(cfg, "config", cfg)
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def k_norm(layer):
    """A decoder layer's key norm module, or None where the family has none."""
    return getattr(layer.self_attn, "k_norm", None)


def query_module(layer):
    """The module whose output is a layer's pre-RoPE queries: q_norm where the family has one, else q_proj.

    Its output is [batch, tokens, q_heads, head_dim] (q_norm) or [batch, tokens, q_heads·head_dim] (q_proj).
    """
    q_norm = getattr(layer.self_attn, "q_norm", None)
    return q_norm if q_norm is not None else layer.self_attn.q_proj
