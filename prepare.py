"""Prepare chat data: natural and packed train/validation/test splits in the target's chat template.

Usage:
    python prepare.py --profile demo --source artifacts/toy/corpus/chats.jsonl --tokenizer artifacts/toy/tokenizer
    python prepare.py --profile pilot                  # streams Nemotron chat rows from the Hub

Writes <out>/<profile>/{train,validation,test}.{natural,packed}.jsonl and, last, manifest.json
(counts, token-length statistics, input hashes and the sha256 of every file). Re-running with
the same source, tokenizer, profile, seed and code does nothing. The rules (split assignment,
cropping, tokenization) are documented in kvlingo/inputs/data.py.
"""

from __future__ import annotations

import argparse

from kvlingo.errors import Refusal
from kvlingo.inputs.argtypes import whole
from kvlingo.inputs.data import NEMOTRON, HubSource, load_tokenizer, prepare
from kvlingo.inputs.profiles import PROFILES, get_profile
from kvlingo.records.report import fmt_table
from kvlingo.stages.stage import StageParser, lock_run, refusals_exit

EPILOG = """examples:
  # offline, from a local JSONL in Nemotron chat format
  python prepare.py --profile demo --source artifacts/toy/corpus/chats.jsonl --tokenizer artifacts/toy/tokenizer
  # the real data, streamed at a pinned dataset commit, with Qwen3's tokenizer
  python prepare.py --profile pilot --revision <commit-sha> --tokenizer Qwen/Qwen3-0.6B
  # rebuild even though nothing changed
  python prepare.py --profile tiny --source artifacts/toy/corpus/chats.jsonl --tokenizer artifacts/toy/tokenizer --force
"""


def summary(manifest: dict) -> str:
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


@refusals_exit("prepare")
def main(argv: list[str] | None = None) -> None:
    ap = StageParser(
        description=__doc__.split("\n")[0], epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--profile", default="demo", choices=sorted(PROFILES), help="run profile: split sizes and token caps"
    )
    ap.add_argument(
        "--source",
        default=None,
        metavar="PATH",
        help="local JSONL of Nemotron-format chat rows; omit to stream the Hub dataset",
    )
    ap.add_argument(
        "--tokenizer",
        default="Qwen/Qwen3-0.6B",
        metavar="PATH_OR_HUB_ID",
        help="target model's tokenizer (local folder or cached Hub id); its chat template renders the data",
    )
    ap.add_argument("--seed", type=int, default=0, help="seed for split assignment and sampling")
    ap.add_argument("--out", default="data", help="output root; files go to OUT/<profile>/")
    ap.add_argument("--force", action="store_true", help="rebuild even when the existing data is up to date")
    ap.add_argument(
        "--revision",
        default=NEMOTRON.revision,
        help=f"Hub dataset revision to stream (a commit sha pins it; default {NEMOTRON.revision!r})",
    )
    ap.add_argument("--max-rows", type=whole(1), default=None, help="read at most this many source rows")
    args = ap.parse_args(argv)

    profile = get_profile(args.profile)
    hub = HubSource(NEMOTRON.repo_id, NEMOTRON.config, NEMOTRON.split, args.revision)
    lock_run(
        args.out, f"prepare-{profile.name}", "--out", "--out"
    )  # a second build would clear this one's staging folder
    try:
        tok = load_tokenizer(args.tokenizer)
        result = prepare(
            tok,
            profile,
            source=args.source,
            out_root=args.out,
            seed=args.seed,
            tokenizer_name=args.tokenizer,
            force=args.force,
            hub=hub,
            max_rows=args.max_rows,
            progress=True,
        )
    except Refusal:
        raise
    except ValueError as e:  # a bad source or tokenizer: one line, exit status 2, nothing replaced
        raise Refusal(str(e)) from None

    data_dir = f"{args.out}/{profile.name}"
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


if __name__ == "__main__":
    main()
