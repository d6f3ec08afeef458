"""The saved translator: its folder, its evidence and its export, in one place.

folder    MAPS_FILE (the state dict), then MANIFEST_FILE, written last, so its presence marks a
          complete translator. The manifest records the family, key space, settings and
          geometry, the sha256 of the maps, and whatever provenance the writer adds (direction,
          model identities, data and code hashes), sealed by its own content hash
          (`CONTENT_HASH`): an edit of any field is refused where it is read. `load_translator`
          is the one loader.
evidence  what a run measured about a translator, taken from its reports, never typed in: the
          benchmark's acceptance arms on the held-out test split (native target, translated,
          control, no context; each with n, token-level KL, per-conversation KL ± SE, top-1
          agreement and NLL Δ), whether its native controls passed, and IFEval's strict
          prompt-level accuracy ± SE when the run has one. The gate (`Gate`, `judge`) reads the
          figures, not a stored verdict, and names each failing one.
export    a finished run's translator as a folder that can be shared (save_pretrained style):

              maps.safetensors  the translator's state, byte for byte the run's
              evidence.json     the evidence and the gate's verdict
              README.md         a model card generated from config and evidence
              config.json       written last: every manifest field the loader reads, the pair
                                (ids with revisions or weights digests, tokenizer digest, the
                                dtype it was measured in), its training provenance, the sha256
                                of the maps and evidence, and its own content hash

          so an exported folder loads through `load_translator` unchanged. A re-export first
          removes config.json: a folder caught half-written is never taken for a complete one.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.families import FAMILIES  # every family registered
from ..core.keyspace import KEY_SPACES
from ..core.settings import Refresh
from ..core.translator import Geometry, Translator, TranslatorError
from ..io import (
    DamagedFile,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    not_ours,
    read_json,
    sha256_bytes,
    sha256_file,
)
from .paths import MANIFEST_FILE, MAPS_FILE, TRANSLATORS, RunPaths, make_command
from .report import CONTENT_HASH, fmt_pm, fmt_table, read_report, seal_problem, sealed

# =========================================================================== the folder


# --------------------------------------------------------------------------- folders
def state_bytes(translator: Translator) -> bytes:
    """The bytes `save_translator` writes as maps.safetensors (so their sha256 is known before writing)."""
    from safetensors.torch import save

    return save({k: v.detach().cpu().contiguous() for k, v in translator.state_dict().items()})


def save_translator(folder: str | Path, translator: Translator, provenance: dict[str, Any]) -> Path:
    """maps.safetensors, then manifest.json (last: its presence marks a complete translator)."""
    folder = Path(folder)
    atomic_write_bytes(folder / MAPS_FILE, state_bytes(translator))
    manifest = {
        **provenance,
        **translator.spec(),
        "n_params": translator.n_params(),
        "maps_sha256": sha256_file(folder / MAPS_FILE),
    }
    atomic_write_json(folder / MANIFEST_FILE, sealed(manifest))
    return folder


def read_manifest(folder: str | Path, name: str = MANIFEST_FILE) -> dict[str, Any]:
    """A translator folder's manifest (`name`: manifest.json, or an export's config.json), after checking it
    against its own content hash and the maps file against the hash it records."""
    folder = Path(folder)
    mpath = folder / name
    if not mpath.is_file():
        raise TranslatorError(
            f"{folder} holds no {name}: not a complete translator; train it first "
            "(make train RUN=...) or name a run that has one"
        )
    try:
        manifest = read_json(mpath)
    except DamagedFile as e:
        raise TranslatorError(f"{e.problem}: the translator folder is damaged; train or export it again") from None
    problem = (
        seal_problem(manifest) if isinstance(manifest, dict) else f"it is a {type(manifest).__name__}, not a mapping"
    )
    if problem:
        raise TranslatorError(f"{mpath}: {problem}; train or export it again")
    if manifest.get("family") not in FAMILIES:
        raise TranslatorError(
            f"{mpath}: unknown translator family {manifest.get('family')!r} "
            f"(known: {', '.join(sorted(FAMILIES))}); it was written by other code"
        )
    if not (folder / MAPS_FILE).is_file() or sha256_file(folder / MAPS_FILE) != manifest.get("maps_sha256"):
        raise TranslatorError(
            f"{folder / MAPS_FILE} does not match its manifest hash in {name} (damaged or replaced); "
            "train or export it again"
        )
    try:
        check_state(folder / MAPS_FILE, build(manifest, device="meta"))
    except TranslatorError as err:
        raise TranslatorError(
            f"{mpath}: {err}; it was written by other code or edited: train or export it again"
        ) from None
    return manifest


def build(manifest: dict[str, Any], device: str | torch.device | None = None) -> Translator:
    """An untrained translator of the manifest's family, settings and geometry (state not loaded); on
    device="meta" nothing is allocated. A spec that does not build one (a field missing or of the wrong
    kind, settings the family does not take) is refused with a TranslatorError naming it."""
    cls = FAMILIES[manifest["family"]]
    geometry, fields = manifest.get("geometry"), list(Geometry.__dataclass_fields__)
    if not (
        isinstance(geometry, dict)
        and sorted(geometry) == sorted(fields)
        and all(type(geometry[f]) is int and geometry[f] > 0 for f in fields)
    ):
        raise TranslatorError(f"geometry {geometry!r} is not {{{', '.join(fields)}}} as positive integers")
    if manifest.get("key_space") not in KEY_SPACES:
        raise TranslatorError(f"key space {manifest.get('key_space')!r} is not one of {', '.join(KEY_SPACES)}")
    settings = manifest.get("settings", {})
    if not isinstance(settings, dict):
        raise TranslatorError(f"settings {settings!r} are not a mapping of the {cls.name} family's options")
    try:
        with torch.device(device) if device is not None else contextlib.nullcontext():
            return cls.from_spec(Geometry(**geometry), manifest["key_space"], settings)
    except (TypeError, ValueError) as err:
        raise TranslatorError(f"settings {settings} do not build a {cls.name} translator ({err})") from None


def check_state(path: Path, translator: Translator) -> None:
    """Refuse (TranslatorError) a safetensors file whose tensor names, shapes or dtypes are not `translator`'s
    state (read from the file's header alone: nothing is loaded)."""
    from safetensors import SafetensorError, safe_open

    expected = {k: (tuple(v.shape), v.dtype) for k, v in translator.state_dict().items()}
    try:
        with safe_open(str(path), framework="pt") as f:
            found = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    except (SafetensorError, OSError) as err:
        raise TranslatorError(f"{path.name} is not a readable safetensors file ({err})") from None
    names = {
        torch.float32: "F32",
        torch.float64: "F64",
        torch.bfloat16: "BF16",
        torch.float16: "F16",
        torch.int64: "I64",
        torch.int32: "I32",
        torch.int16: "I16",
        torch.int8: "I8",
        torch.uint8: "U8",
        torch.bool: "BOOL",
    }  # safetensors' names of the dtypes
    wrong = [f"missing {k}" for k in expected if k not in found] + [
        f"unexpected {k}" for k in found if k not in expected
    ]
    wrong += [
        f"{k} is {found[k][1]} {list(found[k][0])}, not {names.get(dt, dt)} {list(shape)}"
        for k, (shape, dt) in expected.items()
        if k in found and found[k] != (shape, names.get(dt, dt))
    ]
    if wrong:
        shown = "; ".join(wrong[:4]) + (f"; and {len(wrong) - 4} more" if len(wrong) > 4 else "")
        raise TranslatorError(f"{path.name} does not hold this {translator.family} translator's state ({shown})")


def load_state(folder: str | Path, manifest: dict[str, Any] | None = None, device="cpu") -> Translator:
    """A translator from a folder, state loaded, not bound to any models."""
    from safetensors.torch import load_file

    folder = Path(folder)
    manifest = manifest or read_manifest(folder)
    translator = build(manifest)
    state = load_file(folder / MAPS_FILE)
    bad = [k for k, v in state.items() if not torch.isfinite(v).all()]
    if bad:
        raise TranslatorError(
            f"{folder / MAPS_FILE}: {', '.join(bad[:4])} hold NaN or infinite values; train or "
            "export the maps again (a run whose loss diverged writes such maps)"
        )
    translator.load_state_dict(state, strict=True)
    return translator.to(device)


def same_model(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two model identities name one model: local folders by their weights digest alone (a copied
    or moved folder holds the same model), Hub models by id and revision."""
    if "weights_sha256" in a and "weights_sha256" in b:
        return a["weights_sha256"] == b["weights_sha256"]
    return a == b


def check_expected(
    manifest: dict[str, Any],
    *,
    family: str | None = None,
    key_space: str | None = None,
    direction: str | None = None,
    models: dict[str, Any] | None = None,
    geometry: Geometry | None = None,
    pair_fix: str = "check --large/--small/--direction",
) -> None:
    """Refuse a translator made for another family, key space, direction, pair or geometry (TranslatorError
    naming the field, both values and the fix). Fields the manifest does not record are not compared.
    `pair_fix` is the fix for another pair's geometry in the words of the caller's inputs (the stages' flags
    by default; kvlingo.Relay names its large=/small= arguments)."""
    if family is not None and manifest["family"] != family:
        raise TranslatorError(
            f"translator family is {manifest['family']!r}, this run asks for {family!r}; "
            f"pass --family {manifest['family']} or train a {family} translator"
        )
    if key_space is not None and manifest.get("key_space") != key_space:
        raise TranslatorError(
            f"translator key space is {manifest.get('key_space')!r}, this run asks for "
            f"{key_space!r}; pass --key-space {manifest.get('key_space')} or train one in {key_space!r}"
        )
    if direction and manifest.get("direction") not in (None, direction):
        raise TranslatorError(
            f"translator was trained for direction {manifest['direction']!r}, this run is "
            f"{direction!r}; pass --direction {manifest['direction']} or train one for this direction"
        )
    if geometry is not None and Geometry(**manifest["geometry"]) != geometry:
        raise TranslatorError(
            f"translator geometry {manifest['geometry']} does not fit this pair's "
            f"{asdict(geometry)}: it was trained for another pair; {pair_fix}"
        )
    for role, ident in (models or {}).items():
        trained = manifest.get("models", {}).get(role)
        if trained is not None and not same_model(trained, ident):
            raise TranslatorError(
                f"translator was trained for another {role} model ({trained}), not {ident}; "
                "use one trained for this pair"
            )


def trained_refresh(*folders: str | Path) -> Refresh:
    """The refresh the translators in `folders` were trained (and validated) under: the one their handoffs run
    under unless a stage's --refresh says otherwise. Refused when they disagree."""
    found = {}
    for folder in folders:
        text = (read_manifest(folder).get("config") or {}).get("refresh") or "none"
        found.setdefault(str(Refresh.parse(text)), []).append(str(folder))
    if len(found) > 1:
        raise TranslatorError(
            "the translators were trained under different refresh settings ("
            + "; ".join(f"{k}: {', '.join(v)}" for k, v in found.items())
            + "): pass --refresh to score them under one"
        )
    return Refresh.parse(next(iter(found), "none"))


def load_translator(
    folder: str | Path,
    pair,
    *,
    family: str | None = None,
    key_space: str | None = None,
    manifest_file: str = MANIFEST_FILE,
) -> tuple[Translator, dict[str, Any]]:
    """The one loader: a frozen translator from `folder`, checked against `pair` and bound to its models.

    `pair` is a `kvlingo.inputs.models.Pair` (anything with source, target, direction and
    `identities()`). `manifest_file` names the file holding the spec (an exported folder's is
    config.json). Returns (translator, provenance: the manifest plus `path` and `manifest_sha256`).
    """
    folder = Path(folder)
    try:
        manifest = read_manifest(folder, manifest_file)
        check_expected(
            manifest,
            family=family,
            key_space=key_space,
            direction=pair.direction,
            models=pair.identities(),
            geometry=Geometry.of(pair.source, pair.target),
        )
    except TranslatorError as err:
        raise TranslatorError(f"{folder}: {err}") from None
    device = next(pair.target.parameters()).device
    translator = load_state(folder, manifest, device).bind(pair.source, pair.target)
    translator.requires_grad_(False)
    info = {**manifest, "path": str(folder.resolve()), "manifest_sha256": sha256_file(folder / manifest_file)}
    return translator, info


# =========================================================================== the evidence
EVIDENCE_VERSION = 1
# Evidence arm → the benchmark arm it is read from ("translated" is the exported translator's own arm).
ARMS = ("native_target", "translated", "control", "no_context")
IFEVAL_METRIC = "prompt_level_strict_acc"


class EvidenceError(TranslatorError):
    """Reports that cannot vouch for a translator (they scored other maps or another pair, or lack an arm)."""


@dataclass(frozen=True)
class Gate:
    """What a translator must have shown on its benchmark before it is used without `allow_unproven`."""

    # Top-1 agreement with the native target over reply tokens: below 0.80, more than one reply token in
    # five would be decoded differently from the target reading its own cache.
    min_top1: float = 0.80
    # Reply NLL minus the native target's, nats per token: 0.25 nats is a reply perplexity 1.28× the native one.
    max_nll_delta: float = 0.25
    # The translated arm's KL per token must be below the control's (the same maps on another conversation's
    # cache): otherwise the maps' output does not depend on the conversation they read.
    beat_control: bool = True
    # The benchmark's native controls (injection equals split execution) must have passed: otherwise no
    # figure of that run can be trusted.
    native_controls: bool = True


@dataclass(frozen=True)
class Verdict:
    passed: bool
    failures: tuple[str, ...]  # each failing check with its figure and threshold, in words
    gate: Gate

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "failures": list(self.failures), "thresholds": asdict(self.gate)}


# --------------------------------------------------------------------------- from reports
def collect(benchmark: dict[str, Any], kind: str, ifeval: dict[str, Any] | None = None) -> dict[str, Any]:
    """Evidence for the `kind` translator of a run (closed_form or distilled) from its benchmark report
    and, when given, its translated IFEval report."""
    arms = benchmark["results"]["quality"]["arms"]
    source = {"native_target": "native_target", "translated": kind, "control": "control", "no_context": "no_context"}
    missing = [name for name, arm in source.items() if arm not in arms]
    if missing:
        raise EvidenceError(
            f"the benchmark report has no {', '.join(source[m] for m in missing)} arm; "
            f"run `make benchmark` with the {kind} translator present"
        )
    control_of = benchmark["results"]["quality"].get("control_translator")
    if control_of != kind:
        raise EvidenceError(
            f"the benchmark's control arm used the {control_of} translator, not {kind}, so it says "
            f"nothing about these maps; export the {control_of} maps, or "
            + (
                "benchmark a run that holds only the closed-form maps (the control takes the distilled maps "
                "where they exist): `make train RUN=NAME TRAIN_ARGS=--closed-form-only`, then `make benchmark "
                "RUN=NAME` and export RUN=NAME"
                if kind == "closed_form"
                else f"run `make benchmark` again with the {kind} maps present"
            )
        )
    paired = benchmark["results"]["quality"].get("paired", {})
    env = benchmark["env"]
    evidence = {
        "evidence_version": EVIDENCE_VERSION,
        "translator": kind,
        # The part of each translated context the target recomputed (kvlingo/core/refresh.py): the figures
        # hold for the maps used with this setting, so a relay hands over with it too.
        "refresh": benchmark["config"].get("refresh", "none"),
        "benchmark": {
            "split": benchmark["config"].get("variant", "natural"),
            "test_split_sha256": benchmark["inputs"]["test_split"]["sha256"],
            "n_conversations": benchmark["n_samples"]["conversations"],
            "n_reply_tokens": benchmark["n_samples"]["reply_tokens"],
            "dtype": env.get("dtype"),
            "device": env.get("device"),
            "git_sha": env.get("git_sha"),
            "git_dirty": env.get("git_dirty"),
            "torch": env.get("torch"),
            "transformers": env.get("transformers"),
            "native_controls_passed": benchmark["results"]["checks"]["controls_passed"],
        },
        "arms": {name: arms[arm] for name, arm in source.items()},
        # Paired t-tests over conversations on per-conversation mean reply NLL (a − b).
        "paired": {
            name.replace(kind, "translated"): test for name, test in paired.items() if name.startswith(f"{kind}_vs_")
        },
        "ifeval": ifeval_evidence(ifeval) if ifeval is not None else None,
    }
    if ifeval is not None and ifeval["config"].get("refresh", "none") != evidence["refresh"]:
        raise EvidenceError(
            f"IFEval ran with refresh {ifeval['config'].get('refresh', 'none')}, the benchmark with "
            f"{evidence['refresh']}; run both with the same --refresh"
        )
    return evidence


def ifeval_evidence(report: dict[str, Any]) -> dict[str, Any]:
    """Strict prompt-level accuracy (mean ± SE, n) per answering path of a translated IFEval report."""
    cfg = report["config"]
    return {
        "metric": IFEVAL_METRIC,
        "paths": {path: s[IFEVAL_METRIC] for path, s in report["results"]["paths"].items()},
        "hit_cap": {path: s.get("hit_cap") for path, s in report["results"]["paths"].items()},
        "max_new_tokens": cfg["max_new_tokens"],
        "enable_thinking": cfg["enable_thinking"],
        "n_prompts": report["n_samples"]["prompts"],
    }


# --------------------------------------------------------------------------- the gate
def judge(evidence: dict[str, Any] | None, gate: Gate = Gate()) -> Verdict:
    """The gate's verdict on the figures of `evidence` (None: no evidence at all). A figure that is missing,
    not a number or not finite (NaN) fails its check, named as such: nothing passes by a comparison with NaN."""
    if evidence is None:
        return Verdict(False, ("no evidence: the folder holds no benchmark figures",), gate)
    failures = []

    def at(*keys: str) -> Any:
        node: Any = evidence
        for key in keys:
            node = node.get(key) if isinstance(node, dict) else None
        return node

    def figure(*keys: str) -> float | None:
        node = at(*keys)
        if isinstance(node, bool) or not isinstance(node, (int, float)) or not math.isfinite(node):
            failures.append(f"evidence {'.'.join(keys)} is {node!r}, not a finite number")
            return None
        return float(node)

    convs, tokens = at("arms", "translated", "n_conversations"), at("arms", "translated", "n_tokens")
    n = f"(n={convs} conversations, {tokens} reply tokens)"
    top1 = figure("arms", "translated", "top1_agreement")
    if top1 is not None and top1 < gate.min_top1:
        failures.append(f"top-1 agreement with the native target {top1:.3f} < {gate.min_top1:.2f} {n}")
    nll = figure("arms", "translated", "nll_delta_vs_native_target")
    if nll is not None and nll > gate.max_nll_delta:
        failures.append(f"NLL Δ vs the native target {nll:.3f} nats/token > {gate.max_nll_delta:.2f} {n}")
    if gate.beat_control:
        t, c = figure("arms", "translated", "kl_token_mean"), figure("arms", "control", "kl_token_mean")
        if t is not None and c is not None and not t < c:
            failures.append(f"translated KL {t:.3f} nats/token does not beat the control's {c:.3f}")
    if gate.native_controls:
        passed = at("benchmark", "native_controls_passed")
        if passed is not True:
            failures.append(
                "the benchmark's native controls failed (its injection path was not exact)"
                if passed is False
                else f"evidence benchmark.native_controls_passed is {passed!r}, not true or false"
            )
    return Verdict(not failures, tuple(failures), gate)


# =========================================================================== the export
CONFIG_FILE = "config.json"
EVIDENCE_FILE = "evidence.json"
CARD_FILE = "README.md"
FORMAT = "kvlingo-translator"
FORMAT_VERSION = 2  # 2: config.json is sealed by its content hash
SPEC_KEYS = ("family", "key_space", "settings", "geometry", "n_params", "maps_sha256", "direction", "models")


# --------------------------------------------------------------------------- from a run
def gather(paths: RunPaths, kind: str = "distilled", evidence: bool = True) -> tuple[bytes, dict, dict | None]:
    """(maps bytes, config without evidence hash, evidence or None) for run `paths`' `kind` translator.

    Refuses (EvidenceError) reports that scored other maps or another pair, before anything is written.
    """
    folder = paths.translator(kind)
    manifest = read_manifest(folder)  # refuses a missing or damaged translator
    manifest_sha = sha256_file(folder / MANIFEST_FILE)
    maps = (folder / MAPS_FILE).read_bytes()
    if sha256_bytes(maps) != manifest["maps_sha256"]:
        raise EvidenceError(f"{folder / MAPS_FILE} changed while it was read; export again")
    bench_path, ifeval_path, train_path = (paths.report(name) for name in ("benchmark", "ifeval", "train"))
    rerun = lambda target: make_command(target, paths.run, *run_settings(paths, manifest))  # noqa: E731
    found = None
    if not evidence:  # the pair from whichever report the run has
        pair_from = next((p for p in (bench_path, train_path) if p.exists()), None)
        if pair_from is None:
            raise EvidenceError(
                f"neither {bench_path} nor {train_path} exists: the pair is read from the run's reports"
            )
        pair = read_report(pair_from)["config"]["pair"]
    elif not bench_path.exists():
        raise EvidenceError(
            f"{bench_path} does not exist: a translator is exported with its benchmark figures; "
            f"run `{rerun('benchmark')}` first (or export it unproven with --no-evidence)"
        )
    else:
        bench = read_report(bench_path, "benchmark")
        scored = bench["inputs"].get(kind, {}).get("manifest_sha256")
        if scored != manifest_sha:
            what = (
                f"another {kind} translator (manifest {scored[:12]}…, this one {manifest_sha[:12]}…)"
                if scored
                else f"no {kind} translator"
            )
            raise EvidenceError(f"{bench_path} scored {what}; re-run `{rerun('benchmark')}`")
        collect(bench, kind)  # the benchmark's refusals first: no IFEval rescored for maps it cannot vouch for
        ifeval = read_report(ifeval_path, "ifeval") if ifeval_path.is_file() else None
        if ifeval is not None:
            used = (ifeval["inputs"].get("translator") or {}).get("maps_sha256")
            if ifeval["config"].get("translator") != kind or used != manifest["maps_sha256"]:
                raise EvidenceError(
                    f"{ifeval_path} answered with other maps than {folder}; re-run "
                    f"`{ifeval_command(paths, manifest, kind, ifeval, bench)}` (IFEval is part of the evidence "
                    "when it exists)"
                )
        found = collect(bench, kind, ifeval)
        pair = bench["config"]["pair"]
    refresh = found["refresh"] if found is not None else "none"
    for role in ("source", "target"):
        trained = manifest.get("models", {}).get(role)
        if trained is not None and not same_model(trained, pair[role]):
            raise EvidenceError(
                f"the {kind} translator was trained for {role} {trained}, but the run's reports "
                f"are for {pair[role]}; re-run the stages of RUN={paths.run}"
            )
    if manifest.get("direction") not in (None, pair["direction"]):
        raise EvidenceError(f"the {kind} translator is {manifest['direction']}, the reports {pair['direction']}")
    config = export_config(
        manifest, pair, {"run": paths.run, "translator": kind, "manifest_sha256": manifest_sha}, refresh
    )
    return maps, config, found


def run_settings(paths: RunPaths, manifest: dict[str, Any]) -> tuple[str | None, dict | None]:
    """(profile, pair) a run's stages ran with, for a command to suggest: from the translator's training config,
    else from the first of the run's reports that records them; (None, None) when none does."""
    candidates = [manifest.get("config")]
    for name in ("train", "benchmark", "ifeval", "ifeval-native"):
        try:
            candidates.append(read_report(paths.report(name)).get("config") if paths.report(name).is_file() else None)
        except ValueError:  # a damaged report names nothing
            continue
    for cfg in candidates:
        if isinstance(cfg, dict) and cfg.get("profile") and isinstance(cfg.get("pair"), dict):
            return cfg["profile"], cfg["pair"]
    return None, None


# The Makefile's evaluation data for a profile (EVAL_ROOT, IFEVAL_SOURCE): demo and scale run on the toy world.
TOY_PROFILES = ("demo", "scale")
TOY_EVAL = ("data/toy-eval", "artifacts/toy/corpus/ifeval.jsonl")


def ifeval_command(paths: RunPaths, manifest: dict[str, Any], kind: str, ifeval: dict, bench: dict) -> str:
    """`make ifeval …` that scores run `paths`' `kind` translator (manifest `manifest`) as the export needs it:
    the run's make command (`make_command`) plus what the Makefile's defaults would get wrong: the translator
    (IFEVAL_ARGS, ifeval.py's --translator: distilled unless told), the benchmark's refresh (REFRESH; ifeval.py's
    default is the translator's own), and the data the run's IFEval report read (EVAL_ROOT, and IFEVAL_SOURCE
    where no prepared copy is there to read)."""
    profile, pair = run_settings(paths, manifest)
    words = [make_command("ifeval", paths.run, profile, pair)]
    if kind != "distilled":
        words.append(f"TRANSLATOR={kind}")
    refresh = str(Refresh.parse(bench["config"].get("refresh") or "none"))
    if refresh != str(trained_refresh(paths.translator(kind))):
        words.append(f"REFRESH={refresh}")
    default_root, default_source = TOY_EVAL if profile in TOY_PROFILES else ("data", None)
    root, source, data = default_root, None, ifeval["inputs"].get("data") or {}
    if data.get("prepared"):  # EVAL_ROOT/ifeval/ifeval.jsonl, copied from a local file or the Hub
        root, source = shown(Path(data["prepared"]).parent.parent), data.get("origin", {}).get("local_source")
        if root != default_root:
            words.append(f"EVAL_ROOT={shlex.quote(root)}")
    elif data.get("source"):  # ifeval.py --source, read in place: make prepares EVAL_ROOT's copy from it
        source = data["source"]
    if source and shown(source) != default_source and not (Path(root) / "ifeval" / "manifest.json").is_file():
        words.append(f"IFEVAL_SOURCE={shlex.quote(shown(source))}")
    return " ".join(words)


def shown(path: str | Path) -> str:
    """`path` as a command typed at the repository root names it: relative under the working folder, else whole."""
    path = Path(path)
    with contextlib.suppress(ValueError):
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    return str(path)


def export_config(
    manifest: dict[str, Any], pair: dict[str, Any], origin: dict[str, Any], refresh: str = "none"
) -> dict[str, Any]:
    """config.json's fields (all but evidence_sha256) from a translator manifest, the run's `PairConfig` dict and
    the refresh setting its evidence was measured with."""
    large, small = (pair["source"], pair["target"]) if pair["direction"] == "l2s" else (pair["target"], pair["source"])
    spec = {k: manifest[k] for k in SPEC_KEYS if k in manifest}
    spec.setdefault("direction", pair["direction"])
    spec.setdefault("models", {"source": pair["source"], "target": pair["target"]})
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        **spec,
        "pair": {
            "direction": pair["direction"],
            "large": large,
            "small": small,
            "dtype": pair["dtype"],
            "tokenizer_sha256": pair["tokenizer_sha256"],
            "chat_template_sha256": pair["chat_template_sha256"],
            "geometry": pair["geometry"],
        },
        "refresh": refresh,  # what the target recomputes on top of the translation (kvlingo/core/refresh.py)
        "origin": origin,  # the run and translator folder it was exported from
        "training": {k: v for k, v in manifest.items() if k not in (*SPEC_KEYS, CONTENT_HASH)},
    }


