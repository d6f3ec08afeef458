"""Resume by hash: one identity per stage run, one key from it, one diff and one refusal.

A stage's identity is everything its outputs depend on:

    {"settings": the stage's config (the pair config nested in it, with the KV cache kind its
                 handoffs build: the two kinds run different code on the handoff's path),
     "inputs":   {name: sha256 or {path, sha256, ...}} of every file it reads,
     "pair":     the source and target identities (Hub id + revision, or a weights digest),
     "code":     `code_hash` of the stage script and the kvlingo modules it imports}

`resume_key(identity)` is its canonical sha256. The same three answers come from it
everywhere: a finished output whose recorded key equals the current one is up to date;
an interrupted one with an equal key is resumed; any difference is refused with
`ResumeRefused`, whose message names every changed leaf (`diff`) and the fix.

Code hash. A stage hashes its own script plus the closure of `kvlingo` modules it imports,
found statically from the import statements of each file (function-level imports
included) and from the strings that name a module of the package for a lazy import
("kvlingo.core.families.tokeninput.maps:TokenInput", the families' maps), so an edit to a
module the stage never imports (the toy world, say) leaves its key alone, and the hash does
not depend on which branch happened to import what.
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..errors import Refusal
from ..io import ROOT, sha256_json, sha256_tree, to_jsonable

PACKAGE = "kvlingo"


class ResumeRefused(Refusal, ValueError):
    """A resume (or an up-to-date check) against outputs made from other settings, inputs, models or code."""


# --------------------------------------------------------------------------- code hash
def _module_file(name: str) -> Path | None:
    """The source file of module `name` (dotted) inside the package, or None when it is not ours."""
    if name != PACKAGE and not name.startswith(PACKAGE + "."):
        return None
    base = ROOT / Path(*name.split("."))
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _module_name(path: Path) -> str:
    rel = path.resolve().relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


LAZY = re.compile(rf"({PACKAGE}(?:\.\w+)+)(?::\w+)?")  # "kvlingo.a.b" or "kvlingo.a.b:Name", imported on use


def _imports(path: Path) -> set[str]:
    """Dotted names of every module a file imports (absolute and relative, at any depth), and of every module a
    string constant names in full (`LAZY`: a lazy import by name, as the families declare their maps)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    here = _module_name(path) if path.resolve().is_relative_to(ROOT / PACKAGE) else ""
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if package else []
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)  # `from pkg import module`
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (m := LAZY.fullmatch(node.value)):
            out.add(m.group(1))
    return out


def imported_files(*scripts: str | os.PathLike) -> list[Path]:
    """The scripts plus every kvlingo source file they import, directly or not, sorted."""
    todo = [ROOT / s if not Path(s).is_absolute() else Path(s) for s in scripts]
    seen: set[Path] = set()
    while todo:
        path = todo.pop().resolve()
        if path in seen:
            continue
        seen.add(path)
        for name in _imports(path):
            # Importing a.b.c runs a/__init__ and a/b/__init__ too.
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                f = _module_file(".".join(parts[:i]))
                if f is not None and f.resolve() not in seen:
                    todo.append(f)
    return sorted(seen)


def code_hash(*scripts: str | os.PathLike) -> str:
    """sha256 over the scripts and the kvlingo modules they import (relative names from the repository root)."""
    return sha256_tree(imported_files(*scripts))


# --------------------------------------------------------------------------- identity and key
def identity(settings: Any, inputs: dict[str, Any], pair: Any, code: str) -> dict[str, Any]:
    """What a stage's result depends on."""
    return to_jsonable({"settings": settings, "inputs": inputs, "pair": pair, "code": code})


def resume_key(ident: dict[str, Any]) -> str:
    return sha256_json(ident)


def finished(report_path: str | os.PathLike, key: str) -> dict[str, Any] | None:
    """The report at `report_path` when it was made under resume key `key`, its checks passed and the files it
    lists beside itself (rows, figures) still hold what it recorded (up to date), else None: also for a report
    that does not parse or was edited out of shape (it is made again)."""
    from ..io import read_json

    try:
        old = read_json(report_path)
    except (OSError, ValueError):
        return None
    if not isinstance(old, dict) or old.get("resume_key") != key:
        return None
    changed = changed_files(report_path, old)
    if changed:
        print(f"{changed}: made again")
        return None
    checks = old.get("results", {}).get("checks") if isinstance(old.get("results"), dict) else None
    return old if isinstance(checks, dict) and checks.get("passed") is True else None


