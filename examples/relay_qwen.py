"""Qwen3-1.7B reads a chat and Qwen3-0.6B answers from the translated cache.

Run from the repository root after `make run DEVICE=cuda` and `make export`:  .venv/bin/python examples/relay_qwen.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kvlingo is not installed: import it from the repository

import torch

from kvlingo import Relay

# An exported folder, or a Hub repo id with revision="<commit>"; device "auto" takes cuda, then mps, then cpu.
relay = Relay.load("artifacts/pilot-l2s/export", device="auto")
chat = [
    {"role": "user", "content": "My locker code is 4471. Please remember it."},
    {"role": "assistant", "content": "Noted: 4471."},
    {"role": "user", "content": "What is my locker code?"},
]
print(relay.chat(chat, max_new_tokens=64))  # the source prefills the chat, the target answers greedily

# The same handoff for transformers' own generate: the target's cache of the prompt but its last token.
cache = relay.handoff(chat)
ids = torch.tensor([relay.prompt_ids(chat)], device=relay.target.device)
out = relay.target.generate(ids, cache=cache, max_new_tokens=64, do_sample=False)
print(relay.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
