"""A finished run's translator as a self-describing folder that can be shared (save_pretrained style).

    maps.safetensors  the translator's state, byte for byte the run's
    evidence.json     what the run measured about these maps (`evidence.collect`) and the gate's verdict
    README.md         a model card generated from config and evidence
    config.json       written last, so its presence marks a complete export: the translator's spec
                      (family, key space, settings, geometry), its direction, the pair (ids with
                      revisions or local weights digests, tokenizer digest, the dtype it was measured
                      in), its training provenance, the sha256 of maps.safetensors and evidence.json,
                      and its own content hash over all of that (an edit of any field is refused)

config.json carries every field the one loader (`core.folder.load_translator`) reads from a
manifest, so an exported folder loads through it unchanged. A re-export first removes config.json:
a folder caught half-written is never taken for a complete one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..core.folder import CONTENT_HASH, MANIFEST_FILE, MAPS_FILE, read_manifest, same_model, seal_problem, sealed
from ..core.translator import TranslatorError
from ..io import (DamagedFile, atomic_write_bytes, atomic_write_json, atomic_write_text, not_ours, read_json,
                  sha256_bytes, sha256_file)
from .evidence import EvidenceError, Verdict, collect, judge
from .paths import RunPaths, make_command
from .report import fmt_pm, fmt_table, read_report

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
            raise EvidenceError(f"neither {bench_path} nor {train_path} exists: the pair is read from the run's reports")
        pair = read_report(pair_from)["config"]["pair"]
    elif not bench_path.exists():
        raise EvidenceError(f"{bench_path} does not exist: a translator is exported with its benchmark figures; "
                            f"run `{rerun('benchmark')}` first (or export it unproven with --no-evidence)")
    else:
        bench = read_report(bench_path, "benchmark")
        scored = bench["inputs"].get(kind, {}).get("manifest_sha256")
        if scored != manifest_sha:
            what = (f"another {kind} translator (manifest {scored[:12]}…, this one {manifest_sha[:12]}…)" if scored
                    else f"no {kind} translator")
            raise EvidenceError(f"{bench_path} scored {what}; re-run `{rerun('benchmark')}`")
        ifeval = read_report(ifeval_path, "ifeval") if ifeval_path.is_file() else None
        if ifeval is not None:
            used = (ifeval["inputs"].get("translator") or {}).get("maps_sha256")
            if ifeval["config"].get("translator") != kind or used != manifest["maps_sha256"]:
                raise EvidenceError(f"{ifeval_path} answered with other maps than {folder}; re-run "
                                    f"`{rerun('ifeval')}` (IFEval is part of the evidence when it exists)")
        found = collect(bench, kind, ifeval)
        pair = bench["config"]["pair"]
    refresh = found["refresh"] if found is not None else "none"
    for role in ("source", "target"):
        trained = manifest.get("models", {}).get(role)
        if trained is not None and not same_model(trained, pair[role]):
            raise EvidenceError(f"the {kind} translator was trained for {role} {trained}, but the run's reports "
                                f"are for {pair[role]}; re-run the stages of RUN={paths.run}")
    if manifest.get("direction") not in (None, pair["direction"]):
        raise EvidenceError(f"the {kind} translator is {manifest['direction']}, the reports {pair['direction']}")
    config = export_config(manifest, pair, {"run": paths.run, "translator": kind, "manifest_sha256": manifest_sha},
                           refresh)
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


def export_config(manifest: dict[str, Any], pair: dict[str, Any], origin: dict[str, Any],
                  refresh: str = "none") -> dict[str, Any]:
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
        "pair": {"direction": pair["direction"], "large": large, "small": small, "dtype": pair["dtype"],
                 "tokenizer_sha256": pair["tokenizer_sha256"], "chat_template_sha256": pair["chat_template_sha256"],
                 "geometry": pair["geometry"]},
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
        raise TranslatorError(f"--out {out} holds files that are not an exported translator's ({shown}); an export "
                              "would overwrite them. Give a new or empty folder, or an earlier export")


def write_export(out: str | Path, maps: bytes, config: dict[str, Any], evidence: dict[str, Any] | None) -> Verdict:
    """Write an export folder in order (config.json last); returns the gate's verdict at its default thresholds."""
    out = Path(out)
    check_export_folder(out)
    (out / CONFIG_FILE).unlink(missing_ok=True)
    atomic_write_bytes(out / MAPS_FILE, maps)
    verdict = judge(evidence)
    if evidence is not None:
        evidence = {**evidence, "gate": verdict.to_dict()}
        atomic_write_json(out / EVIDENCE_FILE, evidence)
    else:
        (out / EVIDENCE_FILE).unlink(missing_ok=True)
    config = {**config, "maps_sha256": sha256_bytes(maps),
              "evidence_sha256": sha256_file(out / EVIDENCE_FILE) if evidence is not None else None}
    atomic_write_text(out / CARD_FILE, model_card(config, evidence, verdict))
    atomic_write_json(out / CONFIG_FILE, sealed(config))
    return verdict