def changed_files(report_path: str | os.PathLike, report: dict[str, Any]) -> str | None:
    """Which file a report lists beside itself (`files`: name → sha256) is missing or no longer holds what it
    recorded, in words, or None when all are as recorded."""
    from ..io import sha256_file

    files = report.get("files")
    for name, sha in files.items() if isinstance(files, dict) else []:
        path = Path(report_path).parent / str(name)
        if not path.is_file():
            return f"{path}, which {Path(report_path).name} lists, is missing"
        if sha256_file(path) != sha:
            return f"{path} changed since {Path(report_path).name} recorded it"
    return None


def up_to_date(
    report_path: str | os.PathLike, key: str, identity: dict | None = None, say: Callable[[str], None] | None = print
) -> dict[str, Any] | None:
    """The report at `report_path` when it is as it was written (its seal), was made under resume key `key`, none of
    its checks or its gate failed, and every file it lists beside itself (`files`: name → sha256) is there
    unchanged; else None (the stage runs again), and `say` names why when a report was there: the fields a
    changed `identity` differs in (from the one the report records), an edit, a failed check, a changed file.
    A stage's own outputs elsewhere (maps) are its to check."""
    from ..io import read_json
    from .report import seal_problem

    path = Path(report_path)
    say = say or (lambda _message: None)
    if not path.exists():
        return None
    try:
        old = read_json(path)
    except (OSError, ValueError):
        say(f"{path} does not parse: making it again")
        return None
    problem = seal_problem(old) if isinstance(old, dict) else "it is not a report"
    if problem:
        say(f"{path}: {problem}: making it again")
        return None
    if old.get("resume_key") != key:
        changes = diff(old["identity"], identity) if isinstance(old.get("identity"), dict) and identity else []
        what = "; ".join(changes[:6]) + ("; …" if len(changes) > 6 else "") if changes else "its key differs"
        say(f"{path} was made from other settings, inputs, models or code ({what}): making it again")
        return None
    results = old.get("results") if isinstance(old.get("results"), dict) else {}
    if any(isinstance(v, dict) and v.get("passed") is False for v in (results.get("checks"), results.get("gate"))):
        say(f"{path}: its checks or gate failed last time: making it again")
        return None
    changed = changed_files(path, old)
    if changed:
        say(f"{changed}: making it again")
        return None
    return old


def _short(v: Any) -> str:
    s = str(v)
    return s[:12] + "…" if len(s) == 64 and all(c in "0123456789abcdef" for c in s) else s


def diff(old: Any, new: Any, prefix: str = "", ignore: Iterable[str] = ()) -> list[str]:
    """'name: old → new' for every leaf that differs between two JSON-able trees (dotted names).

    Leaves named in `ignore` (full dotted names) are skipped.
    """
    old, new, ignore = to_jsonable(old), to_jsonable(new), set(ignore)
    if prefix in ignore:
        return []
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new)):
            name = f"{prefix}.{k}" if prefix else str(k)
            out += diff(old.get(k, "(absent)"), new.get(k, "(absent)"), name, ignore)
        return out
    return [] if old == new else [f"{prefix or 'value'}: {_short(old)} → {_short(new)}"]


def describe(changes: list[str]) -> str:
    """Group `diff` lines by what changed (settings, inputs, pair, code) for a refusal message."""
    words = {"settings": "settings changed", "inputs": "data changed", "pair": "models changed", "code": "code changed"}
    parts = []
    for line in changes:
        head = line.split(".")[0].split(":")[0]
        parts.append(f"{words.get(head, 'changed')}: {line}")
    return "; ".join(parts)


def check(
    saved: dict[str, Any] | None,
    current: dict[str, Any],
    what: str,
    fix: str = "start a fresh run (drop --resume) or restore the original inputs",
    ignore: Iterable[str] = (),
) -> None:
    """Raise ResumeRefused unless `saved` equals `current` (up to `ignore`), naming every change."""
    if saved is None:
        raise ResumeRefused(f"refusing to resume {what}: it records no identity (made by older code); {fix}")
    changes = diff(saved, current, ignore=ignore)
    if changes:
        raise ResumeRefused(f"refusing to resume {what}: {describe(changes)}; {fix}")
