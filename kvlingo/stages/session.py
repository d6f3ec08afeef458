"""What the generative evaluations (ifeval.py, task_eval.py) share: their flags, the pair and translator
they answer with, and the checksummed rows log they resume from.

Order of work: the pair is resolved from configs and tokenizers and the translator folder is
checked first (`Session`), which is all a stage needs to know whether its report is up to date
(`Session.up_to_date`); weights load only after that, and after every refusal had its chance
(`Session.load`). Light at the top (no torch): the flags are read before anything heavy loads.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import Refusal
from ..eval.tasks.data import ITEM_SPLITS
from ..inputs.argtypes import whole
from ..inputs.flags import add_refresh_arg
from ..io import sha256_file
from ..records import resume
from ..records.paths import TRANSLATORS, RunPaths, check_outputs

if TYPE_CHECKING:
    from ..eval.itemrows import ItemRows
    from ..eval.tasks.data import HubData

# Stage settings a resume may change: they pick which rows are reported, never what a row holds.
ROW_SAFE = ("settings.limit", "settings.controls", "settings.max_accuracy_loss")


def add_eval_args(ap, items_help: str, data_help: str, data_folder: str) -> None:
    """The flags IFEval and the task evaluation share (besides the common ones: --profile, the pair, the run
    folders, --cache)."""
    ap.add_argument("--limit", type=whole(1), default=None, help=f"{items_help} (default: the profile's)")
    ap.add_argument(
        "--split",
        choices=ITEM_SPLITS,
        default="all",
        help="items scored: all of the data set, its first half (validation: where choices are made) or "
        "its second half (test: where claims are made); reports get a -validation/-test suffix",
    )
    ap.add_argument("--native", action="store_true", help="score the native paths only (native source, native target)")
    ap.add_argument(
        "--translator",
        choices=TRANSLATORS,
        default="distilled",
        help="which translator of the run answers: ARTIFACTS/RUN/{distilled,closed_form}",
    )
    ap.add_argument(
        "--max-new-tokens",
        type=whole(1),
        default=None,
        help="greedy generation cap per answer (default: the profile's max_new_tokens)",
    )
    ap.add_argument(
        "--thinking",
        action="store_true",
        help="render the prompt with enable_thinking=True (default False: an empty think block)",
    )
    ap.add_argument(
        "--resume",
        action="store_true",
        help="keep finished rows whose input hash matches; refuse if a setting, input or the code changed",
    )
    ap.add_argument(
        "--force",
        action="store_true",
        help="run again even when the report is up to date (same settings, inputs, models and code)",
    )
    ap.add_argument(
        "--source",
        default=None,
        metavar="PATH",
        help="local JSONL of the data set's rows (offline); with --prepare, copied into the data root",
    )
    ap.add_argument("--data-root", default="data", help=f"prepared data root: DATA_ROOT/{data_folder}/")
    ap.add_argument(
        "--prepare",
        action="store_true",
        help=f"fetch {data_help} into DATA_ROOT/{data_folder}/ (or copy --source there) and exit",
    )
    add_refresh_arg(ap, default=None, what="the one the run's translator was trained under")
    ap.add_argument(
        "--no-controls",
        action="store_true",
        help="translated runs: skip the control (another item's translated cache) and no-context "
        "(target from the last prompt token alone) paths, which double the generation work",
    )


def prepare_and_exit(data: HubData, args) -> dict[str, Any]:
    """`--prepare`: copy or fetch the data set into DATA_ROOT/<name>/ and say so; returns its manifest (the stage
    then stops)."""
    from ..eval.tasks.data import prepare_data

    # before the data is read or fetched, and without making the folder: a refused prepare leaves nothing behind
    check_outputs(folders=[Path(args.data_root) / data.name], flag="--data-root")
    try:
        manifest = prepare_data(data, args.data_root, args.source)
    except ValueError as e:
        raise Refusal(str(e)) from None
    print(f"wrote {manifest['rows']} {data.name} rows to {Path(args.data_root) / data.name} ({manifest['origin']})")
    return manifest


def control_paths(args, n_items: int) -> tuple[str, ...]:
    """The floors a translated run scores (none for --native, --no-controls or a single item)."""
    from ..eval.tasks.generate import CONTROL_PATHS

    if args.native or args.no_controls:
        return ()
    if n_items < 2:
        print("note: one item only; the control path needs two, so the controls are skipped")
        return ()
    return CONTROL_PATHS


def report_names(stem: str, args) -> tuple[str, str]:
    """(this run's report name, its sibling's): STEM or STEM-native by --native, each with the split's suffix."""
    from ..eval.tasks.data import split_suffix

    own, other = (f"{stem}-native", stem) if args.native else (stem, f"{stem}-native")
    return own + split_suffix(args.split), other + split_suffix(args.split)