def read_export(folder: str | Path) -> tuple[dict[str, Any], dict[str, Any] | None, str | None]:
    """(config, evidence or None, why there is none) of an export folder; the maps hash is checked by the loader."""
    folder = Path(folder)
    if not (folder / CONFIG_FILE).is_file():
        hint = (" It is a training folder: export it with `make export RUN=...`."
                if (folder / MANIFEST_FILE).is_file() else "")
        raise TranslatorError(f"{folder} holds no {CONFIG_FILE}: not a complete exported translator.{hint}")
    try:
        config = read_json(folder / CONFIG_FILE)
    except DamagedFile as e:
        raise TranslatorError(f"{e.problem}: the export is damaged; export it again (make export RUN=...)") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        found = config.get("format") if isinstance(config, dict) else type(config).__name__
        raise TranslatorError(f"{folder / CONFIG_FILE} is not a {FORMAT} config (format {found!r}); give a folder "
                              "`make export` wrote, or export it again")
    version = config.get("format_version", 0)
    if type(version) is not int:
        raise TranslatorError(f"{folder / CONFIG_FILE}: format_version {version!r} is not a whole number; the export "
                              "is damaged or edited: export it again (make export RUN=...)")
    if version > FORMAT_VERSION:
        raise TranslatorError(f"{folder} is export format {version}, newer than this kvlingo "
                              f"reads ({FORMAT_VERSION}); update kvlingo")
    sealed_wrong = seal_problem(config)
    if sealed_wrong:  # every field counts: the key space, the dtype and refresh the evidence was measured in, ...
        raise TranslatorError(f"{folder / CONFIG_FILE}: {sealed_wrong}; export it again (make export RUN=...)")
    wrong = config_problems(config)
    if wrong:
        raise TranslatorError(f"{folder / CONFIG_FILE}: {'; '.join(wrong)}; the export is damaged or edited: export it "
                              "again (make export RUN=...)")
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
        if not (isinstance(ident, dict) and (isinstance(ident.get("id"), str) and isinstance(ident.get("revision"), str)
                                             or isinstance(ident.get("path"), str)
                                             and isinstance(ident.get("weights_sha256"), str))):
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
        raise error(f"the {role} model was the local folder {identity['path']}, which is not here; {fix} "
                    f"(sha256 {identity['weights_sha256'][:12]}…)")
    return identity["path"]


def model_name(identity: dict[str, Any]) -> str:
    """A model identity in words: 'id @ revision' or the folder name with its weights digest."""
    if "id" in identity:
        return f"{identity['id']} @ {identity.get('revision')}"
    return f"{Path(identity['path']).name} (local folder, weights sha256 {identity['weights_sha256'][:12]}…)"