# --------------------------------------------------------------------------- the folder
EXPORT_FILES = (MAPS_FILE, EVIDENCE_FILE, CARD_FILE, CONFIG_FILE)


def check_export_folder(out: Path) -> None:
    """Refuse (TranslatorError) to write into a folder that is not an export's: one holding any other file
    (a model folder's config.json would be replaced), or a config.json of another format. A new or empty
    folder, an earlier export, or one a killed export left without its config.json are fine."""
    if not out.exists():
        return
    if not out.is_dir():
        raise TranslatorError(f"--out {out} is a file; give a new or empty folder, or an earlier export")
    shown = not_ours(out, EXPORT_FILES, CONFIG_FILE, "format", FORMAT, damaged_is_ours=False)
    if shown:
        raise TranslatorError(
            f"--out {out} holds files that are not an exported translator's ({shown}); an export "
            "would overwrite them. Give a new or empty folder, or an earlier export"
        )


def write_export(out: str | Path, maps: bytes, config: dict[str, Any], evidence: dict[str, Any] | None) -> Verdict:
    """Write an export folder whole beside `out` (config.json last), then swap it in: a re-export that fails (a full
    disk, a kill) leaves the good export it would replace as it was. Returns the gate's verdict at its default
    thresholds."""
    out = Path(out)
    check_export_folder(out)
    staging = out.with_name(f".{out.name}.export.tmp")
    shutil.rmtree(staging, ignore_errors=True)  # a killed export's: never a user's (the name is ours)
    try:
        staging.mkdir(parents=True)
        atomic_write_bytes(staging / MAPS_FILE, maps)
        verdict = judge(evidence)
        if evidence is not None:
            evidence = {**evidence, "gate": verdict.to_dict()}
            atomic_write_json(staging / EVIDENCE_FILE, evidence)
        config = {
            **config,
            "maps_sha256": sha256_bytes(maps),
            "evidence_sha256": sha256_file(staging / EVIDENCE_FILE) if evidence is not None else None,
        }
        atomic_write_text(staging / CARD_FILE, model_card(config, evidence, verdict))
        atomic_write_json(staging / CONFIG_FILE, sealed(config))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _swap_folder(staging, out)
    return verdict


