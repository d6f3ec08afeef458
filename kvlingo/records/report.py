"""The one report schema every stage writes, its provenance, and the small formatters of its tables.

A report is a `Report`: what ran (stage, config), on what (inputs with their hashes), where
(env: git sha and dirty flag, library versions, device, dtype, threads), what came out
(results, one dataclass per stage), how much of it (n_samples), and which direction each
headline metric should move (`metrics`). Raw per-item rows go in a file beside the report,
named with its sha256 in `files`; the report is written last, so its presence marks a
finished stage.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import Failure, Refusal
from ..io import (
    ROOT,
    DamagedFile,
    atomic_write_json,
    atomic_write_jsonl,
    atomic_write_text,
    read_json,
    sha256_file,
    sha256_json,
    to_jsonable,
)

SCHEMA_VERSION = 3  # 3: every report is sealed by its content hash (`sealed`)
CONTENT_HASH = "content_sha256"  # a report's (manifest's, export config's) own hash: its canonical JSON without it


@dataclass(frozen=True)
class Metric:
    """One headline number of a stage's results: where it lives and which way is better."""

    name: str  # dotted path inside `results`, e.g. "distilled_val_kl" or "arms.distilled.kl_token_mean"
    higher_is_better: bool
    definition: str


# --------------------------------------------------------------------------- provenance
def git_state(root: str | os.PathLike = ROOT) -> dict[str, Any]:
    def run(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    sha = run("rev-parse", "HEAD")
    status = run("status", "--porcelain", "--untracked-files=no")
    return {"git_sha": sha, "git_dirty": bool(status) if status is not None else None}


THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages(setting: str | os.PathLike = THP_SETTING) -> dict[str, Any]:
    """Whether torch's CPU allocator asks for transparent huge pages (THP_MEM_ALLOC_ENABLE=1 in this process's
    environment; torch reads it once, at its first allocation) and the kernel's THP mode (always, madvise or
    never; None off Linux). Large CPU tensors on huge pages take far fewer page faults and TLB misses, so
    CPU timings depend on both."""
    try:
        text = Path(setting).read_text()
        kernel = text[text.index("[") + 1 : text.index("]")]
    except (OSError, ValueError):
        kernel = None
    return {"torch_allocator": os.environ.get("THP_MEM_ALLOC_ENABLE") == "1", "kernel": kernel}


def environment(device: str | None = None, dtype: str | None = None, cache: str | None = None) -> dict[str, Any]:
    import torch
    import transformers

    env: dict[str, Any] = {
        **git_state(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device,
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "huge_pages": huge_pages(),
        "cache": cache,  # the KV cache kind its handoffs built (its pair config's, --cache; None without a pair)
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),  # data-parallel ranks (torchrun)
    }
    if device and device.startswith("cuda") and torch.cuda.is_available():
        env["device_name"] = torch.cuda.get_device_name(0)
    return env


# --------------------------------------------------------------------------- the schema
# --------------------------------------------------------------------------- seals
def sealed(meta: dict[str, Any]) -> dict[str, Any]:
    """`meta` with its content hash (CONTENT_HASH) set: how a report, a translator manifest or an export config is
    written, so that an edit of any field after it was written is found where it is read (`seal_problem`)."""
    body = {k: v for k, v in to_jsonable(meta).items() if k != CONTENT_HASH}
    return {**body, CONTENT_HASH: sha256_json(body)}


def seal_problem(meta: dict[str, Any]) -> str | None:
    """Why `meta` (as read) is not as it was written, or None: every field counts, so an edit of any of them (a
    figure, a setting, the provenance) is found."""
    recorded = meta.get(CONTENT_HASH)
    if recorded is None:
        return f"it records no {CONTENT_HASH} (written by older code)"
    if recorded != sha256_json({k: v for k, v in meta.items() if k != CONTENT_HASH}):
        return f"it was edited after it was written (its {CONTENT_HASH} does not match its fields)"
    return None


@dataclass
class Report:
    stage: str  # which stage wrote it (prepare, train, benchmark, ...)
    config: Any  # the stage's frozen config dataclass (the pair config nested in it)
    inputs: dict[str, Any]  # every input by name, each with its sha256 (or a dict holding one)
    results: Any  # the stage's results dataclass
    n_samples: dict[str, Any]  # sample sizes behind the results
    wall_time_s: float
    device: str | None = None
    dtype: str | None = None
    seeds: Any = None
    resume_key: str | None = None  # the resume key (kvlingo.records.resume) the outputs were made under
    identity: dict | None = None  # what the key is the hash of (resume.identity): a later run names what changed
    metrics: tuple[Metric, ...] = ()  # directions of the headline numbers in `results`
    files: dict[str, str] = field(default_factory=dict)  # output files beside the report → sha256

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "stage": self.stage,
            "created_unix": time.time(),
            "config": to_jsonable(self.config),
            "config_sha256": sha256_json(self.config),
            "inputs": to_jsonable(self.inputs),
            "env": environment(self.device, self.dtype, getattr(getattr(self.config, "pair", None), "cache", None)),
            "seeds": to_jsonable(self.seeds),
            "n_samples": to_jsonable(self.n_samples),
            "wall_time_s": self.wall_time_s,
            "resume_key": self.resume_key,
            **({"identity": to_jsonable(self.identity)} if self.identity is not None else {}),
            "metrics": {
                m.name: {"higher_is_better": m.higher_is_better, "definition": m.definition} for m in self.metrics
            },
            "files": dict(self.files),
            "results": to_jsonable(self.results),
        }

    def write(self, path: str | os.PathLike) -> dict[str, Any]:
        """Write the report atomically, sealed by its content hash (`sealed`); return what was written."""
        data = sealed(self.to_dict())
        atomic_write_json(path, data)
        return data


