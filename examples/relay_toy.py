"""Hand a chat from the large toy model to the small one through the toy translator, offline.

Run from the repository root after `make toy-export`:  .venv/bin/python examples/relay_toy.py [EXPORT]

The large model reads each chat (its KV cache is translated), the small one answers from the translated cache;
each answer is printed beside the small model's own, reading the chat itself.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kvlingo is not installed: import it from the repository

from kvlingo import Relay
from kvlingo.relay import UnprovenTranslator

EXPORT = sys.argv[1] if len(sys.argv) > 1 else "artifacts/demo-l2s/export"  # what `make toy-export` writes

try:
    relay = Relay.load(EXPORT, device="cpu")
    print(f"translator {EXPORT}: evidence gate passed")
except UnprovenTranslator as refusal:  # the refusal names the figures that miss the gate
    print(refusal)
    print("loading it anyway (allow_unproven=True): its answers below are not backed by passing evidence")
    relay = Relay.load(EXPORT, device="cpu", allow_unproven=True)
source, target = ("large", "small") if relay.config["direction"] == "l2s" else ("small", "large")
print(f"{relay.config['family']} maps, refresh {relay.refresh}: the {source} model reads, the {target} one answers")

for fact, question in [
    ("I have a cat called Pepper.", "What is my cat called?"),
    ("My name is Ada. The meeting is on Friday at 3 o'clock.", "When is the meeting?"),
]:
    chat = [
        {"role": "user", "content": fact},
        {"role": "assistant", "content": "Thanks, I will remember that."},
        {"role": "user", "content": question},
    ]
    print(f"{question}\n  handoff ({source} reads, {target} answers): {relay.chat(chat, max_new_tokens=32)}")
    print(f"  {target} alone (reads the chat itself):  {relay.native_chat(chat, max_new_tokens=32)}")