def _swap_folder(new: Path, out: Path) -> None:
    """Replace `out` by the complete folder `new`: the old one renamed aside, the new one renamed in, the old one
    deleted; killed between the renames, the next export finds no `out` and writes it again."""
    retired = out.with_name(f".{out.name}.retired.tmp")
    shutil.rmtree(retired, ignore_errors=True)
    if out.exists():
        os.replace(out, retired)
    os.replace(new, out)
    shutil.rmtree(retired, ignore_errors=True)


def export_fix(folder: Path) -> str:
    """The fix for a folder that is not a complete export: the export of its run where there is one, else the
    command that writes it (`make export` from the repository root, its run named from the folder)."""
    translator = next((k for k in TRANSLATORS if folder.name == k and (folder / MANIFEST_FILE).is_file()), None)
    run = folder.parent if translator or folder.name == "export" else folder  # ARTIFACTS/RUN/{distilled,export}
    if (run / "export" / CONFIG_FILE).is_file():
        return f"load {run / 'export'}, the export of its run"
    if not (translator or any((run / k / MANIFEST_FILE).is_file() for k in TRANSLATORS)):
        return "give the folder `make export RUN=...` wrote (ARTIFACTS/RUN/export)"
    artifacts = Path("artifacts").resolve()  # make runs export.py from the repository root with --artifacts artifacts
    inside = run.resolve().is_relative_to(artifacts)
    command = make_command("export", run.resolve().relative_to(artifacts).as_posix() if inside else run.name, None)
    if translator not in (None, "distilled"):
        command += f" TRANSLATOR={translator}"
    if not inside:
        command += f" EXPORT_ARGS={shlex.quote(f'--artifacts {shlex.quote(str(run.parent))}')}"
    return (
        f"it is a training run's folder: export it with `{command}` (from the repository root), then load "
        f"{run / 'export'}"
    )


