"""The translator folder format and the one loader.

A folder holds `MAPS_FILE` (the state dict), then `MANIFEST_FILE`, written last, so its presence
marks a complete translator. The manifest records the family, key space, settings and geometry,
the sha256 of the maps file, and whatever provenance the writer adds (direction, model
identities, data and code hashes), and is sealed by its own content hash (`CONTENT_HASH`), so
an edit of any field is refused where the manifest is read. An exported folder
(kvlingo.run.exported) keeps the same fields in config.json.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..io import DamagedFile, atomic_write_bytes, atomic_write_json, read_json, sha256_file, sha256_json, to_jsonable
from .families import FAMILIES  # every family registered
from .keyspace import KEY_SPACES
from .translator import Geometry, Translator, TranslatorError

MAPS_FILE = "maps.safetensors"
MANIFEST_FILE = "manifest.json"
CONTENT_HASH = "content_sha256"  # a manifest's (or export config's) own hash: its canonical JSON without this field


def sealed(meta: dict[str, Any]) -> dict[str, Any]:
    """`meta` with its content hash (CONTENT_HASH) set: what a translator manifest or export config is written as."""
    body = {k: v for k, v in to_jsonable(meta).items() if k != CONTENT_HASH}
    return {**body, CONTENT_HASH: sha256_json(body)}


def seal_problem(meta: dict[str, Any]) -> str | None:
    """Why `meta` (a manifest or config as read) is not as it was written, or None: every field counts, so an
    edit of any of them (a setting, the pair, the provenance) is found."""
    recorded = meta.get(CONTENT_HASH)
    if recorded is None:
        return f"it records no {CONTENT_HASH} (written by older code)"
    if recorded != sha256_json({k: v for k, v in meta.items() if k != CONTENT_HASH}):
        return f"it was edited after it was written (its {CONTENT_HASH} does not match its fields)"
    return None


# --------------------------------------------------------------------------- folders
def state_bytes(translator: Translator) -> bytes:
    """The bytes `save_translator` writes as maps.safetensors (so their sha256 is known before writing)."""
    from safetensors.torch import save

    return save({k: v.detach().cpu().contiguous() for k, v in translator.state_dict().items()})


def save_translator(folder: str | Path, translator: Translator, provenance: dict[str, Any]) -> Path:
    """maps.safetensors, then manifest.json (last: its presence marks a complete translator)."""
    folder = Path(folder)
    atomic_write_bytes(folder / MAPS_FILE, state_bytes(translator))
    manifest = {**provenance, **translator.spec(), "n_params": translator.n_params(),
                "maps_sha256": sha256_file(folder / MAPS_FILE)}
    atomic_write_json(folder / MANIFEST_FILE, sealed(manifest))
    return folder


def read_manifest(folder: str | Path, name: str = MANIFEST_FILE) -> dict[str, Any]:
    """A translator folder's manifest (`name`: manifest.json, or an export's config.json), after checking it
    against its own content hash and the maps file against the hash it records."""
    folder = Path(folder)
    mpath = folder / name
    if not mpath.is_file():
        raise TranslatorError(f"{folder} holds no {name}: not a complete translator; train it first "
                              "(make train RUN=...) or name a run that has one")
    try:
        manifest = read_json(mpath)
    except DamagedFile as e:
        raise TranslatorError(f"{e.problem}: the translator folder is damaged; train or export it again") from None
    problem = seal_problem(manifest) if isinstance(manifest, dict) else f"it is a {type(manifest).__name__}, not a mapping"
    if problem:
        raise TranslatorError(f"{mpath}: {problem}; train or export it again")
    if manifest.get("family") not in FAMILIES:
        raise TranslatorError(f"{mpath}: unknown translator family {manifest.get('family')!r} "
                              f"(known: {', '.join(sorted(FAMILIES))}); it was written by other code")
    if not (folder / MAPS_FILE).is_file() or sha256_file(folder / MAPS_FILE) != manifest.get("maps_sha256"):
        raise TranslatorError(f"{folder / MAPS_FILE} does not match its manifest hash in {name} (damaged or replaced); "
                              "train or export it again")
    try:
        check_state(folder / MAPS_FILE, build(manifest, device="meta"))
    except TranslatorError as err:
        raise TranslatorError(f"{mpath}: {err}; it was written by other code or edited: train or export it again") from None
    return manifest


def build(manifest: dict[str, Any], device: str | torch.device | None = None) -> Translator:
    """An untrained translator of the manifest's family, settings and geometry (state not loaded); on
    device="meta" nothing is allocated. A spec that does not build one (a field missing or of the wrong
    kind, settings the family does not take) is refused with a TranslatorError naming it."""
    cls = FAMILIES[manifest["family"]]
    geometry, fields = manifest.get("geometry"), list(Geometry.__dataclass_fields__)
    if not (isinstance(geometry, dict) and sorted(geometry) == sorted(fields)
            and all(type(geometry[f]) is int and geometry[f] > 0 for f in fields)):
        raise TranslatorError(f"geometry {geometry!r} is not {{{', '.join(fields)}}} as positive integers")
    if manifest.get("key_space") not in KEY_SPACES:
        raise TranslatorError(f"key space {manifest.get('key_space')!r} is not one of {', '.join(KEY_SPACES)}")
    settings = manifest.get("settings", {})
    if not isinstance(settings, dict):
        raise TranslatorError(f"settings {settings!r} are not a mapping of the {cls.family} family's options")
    try:
        with torch.device(device) if device is not None else contextlib.nullcontext():
            return cls.from_spec(Geometry(**geometry), manifest["key_space"], settings)
    except (TypeError, ValueError) as err:
        raise TranslatorError(f"settings {settings} do not build a {cls.family} translator ({err})") from None


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
    names = {torch.float32: "F32", torch.float64: "F64", torch.bfloat16: "BF16", torch.float16: "F16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}  # safetensors' names of the dtypes
    wrong = [f"missing {k}" for k in expected if k not in found] + [f"unexpected {k}" for k in found if k not in expected]
    wrong += [f"{k} is {found[k][1]} {list(found[k][0])}, not {names.get(dt, dt)} {list(shape)}"
              for k, (shape, dt) in expected.items() if k in found and found[k] != (shape, names.get(dt, dt))]
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
        raise TranslatorError(f"{folder / MAPS_FILE}: {', '.join(bad[:4])} hold NaN or infinite values; train or "
                              "export the maps again (a run whose loss diverged writes such maps)")
    translator.load_state_dict(state, strict=True)
    return translator.to(device)


def same_model(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two model identities name one model: local folders by their weights digest alone (a copied
    or moved folder holds the same model), Hub models by id and revision."""
    if "weights_sha256" in a and "weights_sha256" in b:
        return a["weights_sha256"] == b["weights_sha256"]
    return a == b