def publish(
    report: Report,
    path: str | os.PathLike,
    rows: list | None = None,
    markdown: str | None = None,
    echo: bool = True,
    checks: dict | None = None,
) -> dict[str, Any]:
    """A stage's outputs in order: the rows file and the markdown summary beside the report, then the
    report itself (last: its presence marks a finished stage, and it holds the rows file's sha256).

    With `checks` ({"passed", "failed"}), a failed check ends the stage with exit status 1 once
    everything is written.
    """
    path = Path(path)
    stem = path.name.removesuffix(".json")
    if rows is not None:
        rows_path = path.with_name(f"{stem}.rows.jsonl")
        atomic_write_jsonl(rows_path, rows)
        report.files[rows_path.name] = sha256_file(rows_path)
    if markdown is not None:
        atomic_write_text(path.with_name(f"{stem}.md"), markdown)
        if echo:
            print(markdown)
    data = report.write(path)
    if echo:
        print(f"wrote {path}")
    if checks is not None and not checks["passed"]:
        raise Failure("checks failed: " + "; ".join(checks["failed"]))
    return data


class ReportError(Refusal, ValueError):
    """A report that cannot be read, or is of another stage (one of the stages' refusals)."""


def read_report(path: str | os.PathLike, stage: str | None = None) -> dict[str, Any]:
    """A report from disk, refusing one of another stage. ReportError names the file, the problem and the fix."""
    if Path(path).is_dir():
        raise ReportError(
            f"{path} is a folder, not a report: remove it (rmdir {path}) and rerun the stage that writes it"
        )
    try:
        data = read_json(path)
    except DamagedFile as e:
        raise ReportError(f"{e.problem}: rerun the stage that wrote it") from None
    except OSError as e:
        raise ReportError(f"{path}: not a readable report ({e.strerror or e})") from None
    if stage is not None and (not isinstance(data, dict) or data.get("stage") != stage):
        got = data.get("stage") if isinstance(data, dict) else type(data).__name__
        raise ReportError(f"{path} is a {got!r} report, not {stage!r}; rerun the {stage} stage")
    problem = seal_problem(data) if isinstance(data, dict) else f"it is a {type(data).__name__}, not a report"
    if problem:
        raise ReportError(f"{path}: {problem}; rerun the stage that wrote it (its figures are not trusted)")
    return data


# --------------------------------------------------------------------------- formatting
def figure(figsize: tuple[float, float] = (6.5, 4.2), ncols: int = 1):
    """(fig, axes) of a new matplotlib figure drawn off-screen (the Agg backend); `figure_png` writes and closes it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=figsize)


def figure_png(fig, rect: tuple[float, float, float, float] = (0, 0, 1, 1)) -> bytes:
    """A matplotlib figure as PNG bytes (then closed), ready for `atomic_write_bytes`; its axes are laid out
    inside `rect` (a figure legend or caption goes outside it)."""
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout(rect=rect)
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    return buf.getvalue()


def fmt_table(headers: list[str], rows: list[list[Any]], floatfmt: str = ".4g") -> str:
    """A small GitHub-markdown table (also readable on stdout)."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return format(v, floatfmt)
        return "" if v is None else str(v)

    body = [[cell(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in body)]) + "\n"


def fmt_interval(interval: Any, fmt: str = ".3g", missing: str = "") -> str:
    """[lo, hi] as 'lo–hi'; `missing` for none (e.g. a baseline's speedup against itself)."""
    if not interval or len(interval) != 2:
        return missing
    return f"{interval[0]:{fmt}}–{interval[1]:{fmt}}"


def fmt_pm(stat: Any, scale: float = 1.0, fmt: str = ".4g", se_fmt: str | None = None, missing: str = "—") -> str:
    """'mean ± SE' of a `stats.mean_se` dict, both times `scale`; the SE is left out when it is NaN,
    and `missing` stands for no value at all (None, no mean, or n = 0)."""
    if not isinstance(stat, dict) or stat.get("mean") is None or stat.get("n") == 0:
        return missing
    mean, se = scale * stat["mean"], stat.get("se")
    if not isinstance(se, (int, float)) or se != se:
        return f"{mean:{fmt}}"
    return f"{mean:{fmt}} ± {scale * se:{se_fmt or fmt}}"