def read_export(folder: str | Path) -> tuple[dict[str, Any], dict[str, Any] | None, str | None]:
    """(config, evidence or None, why there is none) of an export folder; the maps hash is checked by the loader."""
    folder = Path(folder)
    if not (folder / CONFIG_FILE).is_file():
        raise TranslatorError(
            f"{folder} holds no {CONFIG_FILE}: not a complete exported translator; {export_fix(folder)}"
        )
    try:
        config = read_json(folder / CONFIG_FILE)
    except DamagedFile as e:
        raise TranslatorError(f"{e.problem}: the export is damaged; export it again (make export RUN=...)") from None
    if isinstance(config, dict) and "model_type" in config and "format" not in config:
        raise TranslatorError(
            f"{folder} is a model folder ({config['model_type']}), not an exported translator: give the folder "
            "`make export` wrote (ARTIFACTS/RUN/export), and the models as large=/small= if they moved"
        )
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        found = config.get("format") if isinstance(config, dict) else type(config).__name__
        raise TranslatorError(
            f"{folder / CONFIG_FILE} is not a {FORMAT} config (format {found!r}); give a folder "
            "`make export` wrote, or export it again"
        )
    version = config.get("format_version", 0)
    if type(version) is not int:
        raise TranslatorError(
            f"{folder / CONFIG_FILE}: format_version {version!r} is not a whole number; the export "
            "is damaged or edited: export it again (make export RUN=...)"
        )
    if version > FORMAT_VERSION:
        raise TranslatorError(
            f"{folder} is export format {version}, newer than this kvlingo reads ({FORMAT_VERSION}); update kvlingo"
        )
    sealed_wrong = seal_problem(config)
    if sealed_wrong:  # every field counts: the key space, the dtype and refresh the evidence was measured in, ...
        raise TranslatorError(f"{folder / CONFIG_FILE}: {sealed_wrong}; export it again (make export RUN=...)")
    wrong = config_problems(config)
    if wrong:
        raise TranslatorError(
            f"{folder / CONFIG_FILE}: {'; '.join(wrong)}; the export is damaged or edited: export it "
            "again (make export RUN=...)"
        )
    recorded, path = config.get("evidence_sha256"), folder / EVIDENCE_FILE
    if recorded is None:
        return config, None, "it was exported without evidence (--no-evidence)"
    if not path.is_file():
        return config, None, f"{EVIDENCE_FILE} is missing"
    if sha256_file(path) != recorded:
        return config, None, f"{EVIDENCE_FILE} does not match the hash recorded in {CONFIG_FILE} (edited or replaced)"
    try:
        return config, read_json(path), None  # its bytes match the recorded hash
    except DamagedFile as e:  # hashed as it is, yet not JSON: no figures to judge
        return config, None, f"{EVIDENCE_FILE} does not parse ({e.problem})"