def check_expected(manifest: dict[str, Any], *, family: str | None = None, key_space: str | None = None,
                   direction: str | None = None, models: dict[str, Any] | None = None,
                   geometry: Geometry | None = None) -> None:
    """Refuse a translator made for another family, key space, direction, pair or geometry (TranslatorError
    naming the field, both values and the fix). Fields the manifest does not record are not compared."""
    if family is not None and manifest["family"] != family:
        raise TranslatorError(f"translator family is {manifest['family']!r}, this run asks for {family!r}; "
                              f"pass --family {manifest['family']} or train a {family} translator")
    if key_space is not None and manifest.get("key_space") != key_space:
        raise TranslatorError(f"translator key space is {manifest.get('key_space')!r}, this run asks for "
                              f"{key_space!r}; pass --key-space {manifest.get('key_space')} or train one in {key_space!r}")
    if direction and manifest.get("direction") not in (None, direction):
        raise TranslatorError(f"translator was trained for direction {manifest['direction']!r}, this run is "
                              f"{direction!r}; pass --direction {manifest['direction']} or train one for this direction")
    if geometry is not None and Geometry(**manifest["geometry"]) != geometry:
        raise TranslatorError(f"translator geometry {manifest['geometry']} does not fit this pair's "
                              f"{asdict(geometry)}: it was trained for another pair; check --large/--small/--direction")
    for role, ident in (models or {}).items():
        trained = manifest.get("models", {}).get(role)
        if trained is not None and not same_model(trained, ident):
            raise TranslatorError(f"translator was trained for another {role} model ({trained}), not {ident}; "
                                  "use one trained for this pair")


def load_translator(folder: str | Path, pair, *, family: str | None = None, key_space: str | None = None,
                    manifest_file: str = MANIFEST_FILE) -> tuple[Translator, dict[str, Any]]:
    """The one loader: a frozen translator from `folder`, checked against `pair` and bound to its models.

    `pair` is a `kvlingo.run.models.Pair` (anything with source, target, direction and
    `identities()`). `manifest_file` names the file holding the spec (an exported folder's is
    config.json). Returns (translator, provenance: the manifest plus `path` and `manifest_sha256`).
    """
    folder = Path(folder)
    try:
        manifest = read_manifest(folder, manifest_file)
        check_expected(manifest, family=family, key_space=key_space, direction=pair.direction,
                       models=pair.identities(), geometry=Geometry.of(pair.source, pair.target))
    except TranslatorError as err:
        raise TranslatorError(f"{folder}: {err}") from None
    device = next(pair.target.parameters()).device
    translator = load_state(folder, manifest, device).bind(pair.source, pair.target)
    translator.requires_grad_(False)
    info = {**manifest, "path": str(folder.resolve()), "manifest_sha256": sha256_file(folder / manifest_file)}
    return translator, info

