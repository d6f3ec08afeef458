"""Install (or train) the offline toy world: a procedural chat corpus, evaluation files, a shared
tokenizer, a toy Qwen3 pair ("large" and "small") and a third model of another depth and KV-head
count ("mismatched": 3 layers, 4 KV heads, head_dim 32), so every stage runs on a CPU without the Hub.

Usage:
    python toy_world.py --out artifacts/toy                  # install the packaged pair: seconds
    python toy_world.py --out artifacts/toy --train          # train it from scratch: ~26 CPU-minutes
    python toy_world.py --out artifacts/toy --train --export kvlingo/toy/pair   # ... and re-package it
    python toy_world.py --out /tmp/toy --mini                # seconds: tiny corpus and models
    python toy_world.py --out artifacts/toy --train-deep --export-deep kvlingo/toy/deep   # retrain the deep pair
    python toy_world.py --out artifacts/toy --train-mismatched --export-mismatched kvlingo/toy/mismatched
    python toy_world.py --out artifacts/toy --chats 10240    # ... and corpus/chats.10240.jsonl: more held-out chats

Writes under --out: corpus/{train_chats,chats,chats.meta,ifeval,ifeval.ref,arc,arc.ref,gsm8k}.jsonl,
tokenizer/, large/, small/ (save_pretrained folders with the tokenizer and meta.json), and
manifest.json last; then mismatched/ and deep/ (each with its own manifest.json: kvlingo/toy/mismatched.py,
kvlingo/toy/deep.py). The install regenerates the corpus from the seed and checks it against the
hashes the packaged pair was trained on. Re-running with the same settings verifies the
manifest's hashes and does nothing; --force retrains.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from kvlingo.errors import Refusal
from kvlingo.inputs.argtypes import number, whole
from kvlingo.records.paths import writable
from kvlingo.stages.stage import StageParser, refusals_exit
from kvlingo.toy.deep import PACKAGED_DEEP, build_deep, export_deep, install_deep
from kvlingo.toy.mismatched import PACKAGED_MISMATCHED, build_mismatched, export_mismatched, install_mismatched
from kvlingo.toy.train import PACKAGED, build_toy_world, export_pair, install_pair, summary_table
from kvlingo.toy.world import WorldConfig, write_more_chats


@refusals_exit("toy_world")
def main(argv=None) -> None:
    parser = StageParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  python toy_world.py --out artifacts/toy\n"
        "  python toy_world.py --out artifacts/toy --train --export kvlingo/toy/pair\n"
        "  python toy_world.py --out /tmp/toy-short --train --minutes-per-model 6\n"
        "  python toy_world.py --out /tmp/toy-mini --mini\n"
        "  python toy_world.py --out artifacts/toy --train-mismatched --export-mismatched kvlingo/toy/mismatched",
    )
    parser.add_argument("--out", required=True, type=Path, help="output folder, e.g. artifacts/toy")
    parser.add_argument(
        "--train",
        action="store_true",
        help=f"train the full pair from scratch instead of installing the packaged one ({PACKAGED})",
    )
    parser.add_argument(
        "--export",
        type=Path,
        default=None,
        metavar="DIR",
        help="after a full --train, copy tokenizer, models and manifest into DIR (e.g. kvlingo/toy/pair)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="with --train/--mini: seed for corpus, tokenizer order and weights (default 0)",
    )
    parser.add_argument(
        "--minutes-per-model",
        type=number(at_least=0),
        default=None,
        help="with --train/--mini: training budget per model in CPU-minutes, turned into a fixed "
        "step count (default: 18 for the large model and 7 for the small one)",
    )
    parser.add_argument(
        "--train-mismatched",
        action="store_true",
        help="train the mismatched model on the world at --out (installed first unless --train/--mini) "
        f"instead of installing the packaged one ({PACKAGED_MISMATCHED})",
    )
    parser.add_argument(
        "--export-mismatched",
        type=Path,
        default=None,
        metavar="DIR",
        help="after --train-mismatched on a full world, copy the mismatched model into DIR "
        "(e.g. kvlingo/toy/mismatched)",
    )
    parser.add_argument("--mini", action="store_true", help="tiny corpus and models for tests (seconds)")
    parser.add_argument(
        "--chats",
        type=whole(1),
        default=None,
        metavar="N",
        help="also write corpus/chats.N.jsonl (+ .meta): chats.jsonl's held-out conversations, then "
        "more from their own seed stream up to N, disjoint from the evaluation items and from the toy "
        "models' training conversations (for translator training at scale; seconds)",
    )
    parser.add_argument(
        "--train-deep",
        action="store_true",
        help="train the deep pair (28 layers each) on the world at --out (installed first unless --train/--mini) "
        f"instead of installing the packaged one ({PACKAGED_DEEP}; about 3 hours of one core)",
    )
    parser.add_argument(
        "--export-deep",
        type=Path,
        default=None,
        metavar="DIR",
        help="after --train-deep on a full world, copy the deep pair into DIR (e.g. kvlingo/toy/deep)",
    )
    parser.add_argument(
        "--force", action="store_true", help="with --train/--mini: retrain even if the manifest matches"
    )
    args = parser.parse_args(argv)

    training = args.train or args.mini
    if not training and (
        args.seed != 0
        or args.minutes_per_model is not None
        or (args.force and not (args.train_mismatched or args.train_deep))
    ):
        raise Refusal(
            "--seed, --minutes-per-model and --force change a training run; add --train "
            "(the packaged pair is seed 0 with the default budgets)"
        )
    if args.export is not None and (args.mini or not args.train):
        raise Refusal("--export needs a full --train build (not --mini)")
    if args.export_deep is not None and (args.mini or not args.train_deep):
        raise Refusal("--export-deep needs --train-deep on a full world (not --mini)")
    if args.export_mismatched is not None and (args.mini or not args.train_mismatched):
        raise Refusal("--export-mismatched needs --train-mismatched on a full world (not --mini)")
    if os.environ.get("HF_HUB_OFFLINE") != "1":
        print("note: HF_HUB_OFFLINE is not set; the toy world never needs the Hub (set HF_HUB_OFFLINE=1)")
    try:
        outputs = (
            (args.out, "--out"),
            (args.export, "--export"),
            (args.export_mismatched, "--export-mismatched"),
            (args.export_deep, "--export-deep"),
        )
        for folder, flag in outputs:
            if folder is not None:
                writable(folder, flag)  # before any training: a folder that cannot be written is named now
        if training:
            manifest = build_toy_world(
                args.out, seed=args.seed, mini=args.mini, minutes_per_model=args.minutes_per_model, force=args.force
            )
            if args.export is not None:
                export_pair(args.out, args.export)
        else:
            manifest = install_pair(args.out)
        deep = None
        if args.train_mismatched:
            deep = build_mismatched(args.out, force=args.force)
            if args.export_mismatched is not None:
                export_mismatched(args.out, args.export_mismatched)
        elif not training:
            deep = install_mismatched(args.out)
        deep_pair = None
        if args.train_deep:
            deep_pair = build_deep(args.out, force=args.force)
            if args.export_deep is not None:
                export_deep(args.out, args.export_deep)
        elif not training and (PACKAGED_DEEP / "manifest.json").is_file():
            deep_pair = install_deep(args.out)
        if args.chats:
            world = WorldConfig(
                **{**manifest["config"]["world"], "kind_weights": tuple(manifest["config"]["world"]["kind_weights"])}
            )
            path = write_more_chats(args.out / "corpus", world, args.chats)
            print(f"wrote {path} ({args.chats} held-out conversations)")
    except Refusal:
        raise
    except ValueError as err:  # a regenerated corpus or a build that does not match its recorded hashes
        raise Refusal(f"toy world not built: {err}") from None

    # --- summary
    print()
    print(summary_table(manifest))
    models = manifest["results"]["models"]
    for name, info in models.items():
        print(
            f"{name}: {info['n_params']:,} parameters, {info['train_steps']} steps, "
            f"train {info['train_wall_s']:.0f}s, final loss {info['final_loss']:.3f}"
        )
    built = (
        f"built in {manifest['wall_time_s']:.0f}s"
        if training
        else f"the packaged pair, installed; its training build took {manifest['wall_time_s']:.0f}s"
    )
    print(f"manifest: {args.out / 'manifest.json'} ({built})")
    if deep is not None:
        print()
        print(summary_table(deep))
        info = deep["results"]["model"]
        print(
            f"deep: {info['n_params']:,} parameters, {info['train_steps']} steps, train {info['train_wall_s']:.0f}s, "
            f"final loss {info['final_loss']:.3f}; manifest: {args.out / 'mismatched' / 'manifest.json'}"
        )
        arc = deep["results"].get("toy_arc")
        if arc:  # greedy letter accuracy, as task_eval.py scores the native path
            print(
                f"toy ARC (greedy, first {arc['deep']['n']} items, chance 25%): "
                + ", ".join(f"{name} {a['accuracy']:.1%} ± {a['se']:.1%}" for name, a in arc.items())
            )

    if deep_pair is not None:
        print()
        for name, info in deep_pair["results"]["models"].items():
            greedy = ", ".join(
                f"{task} {g['accuracy']:.1%} ± {g['se']:.1%} (n {g['n']})" for task, g in info["greedy"].items()
            )
            print(
                f"deep {name}: {info['n_params']:,} parameters, {info['train_steps']} steps, final loss "
                f"{info['final_loss']:.3f}; greedy {greedy}"
            )
        print(f"manifest: {args.out / 'deep' / 'manifest.json'}")


if __name__ == "__main__":
    main()
