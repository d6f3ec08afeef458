"""Fixtures of the serving tests, built in the suite's environment (.venv): the suite's stages and `kvlingo.Relay`
run there, on transformers 5.24; the serving environment's 5.19 runs only what the connector needs.

    .venv/bin/python tests/serve/build_fixtures.py OUT

writes under OUT: the toy pair (toy/), three exported large → small translators fitted in closed form on six
conversations (exports/: cross-head maps in the cache and prenorm key spaces, and the default translator, token-w3
with refresh exact:0, in the cache key space), a tokenizer folder that is not the pair's (other-tokenizer/), the
large model's own cache of the first prompt (source-cache.safetensors), and fixtures.json: the prompts and, per
export, `Relay.chat`'s greedy reply to each, as token ids (the reference the engine's translated handoff must
equal), and the small model's own greedy reply.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "helpers")]

MAX_NEW_TOKENS = 16


def main(out: Path) -> None:
    import torch
    from exports import export_run
    from safetensors.torch import save_file
    from tinypair import corpus

    from kvlingo import Relay
    from kvlingo.core.handoff import capture_source, greedy_generate, stop_ids
    from kvlingo.inputs.data import prepare, read_split
    from kvlingo.inputs.models import render_ids, resolve_pair
    from kvlingo.inputs.profiles import get_profile
    from kvlingo.io import atomic_write_json
    from kvlingo.toy import train as toytrain
    from kvlingo.toy.tokenizer import save_tokenizer, train_chat_tokenizer

    torch.set_num_threads(1)
    toy = out / "toy"
    toytrain.install_pair(toy, log=lambda _msg: None)
    large, small = toy / "large", toy / "small"
    _, tok = resolve_pair(str(large), str(small), "l2s", "cpu", "float32")
    prepare(tok, get_profile("tiny"), source=toy / "corpus" / "chats.jsonl", out_root=out / "data")
    data = out / "data" / "tiny"
    train = read_split(data, "train")[:6]
    exports = {space: export_run(out, space, large, small, train, data, space) for space in ("cache", "prenorm")}
    # The default translator: head-wise maps plus the target's layer-0 features of each token and the two before it
    # (the tokeninput family's defaults are token-w3's), measured with the target's exact layer 0
    exports["tokeninput"] = export_run(
        out, "tokeninput", large, small, train, data, "cache", family="tokeninput", refresh="exact:0"
    )
    save_tokenizer(train_chat_tokenizer(corpus(), vocab_size=320, min_frequency=1), out / "other-tokenizer")

    chats = [json.loads(line) for line in (toy / "corpus" / "chats.jsonl").read_text().splitlines()]
    rendered = sorted(
        (
            r
            for r in ((render_ids(tok, chat["input"], False), chat["input"]) for chat in chats[:200])
            if 40 <= len(r[0]) <= 400
        ),
        key=lambda r: len(r[0]),
    )
    chosen = [rendered[round(i * (len(rendered) - 1) / 3)] for i in range(4)]  # four lengths, shortest to longest
    prompts = [ids for ids, _ in chosen]
    stops = stop_ids(tok)
    refs, verdicts = {}, {}
    for space, folder in exports.items():
        relay = Relay.load(folder, device="cpu", dtype="float32", allow_unproven=True)
        verdicts[space] = relay.verdict.passed
        # Relay.chat's greedy tokens: the source reads all but the last token, the target reads it and decodes
        refs[space] = [relay.reply_ids(messages, MAX_NEW_TOKENS)[0] for _, messages in chosen]
        assert relay.prompt_ids(chosen[0][1]) == prompts[0]
    native = [
        greedy_generate(relay.target, ids, None, max_new_tokens=MAX_NEW_TOKENS, eos_ids=stops)[0] for ids in prompts
    ]
    cap = capture_source(relay.source, prompts[0], [])
    save_file({"keys": cap.keys.contiguous(), "values": cap.values.contiguous()}, str(out / "source-cache.safetensors"))
    atomic_write_json(
        out / "fixtures.json",
        {
            "large": str(large),
            "small": str(small),
            "exports": {k: str(v) for k, v in exports.items()},
            "other_tokenizer": str(out / "other-tokenizer"),
            "prompts": prompts,
            "relay": refs,
            "native": native,
            "gate_passed": verdicts,
            "max_new_tokens": MAX_NEW_TOKENS,
            "stop_ids": sorted(stops),
        },
    )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: build_fixtures.py OUT")
    main(Path(sys.argv[1]))
