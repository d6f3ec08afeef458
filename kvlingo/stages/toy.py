"""The toy world stage (toy_world.py): install (or train) the offline toy world: a procedural chat corpus,
evaluation files, a shared tokenizer, a toy Qwen3 pair ("large" and "small") and a third model of another
depth and KV-head count ("mismatched": 3 layers, 4 KV heads, head_dim 32), so every stage runs on a CPU
without the Hub.

Usage:
    .venv/bin/python toy_world.py --out artifacts/toy                  # install the packaged pair: seconds
    .venv/bin/python toy_world.py --out artifacts/toy --train          # train it from scratch: ~26 CPU-minutes
    .venv/bin/python toy_world.py --out artifacts/toy --train --export kvlingo/toy/pair   # ... and re-package it
    .venv/bin/python toy_world.py --out /tmp/toy --mini                # seconds: tiny corpus and models
    .venv/bin/python toy_world.py --out artifacts/toy --train-deep --export-deep kvlingo/toy/deep   # the deep pair
    .venv/bin/python toy_world.py --out artifacts/toy --train-mismatched --export-mismatched kvlingo/toy/mismatched
    .venv/bin/python toy_world.py --out artifacts/toy --chats 10240    # ... and corpus/chats.10240.jsonl

Writes under --out: corpus/{train_chats,chats,chats.meta,ifeval,ifeval.ref,arc,arc.ref,gsm8k}.jsonl,
tokenizer/, large/, small/ (save_pretrained folders with the tokenizer and meta.json), and
manifest.json last; then mismatched/ and deep/ (each with its own manifest.json: kvlingo/toy/mismatched.py,
kvlingo/toy/deep.py). The install regenerates the corpus from the seed and checks it against the
hashes the packaged pair was trained on. Re-running with the same settings verifies the
manifest's hashes and does nothing; --force retrains. --chats N writes more held-out chats (seconds).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from ..errors import Refusal
from ..inputs.argtypes import number, whole
from ..records.paths import writable
from .skeleton import Stage

# The packaged builds (kvlingo.toy.train.PACKAGED, mismatched.PACKAGED_MISMATCHED, deep.PACKAGED_DEEP), named
# here without importing those torch modules, so that --help stays quick.
TOY = Path(__file__).resolve().parents[1] / "toy"
PACKAGED, PACKAGED_MISMATCHED, PACKAGED_DEEP = TOY / "pair", TOY / "mismatched", TOY / "deep"


class Toy(Stage):
    name = "toy_world"
    script = "toy_world.py"
    summary = (
        "Install (or train) the offline toy world: a procedural chat corpus, evaluation files, a shared\n"
        'tokenizer, a toy Qwen3 pair ("large" and "small") and a third model of another depth and KV-head\n'
        'count ("mismatched": 3 layers, 4 KV heads, head_dim 32), so every stage runs on a CPU without the Hub.'
    )
    examples = (
        ".venv/bin/python toy_world.py --out artifacts/toy",
        ".venv/bin/python toy_world.py --out artifacts/toy --train --export kvlingo/toy/pair",
        ".venv/bin/python toy_world.py --out /tmp/toy-short --train --minutes-per-model 6",
        ".venv/bin/python toy_world.py --out /tmp/toy-mini --mini",
        ".venv/bin/python toy_world.py --out artifacts/toy --train-mismatched --export-mismatched "
        "kvlingo/toy/mismatched",
    )
    common = False

    @classmethod
    def add_args(cls, p) -> None:
        p.add_argument("--out", required=True, type=Path, help="output folder, e.g. artifacts/toy")
        p.add_argument(
            "--train",
            action="store_true",
            help=f"train the full pair from scratch instead of installing the packaged one ({PACKAGED})",
        )
        p.add_argument(
            "--export",
            type=Path,
            default=None,
            metavar="DIR",
            help="after a full --train, copy tokenizer, models and manifest into DIR (e.g. kvlingo/toy/pair)",
        )
        p.add_argument(
            "--seed",
            type=int,
            default=0,
            help="with --train/--mini: seed for corpus, tokenizer order and weights (default 0)",
        )
        p.add_argument(
            "--minutes-per-model",
            type=number(at_least=0),
            default=None,
            help="with --train/--mini: training budget per model in CPU-minutes, turned into a fixed "
            "step count (default: 18 for the large model and 7 for the small one)",
        )
        add_model_args(p)  # the mismatched model, --mini, --chats, the deep pair
        p.add_argument("--force", action="store_true", help="with --train/--mini: retrain even if the manifest matches")
        p.add_argument(
            "--tables",
            action="store_true",
            help="print the models' quality tables (every evaluation set and condition) also when they are "
            "installed, not trained",
        )

    # ------------------------------------------------------------------ check
    def check(self) -> None:
        """The flags that do not go together, then every output folder written to, before any training."""
        args = self.args
        self.training = args.train or args.mini
        if not self.training and (
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
        outputs = (
            (args.out, "--out"),
            (args.export, "--export"),
            (args.export_mismatched, "--export-mismatched"),
            (args.export_deep, "--export-deep"),
        )
        for folder, flag in outputs:
            if folder is not None:
                writable(folder, flag)  # before any training: a folder that cannot be written is named now

    # ------------------------------------------------------------------ run
    def run(self) -> tuple[dict, dict | None, dict | None]:
        """(the pair's manifest, the mismatched model's, the deep pair's): each built, installed or None."""
        try:
            manifest = self._pair()
            mismatched = self._mismatched()
            deep = self._deep()
            if self.args.chats:
                more_chats(self.args.out, manifest, self.args.chats)
        except Refusal:
            raise
        except ValueError as err:  # a regenerated corpus or a build that does not match its recorded hashes
            raise Refusal(f"toy world not built: {err}") from None
        return manifest, mismatched, deep

    def _pair(self) -> dict:
        train, args = toy_module("train"), self.args
        if not self.training:
            return train.install_pair(args.out)
        manifest = train.build_toy_world(
            args.out, seed=args.seed, mini=args.mini, minutes_per_model=args.minutes_per_model, force=args.force
        )
        if args.export is not None:
            train.export_pair(args.out, args.export)
        return manifest

    def _mismatched(self) -> dict | None:
        mismatched, args = toy_module("mismatched"), self.args
        if args.train_mismatched:
            built = mismatched.build_mismatched(args.out, force=args.force)
            if args.export_mismatched is not None:
                mismatched.export_mismatched(args.out, args.export_mismatched)
            return built
        return None if self.training else mismatched.install_mismatched(args.out)

    def _deep(self) -> dict | None:
        deep, args = toy_module("deep"), self.args
        if args.train_deep:
            built = deep.build_deep(args.out, force=args.force)
            if args.export_deep is not None:
                deep.export_deep(args.out, args.export_deep)
            return built
        if not self.training and (PACKAGED_DEEP / "manifest.json").is_file():
            return deep.install_deep(args.out)
        return None

    # ------------------------------------------------------------------ publish
    def publish(self, result: tuple[dict, dict | None, dict | None]) -> None:
        manifest, mismatched, deep = result
        out = self.args.out
        tables = self.training or self.args.tables  # installed: one line per model (the tables: --tables)
        print_pair(manifest, out, self.training, tables)
        if mismatched is not None:
            print_mismatched(mismatched, out, tables or self.args.train_mismatched)
        if deep is not None:
            print_deep(deep, out)


# --------------------------------------------------------------------------- helpers
def add_model_args(p) -> None:
    """The mismatched model and the deep pair (trained or installed), --mini and --chats."""
    p.add_argument(
        "--train-mismatched",
        action="store_true",
        help="train the mismatched model on the world at --out (installed first unless --train/--mini) "
        f"instead of installing the packaged one ({PACKAGED_MISMATCHED})",
    )
    p.add_argument(
        "--export-mismatched",
        type=Path,
        default=None,
        metavar="DIR",
        help="after --train-mismatched on a full world, copy the mismatched model into DIR "
        "(e.g. kvlingo/toy/mismatched)",
    )
    p.add_argument("--mini", action="store_true", help="tiny corpus and models for tests (seconds)")
    p.add_argument(
        "--chats",
        type=whole(1),
        default=None,
        metavar="N",
        help="also write corpus/chats.N.jsonl (+ .meta): chats.jsonl's held-out conversations, then "
        "more from their own seed stream up to N, disjoint from the evaluation items and from the toy "
        "models' training conversations (for translator training at scale; seconds)",
    )
    p.add_argument(
        "--train-deep",
        action="store_true",
        help="train the deep pair (28 layers each) on the world at --out (installed first unless "
        f"--train/--mini) instead of installing the packaged one ({PACKAGED_DEEP}; about 3 hours of one core)",
    )
    p.add_argument(
        "--export-deep",
        type=Path,
        default=None,
        metavar="DIR",
        help="after --train-deep on a full world, copy the deep pair into DIR (e.g. kvlingo/toy/deep)",
    )


def toy_module(name: str):
    """kvlingo.toy.NAME, imported through importlib: the toy world is a fixture (kvlingo/toy/__init__.py), and an
    import statement here would put it in the code hash of every stage that looks the stages up in the registry
    (kvlingo.records.resume follows import statements), so that editing the toy world would change a real run's."""
    return importlib.import_module(f"kvlingo.toy.{name}")


def more_chats(out: Path, manifest: dict, n: int) -> None:
    """corpus/chats.N.jsonl: the world's held-out chats and more from their own seed stream, up to `n`."""
    toyworld, world = toy_module("world"), manifest["config"]["world"]
    config = toyworld.WorldConfig(**{**world, "kind_weights": tuple(world["kind_weights"])})
    path = toyworld.write_more_chats(out / "corpus", config, n)
    print(f"wrote {path} ({n} held-out conversations)")


def print_pair(manifest: dict, out: Path, training: bool, tables: bool) -> None:
    if tables:
        print()
        print(toy_module("train").summary_table(manifest))
    recall = manifest["results"]["exact_reply"]
    for name, info in manifest["results"]["models"].items():
        print(
            f"{name}: {info['n_params']:,} parameters, {info['train_steps']} steps, "
            f"train {info['train_wall_s']:.0f}s, final loss {info['final_loss']:.3f}, "
            f"recall with the chat {recall[name]['chat_recall']['context']:.1%}"
        )
    built = (
        f"built in {manifest['wall_time_s']:.0f}s"
        if training
        else f"the packaged pair, installed; its training build took {manifest['wall_time_s']:.0f}s"
    )
    print(f"manifest: {out / 'manifest.json'} ({built})" + ("" if tables else "; every set: --tables"))


def mismatched_named(results: dict) -> dict:
    """The mismatched model's results keyed by that name (the packaged manifest keys it by its earlier name,
    deep, which is now the 28-layer pair's)."""
    return {("mismatched" if k == "deep" else k): v for k, v in results.items()}


def print_mismatched(manifest: dict, out: Path, tables: bool) -> None:
    if tables:
        print()
        named = {
            **manifest,
            "results": {**manifest["results"], "exact_reply": mismatched_named(manifest["results"]["exact_reply"])},
        }
        print(toy_module("train").summary_table(named))
    info = manifest["results"]["model"]
    print(
        f"mismatched: {info['n_params']:,} parameters, {info['train_steps']} steps, "
        f"train {info['train_wall_s']:.0f}s, final loss {info['final_loss']:.3f}; "
        f"manifest: {out / 'mismatched' / 'manifest.json'}"
    )
    arc = mismatched_named(manifest["results"].get("toy_arc") or {})
    if arc:  # greedy letter accuracy, as task_eval.py scores the native path
        print(
            f"toy ARC (greedy, first {arc['mismatched']['n']} items, chance 25%): "
            + ", ".join(f"{name} {a['accuracy']:.1%} ± {a['se']:.1%}" for name, a in arc.items())
        )


def print_deep(manifest: dict, out: Path) -> None:
    print()
    for name, info in manifest["results"]["models"].items():
        greedy = ", ".join(
            f"{task} {g['accuracy']:.1%} ± {g['se']:.1%} (n {g['n']})" for task, g in info["greedy"].items()
        )
        print(
            f"deep {name}: {info['n_params']:,} parameters, {info['train_steps']} steps, final loss "
            f"{info['final_loss']:.3f}; greedy {greedy}"
        )
    print(f"manifest: {out / 'deep' / 'manifest.json'}")
