"""Where a run's files live, decided in one place.

    ARTIFACTS/RUN/closed_form/   translator fitted in closed form
    ARTIFACTS/RUN/distilled/     the same after distillation
    ARTIFACTS/RUN/checkpoints/   distillation checkpoints
    RESULTS/RUN/<stage>.json     each stage's report (with .md, .png and .rows.jsonl beside it)
    DATA/<profile>/              prepared chat data (prepare.py)

RUN defaults to PROFILE-DIRECTION (`default_run`); every stage takes the same three flags
(`add_run_args`: --run, --artifacts, --results) and builds its folders with `RunPaths`.
A run nested in another (the recipe's cells) is just a longer run name, `RUN/cell`.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import RunRefused
from ..io import mib

MAPS_FILE = "maps.safetensors"  # a translator folder's state dict
MANIFEST_FILE = "manifest.json"  # written after it, last: its presence marks a complete translator folder

TRANSLATORS = ("closed_form", "distilled")  # the translator folders a training run writes


def default_run(profile: str, direction: str) -> str:
    return f"{profile}-{direction}"


def default_data(profile: str, root: str | Path = "data") -> Path:
    return Path(root) / profile


@dataclass(frozen=True)
class RunPaths:
    run: str  # run name; may hold '/' for a run nested in another
    artifacts_root: str = "artifacts"
    results_root: str = "results"

    def __post_init__(self):
        parts = Path(self.run).parts
        if not self.run.strip() or Path(self.run).is_absolute() or ".." in parts or "." in self.run.split("/"):
            raise RunRefused(
                f"run name {self.run!r} must be a relative name such as pilot-l2s or qwen/lr1e-3 (no "
                "leading '/', no '.' or '..' parts): a run's files stay under --artifacts and --results"
            )

    @property
    def art(self) -> Path:
        return Path(self.artifacts_root) / self.run

    @property
    def res(self) -> Path:
        return Path(self.results_root) / self.run

    def translator(self, kind: str = "distilled") -> Path:
        if kind not in TRANSLATORS:
            raise ValueError(f"translator {kind!r} is not one of {TRANSLATORS}")
        return self.art / kind

    def translators(self, kinds=TRANSLATORS) -> tuple[dict[str, Path], list[str]]:
        """({kind: folder} of the complete translators among `kinds`, [kinds that are missing])."""
        found = {k: self.translator(k) for k in kinds if (self.translator(k) / MANIFEST_FILE).is_file()}
        return found, [k for k in kinds if k not in found]

    @property
    def checkpoints(self) -> Path:
        return self.art / "checkpoints"

    def report(self, stem: str) -> Path:
        return self.res / f"{stem}.json"

    def beside(self, stem: str, suffix: str) -> Path:
        """A file next to a report: results/RUN/<stem><suffix> (.md, .png, .rows.jsonl)."""
        return self.res / f"{stem}{suffix}"

    def nested(self, name: str) -> RunPaths:
        return RunPaths(f"{self.run}/{name}", self.artifacts_root, self.results_root)


def writable(folder: str | Path, flag: str) -> Path:
    """`folder`, made (with its parents) and checked by creating and removing a file in it; RunRefused
    naming the folder, the reason and `flag` when that fails."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as e:
        raise RunRefused(
            f"cannot write to {folder} ({e.strerror or e}); give {flag} a folder you can write to"
        ) from None
    return folder