def model_card(config: dict[str, Any], evidence: dict[str, Any] | None, verdict: Verdict) -> str:
    pair = config["pair"]
    source, target = (pair["large"], pair["small"]) if pair["direction"] == "l2s" else (pair["small"], pair["large"])
    hub = [m["id"] for m in (pair["large"], pair["small"]) if "id" in m]
    front = ["---", "library_name: kvlingo", "tags: [kv-cache, cache-translation, qwen3]"]
    if hub:
        front += ["base_model:", *(f"- {m}" for m in hub)]
    lines = [*front, "---", "",
             f"# KV-cache translator: {model_name(source)} → {model_name(target)}", "",
             f"A {config['family']} translator ({config['key_space']} key space, {config.get('n_params', '?')} "
             f"parameters) that turns the KV cache of the source model into the target's, so the target continues "
             f"a conversation the source read without re-reading it. Exported by KVLRelay from run "
             f"`{config['origin']['run']}` ({config['origin']['translator']} maps).", "",
             "## Use", "", "```python", "from kvlingo import Relay", "",
             'relay = Relay.load("PATH_OR_REPO_ID")  # a Hub repo id takes revision="<commit>"',
             'print(relay.chat([{"role": "user", "content": "Hello!"}], max_new_tokens=64))', "```", "",
             *(["The pair was two local folders: elsewhere, pass `large=` and `small=` folders holding the same "
                "weights (config.json records their digests).", ""] if not hub else []),
             f"`Relay.load` checks the maps against their sha256 ({config['maps_sha256'][:16]}…), the pair's "
             f"tokenizer against its digest ({pair['tokenizer_sha256'][:16]}…) and the evidence below against the gate.",
             "", f"## Gate: {'PASSED' if verdict.passed else 'FAILED'}", ""]
    g = verdict.gate
    lines.append(f"Thresholds: top-1 agreement ≥ {g.min_top1:.2f}, NLL Δ ≤ {g.max_nll_delta:.2f} nats/token against "
                 f"the native target, translated KL below the control's, native controls passed.")
    lines += ["", *(f"- {f}" for f in verdict.failures)] if verdict.failures else []
    if not verdict.passed:
        lines += ["", "`Relay.load` refuses these maps unless called with `allow_unproven=True`."]
    if evidence is not None:
        b = evidence["benchmark"]
        rows = [[arm, m["kl_token_mean"], fmt_pm(m["kl_conversation"]), m["top1_agreement"],
                 m["nll_delta_vs_native_target"], fmt_pm(m["nll_delta_conversation"]), m["n_conversations"],
                 m["n_tokens"]] for arm, m in evidence["arms"].items()]
        lines += ["", f"## Evidence (held-out test split, {b['dtype']} on {b['device']}, git {str(b['git_sha'])[:12]})", "",
                  "KL(native target ‖ arm) over reply tokens; *translated* is these maps, *control* the same maps "
                  "on another conversation's cache, *no_context* the target with no cache at all.", "",
                  fmt_table(["arm", "KL/token", "KL/conv ± SE", "top-1", "ΔNLL/token", "ΔNLL/conv ± SE", "convs",
                             "tokens"], rows).rstrip()]
        if evidence.get("ifeval"):
            ife = evidence["ifeval"]
            rows = [[path, fmt_pm(s, 100.0, ".1f"), s["n"]] for path, s in ife["paths"].items()]
            lines += ["", f"IFEval, strict prompt-level accuracy % ± SE (greedy, {ife['max_new_tokens']} new tokens, "
                      f"thinking {'on' if ife['enable_thinking'] else 'off'}):", "",
                      fmt_table(["path", "strict prompt %", "n"], rows).rstrip()]
    else:
        lines += ["", "## Evidence", "", "None: this translator was exported without benchmark figures."]
    lines += ["", "## Pair", "", f"- direction: {pair['direction']} (source {model_name(source)}, target "
              f"{model_name(target)})", f"- refresh: {config.get('refresh', 'none')} (the handoff the evidence measured, "
              "and the one `Relay` runs)", f"- tokenizer sha256: {pair['tokenizer_sha256']}",
              f"- measured in: {pair['dtype']}", f"- geometry: {json.dumps(pair['geometry'])}", "",
              "## Files", "", f"- `{MAPS_FILE}`: sha256 {config['maps_sha256']}",
              f"- `{CONFIG_FILE}`: spec, pair, provenance", f"- `{EVIDENCE_FILE}`: the figures above, in full", ""]
    return "\n".join(lines)
