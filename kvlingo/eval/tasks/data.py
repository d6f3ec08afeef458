"""Evaluation data (IFEval, ARC-Challenge, GSM8K): pinned Hub sources, row checks, prepared copies.

Each data set is named by Hub repo, config, split and revision. `prepare_data` writes
`<root>/<name>/<name>.jsonl` and, last, `<root>/<name>/manifest.json` (origin, resolved
commit sha, row count, file sha256), either from the Hub or from a local JSONL with the
same fields (`--source`). The revisions are "main" because no commit sha could be checked
offline when this was written; each Hub prepare resolves "main" to a commit sha and records
it in the manifest. Pin that sha here before a paper run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...io import atomic_write_json, atomic_write_jsonl, read_json, sha256_file
from .parsers import parse_gold_number


@dataclass(frozen=True)
class HubData:
    name: str  # short name; also the folder and file name under the data root
    repo_id: str  # dataset repository on the Hugging Face Hub
    config: str | None  # dataset config (subset), None for the default
    split: str  # split that is scored
    revision: str  # git revision; only a commit sha pins the data


IFEVAL = HubData("ifeval", "google/IFEval", None, "train", "main")
ARC = HubData("arc", "allenai/ai2_arc", "ARC-Challenge", "test", "main")
GSM8K = HubData("gsm8k", "openai/gsm8k", "main", "test", "main")
DATASETS = {d.name: d for d in (IFEVAL, ARC, GSM8K)}
# Item splits of an evaluation set: choices (defaults, settings) are made on `validation`, claims on `test`.
ITEM_SPLITS = ("all", "validation", "test")


def split_rows(rows: list, split: str) -> list:
    """The rows of an item split, in order: validation the first half, test the second (an odd row to test),
    all of them for "all". The halves are fixed by position, so every stage and run agrees on them."""
    if split not in ITEM_SPLITS:
        raise ValueError(f"item split {split!r} is not one of {ITEM_SPLITS}")
    half = len(rows) // 2
    return rows if split == "all" else rows[:half] if split == "validation" else rows[half:]


def split_suffix(split: str) -> str:
    """The report-name suffix of an item split: none for all, -validation or -test."""
    return "" if split == "all" else f"-{split}"


def check_ifeval_row(row: dict[str, Any], where: str) -> None:
    if not isinstance(row.get("key"), int) or not isinstance(row.get("prompt"), str):
        raise ValueError(f"{where}: an IFEval row needs an int 'key' and a str 'prompt'")
    ids, kw = row.get("instruction_id_list"), row.get("kwargs")
    if not isinstance(ids, list) or not isinstance(kw, list) or len(ids) != len(kw):
        raise ValueError(f"{where}: 'instruction_id_list' and 'kwargs' must be lists of equal length")


def check_arc_row(row: dict[str, Any], where: str) -> None:
    ch = row.get("choices")
    if not isinstance(row.get("question"), str) or not isinstance(ch, dict):
        raise ValueError(f"{where}: an ARC row needs 'question' (str) and 'choices' {{'text': [...], 'label': [...]}}")
    if len(ch.get("text", [])) != len(ch.get("label", [])) or len(ch.get("label", [])) < 2:
        raise ValueError(f"{where}: choices.text and choices.label must have the same length (at least 2)")
    if row.get("answerKey") not in ch["label"]:
        raise ValueError(f"{where}: answerKey {row.get('answerKey')!r} is not one of the labels {ch['label']}")


def check_gsm8k_row(row: dict[str, Any], where: str) -> None:
    if not isinstance(row.get("question"), str) or "####" not in str(row.get("answer", "")):
        raise ValueError(f"{where}: a GSM8K row needs 'question' and an 'answer' ending in '#### <number>'")
    if parse_gold_number(row["answer"]) is None:
        raise ValueError(f"{where}: no number after '####' in the answer")


CHECKS: dict[str, Callable[[dict[str, Any], str], None]] = {
    "ifeval": check_ifeval_row,
    "arc": check_arc_row,
    "gsm8k": check_gsm8k_row,
}


def read_source(path: str | os.PathLike, name: str) -> list[dict[str, Any]]:
    """Rows of a local JSONL, each checked against the data set's format (errors name the line)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"--source {path} does not exist")
    if not path.is_file():
        raise ValueError(f"--source {path} is a folder, not a JSONL file; name the {name} file itself")
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{i} is not valid JSON ({e})") from None
            CHECKS[name](row, f"{path}:{i}")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no rows")
    return rows


