"""Prepare chat data (prepare.py): natural and packed train/validation/test splits in the target's chat template.

Usage:
    .venv/bin/python toy_world.py --out artifacts/toy --chats 2048   # the demo's source: corpus/chats.2048.jsonl
    .venv/bin/python prepare.py --profile demo --source artifacts/toy/corpus/chats.2048.jsonl \\
        --tokenizer artifacts/toy/tokenizer                         # (make prepare PROFILE=demo runs both)
    .venv/bin/python prepare.py --profile pilot                  # streams Nemotron chat rows from the Hub

Writes <out>/<profile>/{train,validation,test}.{natural,packed}.jsonl and, last, manifest.json
(counts, token-length statistics, input hashes and the sha256 of every file). Re-running with
the same source, tokenizer, profile, seed and code does nothing. The rules (split assignment,
cropping, tokenization) are documented in kvlingo/inputs/data.py.
"""

from __future__ import annotations

from typing import Any

from ..errors import Refusal
from ..inputs.argtypes import whole
from ..inputs.profiles import PROFILES, get_profile
from .skeleton import Stage, lock_run


class Prepare(Stage):
    name = "prepare"
    script = "prepare.py"
    summary = "Prepare chat data: natural and packed train/validation/test splits in the target's chat template."
    examples = (
        "# offline, from a local JSONL in Nemotron chat format. The demo profile's 1,024 conversations need the",
        "# toy world's 2,048 held-out chats (chats.jsonl holds too few usable ones): after make toy,",
        "# `.venv/bin/python toy_world.py --out artifacts/toy --chats 2048` writes them (make prepare PROFILE=demo",
        "# runs both)",
        ".venv/bin/python prepare.py --profile demo --source artifacts/toy/corpus/chats.2048.jsonl "
        "--tokenizer artifacts/toy/tokenizer",
        "# the real data, streamed from the Hub at the pinned revision (--revision SHA: another), Qwen3's tokenizer",
        ".venv/bin/python prepare.py --profile pilot --tokenizer Qwen/Qwen3-0.6B",
        "# rebuild even though nothing changed",
        ".venv/bin/python prepare.py --profile tiny --source artifacts/toy/corpus/chats.jsonl "
        "--tokenizer artifacts/toy/tokenizer --force",
    )
    common = False  # no pair, no run: the data serves every run of the profile

    @classmethod
    def add_args(cls, p) -> None:
        p.add_argument(
            "--profile", default="demo", choices=sorted(PROFILES), help="run profile: split sizes and token caps"
        )
        p.add_argument(
            "--source",
            default=None,
            metavar="PATH",
            help="local JSONL of Nemotron-format chat rows; omit to stream the Hub dataset",
        )
        p.add_argument(
            "--tokenizer",
            default="Qwen/Qwen3-0.6B",
            metavar="PATH_OR_HUB_ID",
            help="target model's tokenizer (local folder or cached Hub id); its chat template renders the data",
        )
        p.add_argument("--seed", type=int, default=0, help="seed for split assignment and sampling")
        p.add_argument("--out", default="data", help="output root; files go to OUT/<profile>/")
        p.add_argument("--force", action="store_true", help="rebuild even when the existing data is up to date")
        p.add_argument(
            "--revision",
            default=None,
            help="Hub dataset revision to stream (a commit sha pins it; default: the revision pinned in "
            "kvlingo/inputs/data.py, NEMOTRON)",
        )
        p.add_argument("--max-rows", type=whole(1), default=None, help="read at most this many source rows")

    def check(self) -> None:
        from ..inputs.data import NEMOTRON, HubSource

        self.profile = get_profile(self.args.profile)
        revision = self.args.revision if self.args.revision is not None else NEMOTRON.revision
        self.hub = HubSource(NEMOTRON.repo_id, NEMOTRON.config, NEMOTRON.split, revision)

    def load(self) -> None:
        """The build's lock (a second build would clear this one's staging folder), then the tokenizer."""
        from ..inputs.data import load_tokenizer

        lock_run(self.args.out, f"prepare-{self.profile.name}", "--out", "--out")
        self.tok = refusing(load_tokenizer, self.args.tokenizer)

    def run(self) -> Any:
        """The splits built, or found up to date (`kvlingo.inputs.data.prepare` decides)."""
        from ..inputs.data import prepare

        args = self.args
        return refusing(
            prepare,
            self.tok,
            self.profile,
            source=args.source,
            out_root=args.out,
            seed=args.seed,
            tokenizer_name=args.tokenizer,
            force=args.force,
            hub=self.hub,
            max_rows=args.max_rows,
            progress=True,
        )

    def publish(self, result: Any) -> dict:
        """What was built (or that nothing was), the splits' table, the rows read and any warning."""
        data_dir = f"{self.args.out}/{self.profile.name}"
        manifest = result.manifest
        if not result.built:
            print(
                f"{data_dir} is up to date (same source, tokenizer, profile, seed and code): nothing to do; "
                "--force rebuilds"
            )
        else:
            print(f"built {data_dir} ({result.reason}) in {manifest['wall_time_s']:.1f} s")
        print(summary(manifest))
        rows = manifest["results"]["rows"]
        print(
            f"rows read {rows['read']}, unique {rows['unique']}, duplicates {rows['duplicates']}, "
            f"skipped {sum(rows['skipped'].values())} {rows['skipped'] or ''}"
        )
        for name, e in manifest["results"]["examples"].items():
            if e.get("think_dropped_by_template"):
                print(
                    f"WARNING: {name}: the chat template dropped the think block of {e['think_dropped_by_template']} "
                    "reasoning-on replies (it ignores reasoning_content); use a template that renders it"
                )
            if e["short"]:
                print(
                    f"WARNING: {name} has {e['kept']} of {e['requested']} requested examples: "
                    "the source has too few usable conversations for this split"
                )
        return manifest


# --------------------------------------------------------------------------- helpers
def refusing(fn, *args, **kwargs):
    """fn(*args, **kwargs), a ValueError (a bad source or tokenizer) made a refusal: one line, exit status 2,
    nothing replaced."""
    try:
        return fn(*args, **kwargs)
    except Refusal:
        raise
    except ValueError as e:
        raise Refusal(str(e)) from None


def summary(manifest: dict) -> str:
    """The splits' table: kept of requested, reasoning on/off, token lengths, cropped and dropped."""
    from ..records.report import fmt_table

    headers = [
        "split",
        "kept/req",
        "on",
        "off",
        "prefix med",
        "prefix max",
        "reply med",
        "reply max",
        "conv/ex",
        "cropped",
        "dropped",
        "reply cut",
    ]
    rows = []
    for name, e in manifest["results"]["examples"].items():
        p, r, c = e["prefix_tokens"] or {}, e["reply_tokens"] or {}, e["conversations_per_example"] or {}
        rows.append(
            [
                name,
                f"{e['kept']}/{e['requested']}",
                e["reasoning_on"],
                e["reasoning_off"],
                p.get("median"),
                p.get("max"),
                r.get("median"),
                r.get("max"),
                c.get("mean"),
                e["prefix_cropped"],
                e["dropped_prefix_too_long"],
                e["reply_cropped"],
            ]
        )
    return fmt_table(headers, rows, floatfmt=".3g")