def config_problems(config: dict[str, Any]) -> list[str]:
    """What a loader needs from config.json beyond the translator's spec (`read_manifest` checks that) and
    is missing or of the wrong kind, in words ([] when nothing is)."""
    wrong = []
    if config.get("direction") not in ("l2s", "s2l"):
        wrong.append(f"direction {config.get('direction')!r} is not l2s or s2l")
    pair = config.get("pair")
    if not isinstance(pair, dict):
        return wrong + [f"pair {pair!r} is not a mapping"]
    for role in ("large", "small"):
        ident = pair.get(role)
        if not (
            isinstance(ident, dict)
            and (
                isinstance(ident.get("id"), str)
                and isinstance(ident.get("revision"), str)
                or isinstance(ident.get("path"), str)
                and isinstance(ident.get("weights_sha256"), str)
            )
        ):
            wrong.append(f"pair.{role} {ident!r} is neither {{id, revision}} nor {{path, weights_sha256}}")
    for key in ("dtype", "tokenizer_sha256"):
        if not isinstance(pair.get(key), str):
            wrong.append(f"pair.{key} {pair.get(key)!r} is not a string")
    if not isinstance(config.get("models", {}), dict):
        wrong.append(f"models {config.get('models')!r} is not a mapping of source and target")
    if not isinstance(config.get("refresh", "none"), str):
        wrong.append(f"refresh {config.get('refresh')!r} is not a string")
    return wrong