def read_items(data: HubData, args, limit: int, what: str) -> tuple[list[dict], dict[str, Any]]:
    """(the first `limit` rows of the item split, the data's provenance): from --source or the prepared copy."""
    from ..eval.tasks.data import load_data, split_rows

    try:
        rows, info = load_data(data, args.data_root, args.source)
    except ValueError as e:
        raise Refusal(str(e)) from None
    rows = split_rows(rows, args.split)
    if limit > len(rows):
        print(f"note: --limit {limit} but the data holds {len(rows)} {what}; scoring all of them")
    return rows[:limit], info


class Session:
    """A checked pair (and translator folder), loaded by `load`, plus the run's rows log and what happened to
    each row."""

    def __init__(self, args, paths: RunPaths):
        from ..inputs.models import pair_config_from_args
        from ..records.saved import MANIFEST_FILE, read_manifest

        self.pair_cfg, self._tokenizer = pair_config_from_args(args)  # refuses a bad pair before any weights load
        self.translator_dir: Path | None = None
        self.translator_info: dict[str, Any] | None = None
        self._manifest_sha: str | None = None
        if not args.native:
            self.translator_dir = paths.translator(args.translator)
            read_manifest(self.translator_dir)  # refuses a missing or damaged translator before any weights load
            self._manifest_sha = sha256_file(self.translator_dir / MANIFEST_FILE)
        if args.refresh is None:  # the translator's own; a native run recomputes everything anyway
            from ..core.settings import Refresh
            from ..records.saved import trained_refresh

            args.refresh = trained_refresh(self.translator_dir) if self.translator_dir else Refresh.parse("none")
        self.pair = self.translator = self.eos = None
        self.log: ItemRows | None = None
        self.counts = {"generated": 0, "resumed": 0, "reused_from_sibling": 0}

    def load(self) -> None:
        """Load the pair's weights and the translator."""
        from ..core.handoff import stop_ids
        from ..inputs.models import load_pair
        from ..records.saved import load_translator

        self.pair = load_pair(self.pair_cfg, self._tokenizer)
        if self.translator_dir is not None:
            self.translator, info = load_translator(self.translator_dir, self.pair)
            self.translator_info = {
                k: info[k] for k in ("path", "family", "key_space", "maps_sha256", "manifest_sha256")
            }
        self.eos = stop_ids(self.pair.tokenizer)

    @property
    def translator_inputs(self) -> dict[str, Any]:
        return {"translator_manifest_sha256": self._manifest_sha}

    @property
    def maps_sha(self) -> str | None:
        """The loaded translator's maps sha256 (None on a native run)."""
        return self.translator_info["maps_sha256"] if self.translator_info else None

    def identity(self, settings: Any, inputs: dict[str, Any], code: str) -> dict[str, Any]:
        """The run's resume identity (settings, inputs, pair, code): its rows log's header and its report's key."""
        return resume.identity(settings, inputs, self.pair_cfg.identities(), code)

    @staticmethod
    def up_to_date(report: Path, ident: dict[str, Any]) -> dict[str, Any] | None:
        """The report when it was made under this identity (`resume.up_to_date`) and its rows log is the one it
        records, unchanged; else None."""
        old = resume.up_to_date(report, resume.resume_key(ident))
        rows = (old or {}).get("inputs", {}).get("rows") or {}
        path = Path(rows.get("path") or "")
        return old if old is not None and path.is_file() and sha256_file(path) == rows.get("sha256") else None

    def say_if_up_to_date(self, report: Path, ident: dict[str, Any], force: bool) -> dict[str, Any] | None:
        """The report, after printing so and its table, when it is up to date (`up_to_date`) and --force was not
        given: the stage then has nothing to do. Else None."""
        old = None if force else self.up_to_date(report, ident)
        if old is None:
            return None
        md = report.with_suffix(".md")
        print(
            f"{report} is up to date (same settings, inputs, models and code); --force re-runs it\n"
            + (md.read_text() if md.is_file() else ""),
            end="",
        )
        return old

    def open_rows(self, path: Path, ident: dict[str, Any], resume_: bool, sibling: Path) -> ItemRows:
        """The rows log, whose header holds this run's resume identity (`identity`)."""
        from ..eval.itemrows import ItemRows

        self.log = ItemRows(path, ident, resume_, donors=[sibling], ignore=ROW_SAFE)
        return self.log

    def finished(self, key: str, make: Callable[[], dict]) -> dict:
        """The row for `key`: resumed, copied from the sibling log, or made now and appended."""
        how = "resumed" if key in self.log else "reused_from_sibling"
        row = self.log.get(key)
        if row is None:
            how, row = "generated", self.log.append(key, make())
        self.counts[how] += 1
        return row

    def rows_input(self) -> dict[str, Any]:
        return {"path": str(self.log.path), "sha256": sha256_file(self.log.path)}

    def rows_summary(self) -> dict[str, Any]:
        """What happened to the rows: generated, resumed, reused from the sibling log; a torn line dropped."""
        return {**self.counts, "dropped_torn_line": self.log.dropped_torn_line}

    def say_counts(self, what: str, sibling: str, report: Path) -> None:
        counts = self.counts
        print(
            f"{what}: {counts['generated']} generated, {counts['resumed']} resumed, {counts['reused_from_sibling']} "
            f"reused from {sibling}.rows.jsonl; report {report}"
        )