def _existing_ancestor(path: Path) -> Path:
    """The nearest folder at or above `path` that exists (where its missing folders would be made)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return path


def check_outputs(
    files: Iterable[str | Path] = (), folders: Iterable[str | Path] = (), flag: str = "--results", need_bytes: int = 0
) -> None:
    """Refuse (RunRefused, one line naming the path and `flag`, the flag that chose it) outputs a stage could
    not write, before any model loads and without making anything: a file path that is a folder, a folder
    path (or a file's folder) that is a file, a folder that cannot be written (read-only, no permission:
    checked by making and removing a file in the nearest existing folder), or, given `need_bytes` (what
    the stage will write there, where it is known), too little free space."""
    files, folders = [Path(f) for f in files], [Path(f) for f in folders]
    for f in files:
        if f.is_dir():
            raise RunRefused(
                f"{f} is a folder, but the stage writes a file there: remove it (rmdir {f}) or give "
                f"{flag} or --run another name"
            )
    for d in folders + [f.parent for f in files]:
        above = next((p for p in [d, *d.parents] if p.exists()), None)
        if above is not None and not above.is_dir():
            raise RunRefused(
                f"{above} is a file, but the stage writes into a folder there: move it away or give "
                f"{flag} another folder"
            )
    roots = {_existing_ancestor(d) for d in folders + [f.parent for f in files]}
    for root in sorted(roots):
        try:
            with tempfile.NamedTemporaryFile(dir=root, prefix=".write-check-"):
                pass
        except OSError as e:
            raise RunRefused(
                f"cannot write to {root} ({e.strerror or e}); give {flag} a folder you can write to"
            ) from None
    if need_bytes > 0:
        for root in sorted(roots):
            free = shutil.disk_usage(root).free
            if free < need_bytes:
                raise RunRefused(
                    f"{root} has {mib(free)} free, but this stage writes about {mib(need_bytes)} "
                    f"there; free some space or give {flag} a folder on a larger disk"
                )


# The Makefile's defaults for the pair variables: PROFILE=demo runs on the toy world on the CPU.
MAKE_DEFAULTS = {
    "demo": {
        "LARGE": "artifacts/toy/large",
        "SMALL": "artifacts/toy/small",
        "DIRECTION": "l2s",
        "DEVICE": "cpu",
        "DTYPE": "float32",
    },
    None: {
        "LARGE": "Qwen/Qwen3-1.7B",
        "SMALL": "Qwen/Qwen3-0.6B",
        "DIRECTION": "l2s",
        "DEVICE": "auto",
        "DTYPE": "bfloat16",
    },
}


def make_command(targets: str, run: str, profile: str | None, pair: Any = None) -> str:
    """`make TARGETS PROFILE=… RUN=…` as a stage suggests it to the user: with the pair's models (LARGE, SMALL) and
    whichever of DIRECTION, DEVICE and DTYPE differ from the Makefile's defaults for the profile, so that it runs
    as given. `pair` is a PairConfig or its dict in a report (None: the profile's defaults)."""
    words = [f"make {targets}", *([f"PROFILE={profile}"] if profile else []), f"RUN={run}"]
    if pair is not None:
        get = pair.get if isinstance(pair, dict) else lambda k: getattr(pair, k)
        defaults = MAKE_DEFAULTS.get(profile, MAKE_DEFAULTS[None])
        given = {
            "LARGE": get("large"),
            "SMALL": get("small"),
            "DIRECTION": get("direction"),
            "DEVICE": str(get("device")).split(":")[0],
            "DTYPE": get("dtype"),
        }
        words += [f"{k}={v}" for k, v in given.items() if k in ("LARGE", "SMALL") or v != defaults[k]]
    return " ".join(words)


def add_run_args(parser, required: bool = False) -> None:
    """--run, --artifacts and --results: the same three flags on every stage."""
    parser.add_argument(
        "--run",
        required=required,
        default=None,
        help="run name: files go to ARTIFACTS/RUN/ and RESULTS/RUN/ (default PROFILE-DIRECTION)",
    )
    parser.add_argument("--artifacts", default="artifacts", help="artifacts root: translators and checkpoints")
    parser.add_argument("--results", default="results", help="results root: reports")


def run_paths(args) -> RunPaths:
    """RunPaths of parsed stage flags (--run, or PROFILE-DIRECTION from --profile and --direction)."""
    run = args.run or default_run(args.profile, args.direction)
    return RunPaths(run, args.artifacts, args.results)
