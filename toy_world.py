"""Build the offline toy world: a procedural chat corpus, evaluation files, a shared tokenizer and
a trained toy Qwen3 pair ("large" and "small"), so every stage runs on a CPU without the Hub.

Usage:
    python toy_world.py --out artifacts/toy                 # full build, ~25 CPU-minutes
    python toy_world.py --out /tmp/toy --mini               # seconds: tiny corpus and models

Writes under --out: corpus/{train_chats,chats,chats.meta,ifeval,ifeval.ref,arc,arc.ref,gsm8k}.jsonl,
tokenizer/, large/, small/ (save_pretrained folders with the tokenizer and meta.json), and
manifest.json last. Re-running with the same settings verifies the manifest's hashes and does
nothing; --force rebuilds.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from kvlingo.toytrain import build_toy_world, summary_table


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  python toy_world.py --out artifacts/toy\n"
        "  python toy_world.py --out artifacts/toy --minutes-per-model 6 --force\n"
        "  python toy_world.py --out /tmp/toy-mini --mini",
    )
    parser.add_argument("--out", required=True, type=Path, help="output folder, e.g. artifacts/toy")
    parser.add_argument("--seed", type=int, default=0, help="seed for corpus, tokenizer order and weights (default 0)")
    parser.add_argument("--minutes-per-model", type=float, default=None,
                        help="training budget per model in CPU-minutes, turned into a fixed step count "
                        "(default: 12 for the full build)")
    parser.add_argument("--mini", action="store_true", help="tiny corpus and models for tests (seconds)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the manifest matches")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    args = parser.parse_args()

    if args.minutes_per_model is not None and args.minutes_per_model < 0:
        raise SystemExit(f"--minutes-per-model must be >= 0, got {args.minutes_per_model}")
    if os.environ.get("HF_HUB_OFFLINE") != "1":
        print("note: HF_HUB_OFFLINE is not set; the toy world never needs the Hub (set HF_HUB_OFFLINE=1)")
    try:
        manifest = build_toy_world(args.out, seed=args.seed, mini=args.mini, minutes_per_model=args.minutes_per_model,
                                   force=args.force, progress=not args.no_progress)
    except ValueError as err:
        raise SystemExit(f"toy world build failed: {err}") from err

    # --- summary
    print()
    print(summary_table(manifest))
    models = manifest["results"]["models"]
    for name, info in models.items():
        print(f"{name}: {info['n_params']:,} parameters, {info['train_steps']} steps, "
              f"train {info['train_wall_s']:.0f}s, final loss {info['final_loss']:.3f}")
    print(f"manifest: {args.out / 'manifest.json'} (build wall time {manifest['wall_time_s']:.0f}s)")


if __name__ == "__main__":
    main()