# --------------------------------------------------------------------------- the model card
def model_arg(identity: dict[str, Any], role: str, fix: str, error: type[Exception]) -> str:
    """A recorded model identity as a model argument: 'id@revision', or the local folder where it is still here;
    otherwise `error` naming the folder, then `fix` (what the caller's user does about it)."""
    if "id" in identity:
        return f"{identity['id']}@{identity['revision']}"
    if not Path(identity["path"]).is_dir():
        raise error(
            f"the {role} model was the local folder {identity['path']}, which is not here; {fix} "
            f"(sha256 {identity['weights_sha256'][:12]}…)"
        )
    return identity["path"]


def model_name(identity: dict[str, Any]) -> str:
    """A model identity in words: 'id @ revision' or the folder name with its weights digest."""
    if "id" in identity:
        return f"{identity['id']} @ {identity.get('revision')}"
    return f"{Path(identity['path']).name} (local folder, weights sha256 {identity['weights_sha256'][:12]}…)"


def reads_line(reads: dict[str, Any] | None) -> str:
    """The model card's line on what a handoff reads besides the source's cache."""
    if not reads:
        return "not recorded (an export of an earlier version)"
    weights = reads.get("target_weights")
    target = (
        "every target weight (the refresh runs the target's layers)"
        if weights == "all"
        else ("the target's " + ", ".join(f"`{n}`" for n in weights) + " (sha256 in config.json)")
        if weights
        else "no target weight"
    )
    return f"the source's cache, {'the token ids it covers, ' if reads.get('token_ids') else ''}{target}"


