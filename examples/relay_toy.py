"""Hand a chat from the large toy model to the small one through the toy translator, offline.

Run from the repository root after `make toy-export`:  .venv/bin/python examples/relay_toy.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kvlingo is not installed: import it from the repository

from kvlingo import Relay
from kvlingo.relay import UnprovenTranslator

EXPORT = "artifacts/demo-l2s/export"  # what `make toy-export` writes

try:
    relay = Relay.load(EXPORT, device="cpu")
except UnprovenTranslator as refusal:  # the refusal names the figures that miss the gate
    print(refusal)
    relay = Relay.load(EXPORT, device="cpu", allow_unproven=True)

for fact, question in [
    ("I have a cat called Pepper.", "What is my cat called?"),
    ("My name is Ada. The meeting is on Friday at 3 o'clock.", "When is the meeting?"),
]:
    chat = [
        {"role": "user", "content": fact},
        {"role": "assistant", "content": "Thanks, I will remember that."},
        {"role": "user", "content": question},
    ]
    print(question, "->", relay.chat(chat, max_new_tokens=32))  # the large toy model reads, the small one answers
