"""A tiny Qwen3 pair built in seconds: random weights, a locally trained tokenizer.

Related as Qwen3-0.6B and 1.7B are: same layers, KV heads and head_dim; different hidden
size, query heads and rope_theta, so the RoPE schedules really differ.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvlingo.toy.tokenizer import save_tokenizer, train_chat_tokenizer

WORDS = (
    "the cat sat on a mat while ada wrote code K7-42 in the lab . numbers 0 1 2 3 4 5 6 7 8 9 "
    "remember what was said before and answer : yes no maybe Paris Rome blue red green list item "
    "user assistant system think reasoning step answer question hello world"
).split()


def corpus(n: int = 300) -> list[str]:
    g = torch.Generator().manual_seed(0)
    return [" ".join(WORDS[i] for i in torch.randint(len(WORDS), (24,), generator=g).tolist()) for _ in range(n)]


def qwen3_config(
    vocab: int, hidden: int, heads: int, rope_theta: float, layers: int = 2, kv_heads: int = 2, head_dim: int = 16, **kw
):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        tie_word_embeddings=True,
        **kw,
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


def load_tiny_pair(paths, dtype=torch.float32, direction: str = "l2s"):
    """The checked, loaded pair of two local folders (large, small) on the CPU."""
    from kvlingo.inputs.models import load_pair, resolve_pair

    cfg, tok = resolve_pair(str(paths[0]), str(paths[1]), direction, "cpu", str(dtype).removeprefix("torch."))
    return load_pair(cfg, tok)


def write_prepared(folder: str | Path, tok, splits: dict[str, list[dict]], name: str = "test tokenizer") -> Path:
    """A complete prepared data folder, as prepare.py writes it: the split files, then a manifest
    holding their sha256, row counts, and the tokenizer's digest and chat template hash."""
    import json

    from kvlingo.inputs.models import tokenizer_digest
    from kvlingo.io import atomic_write_json, sha256_file, sha256_json
    from kvlingo.records.report import sealed

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, rows in splits.items():
        path = folder / f"{split}.natural.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        files[path.name] = sha256_file(path)
    atomic_write_json(
        folder / "manifest.json",
        sealed(
            {
                "stage": "prepare",
                "files": files,
                "n_samples": {f"{split}.natural": len(rows) for split, rows in splits.items()},
                "inputs": {
                    "tokenizer": {
                        "name": name,
                        "digest": tokenizer_digest(tok),
                        "chat_template_sha256": sha256_json(tok.chat_template),
                    }
                },
            }
        ),
    )
    return folder


def chat_rows(
    tok, n: int, seed: int, tag: str, system_every: int = 0, user_words=(8, 30), reply_words=(3, 10)
) -> list[dict]:
    """Rows in the prepared-split format: a chat prefix through the generation prompt (a system message on
    every `system_every`-th row), and a reply ending in <|im_end|>."""
    import random

    rng = random.Random(seed)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    rows = []
    for i in range(n):
        user = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*user_words)))
        reply = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*reply_words)))
        system = [{"role": "system", "content": "be brief"}] if system_every and i % system_every == 0 else []
        prefix = tok.apply_chat_template(
            system + [{"role": "user", "content": user}],
            tokenize=True,
            add_generation_prompt=True,
            enable_thinking=False,
        )
        rows.append(
            {
                "id": f"{tag}{i}",
                "prefix_ids": list(prefix["input_ids"]),
                "reply_ids": tok.encode(reply, add_special_tokens=False) + [end],
                "prefix_text": user,
                "reply_text": reply,
                "reasoning": False,
                "source_ids": [f"{tag}{i}"],
            }
        )
    return rows


# RoPE schedules of every supported type at tiny sizes (head_dim 16; "original" lengths short enough that
# a test crosses them). yarn and longrope carry an attention scaling ≠ 1.
ROPE_SCHEDULES = {
    "default": {"rope_type": "default", "rope_theta": 10_000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10_000.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500_000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    "yarn": {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    "longrope": {
        "rope_type": "longrope",
        "rope_theta": 10_000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 24,
        "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [1.0 + 0.9 * i for i in range(8)],
    },
}


def tiny_model(
    model_type: str = "llama",
    rope: str | dict = "default",
    seed: int = 0,
    dtype=torch.float32,
    vocab: int = 320,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    layers: int = 2,
    head_dim: int = 16,
    **kw,
):
    """A random tiny Qwen3, Qwen2 or Llama (head_dim 16 by default, max 256 positions) with the named RoPE schedule,
    its weights widened like `build_tiny_pair`'s (and Qwen2's biases drawn) so that a wrong cache visibly
    changes the logits."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    rope_parameters = dict(ROPE_SCHEDULES[rope] if isinstance(rope, str) else rope)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        rope_parameters=rope_parameters,
        tie_word_embeddings=True,
    )
    if model_type == "qwen3":
        cfg = Qwen3Config(head_dim=head_dim, **common, **kw)
    elif model_type == "qwen2":
        cfg = Qwen2Config(
            **{**common, "hidden_size": head_dim * heads, "intermediate_size": 2 * head_dim * heads}, **kw
        )
    else:
        cfg = LlamaConfig(head_dim=head_dim, **common, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(4.0)
            elif name.endswith(".bias"):  # Qwen2's projection biases start at zero: make them matter
                p.normal_(0.0, 0.5)
    return model.to(dtype).eval().requires_grad_(False)


def pair_flags(paths) -> list[str]:
    """A stage's flags for the tiny pair at `paths` (large, small), on the CPU in FP32."""
    return ["--large", str(paths[0]), "--small", str(paths[1]), "--device", "cpu", "--dtype", "float32"]


def task_inputs(tmp_path: Path, tokenizer_dir) -> tuple[Path, Path]:
    """Prepared chat splits (train 20, validation 6, test 4) and a 4-item GSM8K set under tmp_path, for stages that
    train and then run generative cells (ablate, frontier). Returns (data folder, eval data root)."""
    import json

    from transformers import AutoTokenizer

    import task_eval

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    data = write_prepared(
        tmp_path / "data" / "tiny",
        tok,
        {s: chat_rows(tok, n, i, s[0]) for i, (s, n) in enumerate((("train", 20), ("validation", 6), ("test", 4)))},
    )
    gsm = [{"question": f"Ada has {i} cats and buys 2 more. How many?", "answer": f"#### {i + 2}"} for i in range(4)]
    (tmp_path / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gsm))
    task_eval.main(
        [
            "--task",
            "gsm8k",
            "--prepare",
            "--data-root",
            str(tmp_path / "eval"),
            "--source",
            str(tmp_path / "gsm8k.jsonl"),
        ]
    )
    return data, tmp_path / "eval"