def fetch_hub_rows(data: HubData, timeout_s: float = 10.0) -> tuple[list[dict[str, Any]], str]:
    """(rows, commit sha) from the Hub; fails fast offline, naming the --source fix."""
    from ...inputs.models import hub_offline

    toy, target = f"artifacts/toy/corpus/{data.name}.jsonl", "ifeval" if data.name == "ifeval" else "task"
    fix = (
        f"Without Hub access, pass a local JSONL of {data.name} rows with --source PATH (the toy world's, after "
        f"make toy: --source {toy} --data-root data/toy-eval, which make {target} PROFILE=demo runs for you)"
    )
    if hub_offline():
        raise ValueError(f"cannot fetch {data.repo_id}: Hugging Face Hub access is off (HF_HUB_OFFLINE=1). {fix}")
    from huggingface_hub import HfApi

    try:
        commit = HfApi().dataset_info(data.repo_id, revision=data.revision, timeout=timeout_s).sha
        from datasets import load_dataset

        ds = load_dataset(data.repo_id, data.config, split=data.split, revision=commit)
    except Exception as e:  # network, auth or a bad revision: all end the same way
        raise ValueError(f"cannot fetch {data.repo_id}@{data.revision} ({type(e).__name__}: {e}). {fix}") from e
    rows = [dict(r) for r in ds]
    for i, r in enumerate(rows):
        CHECKS[data.name](r, f"{data.repo_id} row {i}")
    return rows, commit


def prepare_data(data: HubData, root: str | os.PathLike, source: str | None = None) -> dict[str, Any]:
    """Write `<root>/<name>/<name>.jsonl`, then its manifest; return the manifest."""
    folder = Path(root) / data.name
    if source:
        rows = read_source(source, data.name)
        origin = {"local_source": str(Path(source).resolve()), "source_sha256": sha256_file(source)}
    else:
        rows, commit = fetch_hub_rows(data)
        origin = {
            "repo_id": data.repo_id,
            "config": data.config,
            "split": data.split,
            "revision_requested": data.revision,
            "commit": commit,
        }
    path = atomic_write_jsonl(folder / f"{data.name}.jsonl", rows)
    manifest = {"data": data.name, "origin": origin, "rows": len(rows), "file": path.name, "sha256": sha256_file(path)}
    atomic_write_json(folder / "manifest.json", manifest)
    return manifest


def prepare_hint(name: str, folder: Path, root: str | os.PathLike) -> str:
    """What to run when `folder` holds no prepared copy of data set `name`: the toy world's copy (offline), or the
    real one (the Hub, or a local JSONL)."""
    script = "ifeval.py" if name == "ifeval" else f"task_eval.py --task {name}"
    prepare = f".venv/bin/python {script} --prepare --data-root {root}"
    return (
        f"{folder} holds no prepared {name} data: for the toy world's copy, offline, run `make toy` then "
        f"`{prepare} --source artifacts/toy/corpus/{name}.jsonl` (the make targets of PROFILE=demo do this); "
        f"for the real data set, `{prepare}` with Hub access, or `--source PATH` with a local JSONL of it"
    )


def load_data(
    data: HubData, root: str | os.PathLike, source: str | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(rows, data provenance) from --source, else from the prepared copy under `root`."""
    if source:
        return read_source(source, data.name), {"source": str(Path(source).resolve()), "sha256": sha256_file(source)}
    folder = Path(root) / data.name
    mpath = folder / "manifest.json"
    if not mpath.exists():
        raise ValueError(prepare_hint(data.name, folder, root))
    manifest = read_json(mpath)
    path = folder / manifest["file"]
    digest = sha256_file(path)
    if digest != manifest["sha256"]:
        raise ValueError(f"{path} does not match its manifest's sha256 (edited or damaged); re-run --prepare")
    info = {"prepared": str(path.resolve()), "sha256": digest, "origin": manifest["origin"]}
    return read_source(path, data.name), info