def training_lines(training: dict[str, Any]) -> list[str]:
    """The model card's "Training" section from config.json's `training` (the translator manifest's provenance):
    the profile, the fit and the distillation's budget, rate, schedule and objective; none where it is not recorded."""
    cfg = training.get("config")
    if not isinstance(cfg, dict):
        return []
    lines = ["", "## Training", "", f"- profile: {cfg['profile']}, seed {cfg['seed']}"]
    if training.get("stage") == "closed_form" or not cfg["updates"]:
        lines.append("- closed-form fit only (no distillation)")
        return lines
    schedule = cfg.get("lr_schedule", "constant")  # a config written before the field existed ran constant
    lines.append(
        f"- distillation: {cfg['updates']} updates × {cfg['batch']} conversations, AdamW at {cfg['lr']:g}, "
        f"`lr_schedule: {schedule}` (kvlingo.train.distill.lr_at)"
    )
    objective = [
        f"{name} {cfg[key]:g}"
        for key, name in (
            ("onpolicy", "on-policy share"),
            ("context_weight", "context weight α"),
            ("aux_attn_weight", "attention-output MSE weight"),
        )
        if cfg.get(key)
    ]
    lines.append(f"- objective: KL through the frozen target{'; ' + ', '.join(objective) if objective else ''}")
    if training.get("val_kl") is not None:
        lines.append(f"- validation KL/token of the saved maps: {training['val_kl']:.4g}")
    return lines


