"""A tiny Qwen3 pair built in seconds: random weights, a locally trained tokenizer.

Related as Qwen3-0.6B and 1.7B are: same layers, KV heads and head_dim; different hidden
size, query heads and rope_theta, so the RoPE schedules really differ.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvlingo.tokenizer import save_tokenizer, train_chat_tokenizer

WORDS = (
    "the cat sat on a mat while ada wrote code K7-42 in the lab . numbers 0 1 2 3 4 5 6 7 8 9 "
    "remember what was said before and answer : yes no maybe Paris Rome blue red green list item "
    "user assistant system think reasoning step answer question hello world"
).split()


def corpus(n: int = 300) -> list[str]:
    g = torch.Generator().manual_seed(0)
    return [" ".join(WORDS[i] for i in torch.randint(len(WORDS), (24,), generator=g).tolist()) for _ in range(n)]


def qwen3_config(vocab: int, hidden: int, heads: int, rope_theta: float, layers: int = 2, kv_heads: int = 2,
                 head_dim: int = 16, **kw):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta}, tie_word_embeddings=True, **kw,
    )


def build_tiny_pair(root: str | Path, seed: int = 0) -> tuple[Path, Path]:
    """Save a tokenizer plus a 'large' and a 'small' random Qwen3 under root; return their folders."""
    from transformers import Qwen3ForCausalLM

    root = Path(root)
    tok = train_chat_tokenizer(corpus(), vocab_size=320, min_frequency=1)
    vocab = len(tok)
    paths = []
    for i, (name, hidden, heads, theta) in enumerate([("large", 96, 6, 1_000_000.0), ("small", 64, 4, 10_000.0)]):
        torch.manual_seed(seed + i)
        cfg = qwen3_config(vocab, hidden, heads, theta, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        model = Qwen3ForCausalLM(cfg)
        # Random init gives near-uniform outputs; widen the weights so logits and attention are peaked
        # enough that a wrong cache visibly changes them.
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.mul_(4.0)
        path = root / name
        model.save_pretrained(path)
        save_tokenizer(tok, path)
        paths.append(path)
    return paths[0], paths[1]