def model_card(config: dict[str, Any], evidence: dict[str, Any] | None, verdict: Verdict) -> str:
    pair = config["pair"]
    source, target = (pair["large"], pair["small"]) if pair["direction"] == "l2s" else (pair["small"], pair["large"])
    hub = [m["id"] for m in (pair["large"], pair["small"]) if "id" in m]
    front = ["---", "library_name: kvlingo", "tags: [kv-cache, cache-translation, qwen3]"]
    if hub:
        front += ["base_model:", *(f"- {m}" for m in hub)]
    lines = [
        *front,
        "---",
        "",
        f"# KV-cache translator: {model_name(source)} → {model_name(target)}",
        "",
        f"A {config['family']} translator ({config['key_space']} key space, {config.get('n_params', '?')} "
        f"parameters) that turns the KV cache of the source model into the target's, so the target continues "
        f"a conversation the source read without re-reading it. Exported by KVLRelay from run "
        f"`{config['origin']['run']}` ({config['origin']['translator']} maps).",
        "",
        "## Use",
        "",
        "```python",
        "from kvlingo import Relay",
        "",
        'relay = Relay.load("PATH_OR_REPO_ID")  # a Hub repo id takes revision="<commit>"',
        'print(relay.chat([{"role": "user", "content": "Hello!"}], max_new_tokens=64))',
        "```",
        "",
        *(
            [
                "The pair was two local folders: elsewhere, pass `large=` and `small=` folders holding the same "
                "weights (config.json records their digests).",
                "",
            ]
            if not hub
            else []
        ),
        f"`Relay.load` checks the maps against their sha256 ({config['maps_sha256'][:16]}…), the pair's "
        f"tokenizer against its digest ({pair['tokenizer_sha256'][:16]}…) and the evidence below against the gate.",
        "",
        f"## Gate: {'PASSED' if verdict.passed else 'FAILED'}",
        "",
    ]
    g = verdict.gate
    lines.append(
        f"Thresholds: top-1 agreement ≥ {g.min_top1:.2f}, NLL Δ ≤ {g.max_nll_delta:.2f} nats/token against "
        f"the native target, translated KL below the control's, native controls passed."
    )
    lines += ["", *(f"- {f}" for f in verdict.failures)] if verdict.failures else []
    if not verdict.passed:
        lines += ["", "`Relay.load` refuses these maps unless called with `allow_unproven=True`."]
    if evidence is not None:
        b = evidence["benchmark"]
        rows = [
            [
                arm,
                m["kl_token_mean"],
                fmt_pm(m["kl_conversation"]),
                m["top1_agreement"],
                m["nll_delta_vs_native_target"],
                fmt_pm(m["nll_delta_conversation"]),
                m["n_conversations"],
                m["n_tokens"],
            ]
            for arm, m in evidence["arms"].items()
        ]
        lines += [
            "",
            f"## Evidence (held-out test split, {b['dtype']} on {b['device']}, git {str(b['git_sha'])[:12]})",
            "",
            "KL(native target ‖ arm) over reply tokens; *translated* is these maps, *control* the same maps "
            "on another conversation's cache, *no_context* the target with no cache at all.",
            "",
            fmt_table(
                ["arm", "KL/token", "KL/conv ± SE", "top-1", "ΔNLL/token", "ΔNLL/conv ± SE", "convs", "tokens"], rows
            ).rstrip(),
        ]
        if evidence.get("ifeval"):
            ife = evidence["ifeval"]
            rows = [[path, fmt_pm(s, 100.0, ".1f"), s["n"]] for path, s in ife["paths"].items()]
            lines += [
                "",
                f"IFEval, strict prompt-level accuracy % ± SE (greedy, {ife['max_new_tokens']} new tokens, "
                f"thinking {'on' if ife['enable_thinking'] else 'off'}):",
                "",
                fmt_table(["path", "strict prompt %", "n"], rows).rstrip(),
            ]
    else:
        lines += ["", "## Evidence", "", "None: this translator was exported without benchmark figures."]
    lines += [
        "",
        "## Pair",
        "",
        f"- direction: {pair['direction']} (source {model_name(source)}, target {model_name(target)})",
        f"- refresh: {config.get('refresh', 'none')} (the handoff the evidence measured, and the one `Relay` runs)",
        f"- reads: {reads_line(config.get('reads'))}",
        f"- tokenizer sha256: {pair['tokenizer_sha256']}",
        f"- measured in: {pair['dtype']}",
        f"- geometry: {json.dumps(pair['geometry'])}",
        *training_lines(config.get("training") or {}),
        "",
        "## Files",
        "",
        f"- `{MAPS_FILE}`: sha256 {config['maps_sha256']}",
        f"- `{CONFIG_FILE}`: spec, pair, provenance",
        f"- `{EVIDENCE_FILE}`: the figures above, in full",
        "",
    ]
    return "\n".join(lines)
