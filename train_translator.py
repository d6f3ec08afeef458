"""Train a KV-cache translator: closed-form fit, then distillation against the frozen target.

Reads DATA/{train,validation}.natural.jsonl (a complete prepared folder: its manifest, every
file's sha256 and its tokenizer are checked) and writes
  ARTIFACTS/RUN/closed_form/   the translator fitted in closed form (FP64 least squares)
  ARTIFACTS/RUN/distilled/     the same after distillation (KL to the native target)
  ARTIFACTS/RUN/checkpoints/   ckpt_<update>.pt + DONE_<update> markers (resume with --resume)
  RESULTS/RUN/train.json       the report (+ train.md summary and train.png curves beside it)

Every check (pair, data, tokenizer, --init-from, resume) runs before anything is written, so
a refused run leaves a finished one exactly as it was. A run that finished under the same config,
data, models, code and --init-from maps, its translators intact, is up to date: nothing runs
(--force trains again).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from kvlingo.core.handoff import stop_ids
from kvlingo.core.refresh import Refresh
from kvlingo.errors import Refusal
from kvlingo.inputs.argtypes import share, whole
from kvlingo.inputs.data import open_prepared, read_split, split_path
from kvlingo.inputs.models import load_pair, pair_config_from_args
from kvlingo.inputs.profiles import get_profile
from kvlingo.io import atomic_write_bytes, atomic_write_text, sha256_bytes, sha256_file, sha256_json
from kvlingo.records import resume
from kvlingo.records.paths import check_outputs, default_data, run_paths
from kvlingo.records.report import Report, figure, figure_png, fmt_table
from kvlingo.records.saved import (
    MANIFEST_FILE,
    MAPS_FILE,
    check_expected,
    load_state,
    read_manifest,
    save_translator,
    state_bytes,
)
from kvlingo.records.saved import build as build_translator
from kvlingo.stages.stage import add_refresh_arg, lock_run, refusals_exit, stage_parser
from kvlingo.train import checkpoints as ckpt
from kvlingo.train import distributed
from kvlingo.train.closed_form import fit_closed_form
from kvlingo.train.config import RESUME_SAFE, TrainConfig, TrainResults, add_family_args, family_flags, resolve_family
from kvlingo.train.distill import distill_step, make_optimizer, validation_kl
from kvlingo.train.footprint import add_estimate_args, before_training
from kvlingo.train.frozen import FrozenWeightsChanged, check_frozen, fingerprints, verify_frozen
from kvlingo.train.rng import rng_state, seed_everything, set_rng_state
from kvlingo.train.rows import data_order, fit_selection
from kvlingo.train.weighting import FIT_WEIGHTINGS

SCRIPT = Path(__file__).resolve()


def build_parser() -> argparse.ArgumentParser:
    p = stage_parser(
        __doc__,
        [
            "python train_translator.py --profile demo --large artifacts/toy/large --small artifacts/toy/small "
            "--device cpu --dtype float32",
            "python train_translator.py --profile pilot --run pilot-l2s --device cuda --resume",
            "python train_translator.py --profile pilot --run lr3e-4 --init-from "
            "artifacts/pilot-l2s/closed_form --lr 3e-4",
        ],
        common=True,
        data=True,
    )
    add_family_args(p)  # --family and every family's option flags (kvlingo/core/families)
    p.add_argument(
        "--aux-attn-weight",
        type=float,
        default=0.0,
        help="weight of the attention-output MSE added to the KL during distillation (default 0)",
    )
    p.add_argument(
        "--key-space", choices=("prenorm", "cache"), default="prenorm", help="what the key maps read and write"
    )
    add_refresh_arg(p)  # the setting the translated cache is trained and validated under (e.g. exact:0)
    p.add_argument(
        "--context-weight",
        type=share,
        default=0.0,
        help="α in [0, 1]: weight each reply token's KL by how much the context changes the native "
        "prediction there (kvlingo/train/objectives.py; default 0: plain mean)",
    )
    p.add_argument(
        "--onpolicy",
        type=share,
        default=0.0,
        help="λ in [0, 1]: share of conversations scored on a reply the target samples from the translated "
        "cache (on-policy distillation; default 0)",
    )
    p.add_argument(
        "--keep-best",
        action="store_true",
        help="save the translator at the validation with the lowest KL (early stopping), not the last",
    )
    p.add_argument(
        "--n-train",
        type=whole(1),
        default=None,
        help="train on the first N conversations of the train split (default: all of them)",
    )
    p.add_argument(
        "--fit-weighting",
        choices=FIT_WEIGHTINGS,
        default=None,
        help="closed-form weighting: uniform, or context positions by the target's reply-time attention "
        "(default: the profile's)",
    )
    p.add_argument(
        "--ridge",
        default=None,
        help="ridge λ of the closed-form fit, or 'auto': chosen per block on held-out fit conversations "
        "(default: the profile's, auto)",
    )
    p.add_argument(
        "--lr", type=float, default=None, help="AdamW learning rate (default: the profile's for the direction)"
    )
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default 0)")
    p.add_argument(
        "--max-grad-norm", type=float, default=1.0, help="clip the translator's gradient norm per update (0: off)"
    )
    p.add_argument("--seed", type=int, default=42, help="seed of the data order and every RNG")
    p.add_argument("--updates", type=int, default=None, help="distillation updates (default: the profile's)")
    p.add_argument("--batch", type=int, default=None, help="conversations per update (default: the profile's)")
    p.add_argument(
        "--n-fit", type=int, default=None, help="conversations in the closed-form fit (default: the profile's)"
    )
    p.add_argument("--val-every", type=int, default=None, help="validation KL every N updates (default: the profile's)")
    p.add_argument(
        "--checkpoint-every", type=int, default=None, help="checkpoint every N updates (default: the profile's)"
    )
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint of --run")
    p.add_argument(
        "--force",
        action="store_true",
        help="train again even when train.json is up to date (same config, data, models and code)",
    )
    p.add_argument(
        "--init-from", default=None, help="start from an existing closed-form translator folder instead of fitting"
    )
    p.add_argument("--closed-form-only", action="store_true", help="stop after the closed-form fit and its validation")
    add_estimate_args(p)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(distributed.script_args(argv))  # under torchrun the flags follow a `--`


def given(value, default):
    return default if value is None else value


def ridge_value(text):
    if text == "auto":
        return "auto"
    try:
        return positive("ridge", float(text), allow_zero=True)
    except ValueError:
        raise Refusal(f"--ridge {text} is invalid: give a number ≥ 0, or auto") from None


def family_from_args(args, profile, pair_cfg) -> tuple[str, dict]:
    """The family and its settings (`resolve_family`): --family with its own defaults and the flags given, or
    the profile's variant for the direction; defaults that depend on the shapes take the pair's."""
    from kvlingo.core.translator import Geometry

    try:
        return resolve_family(
            profile, pair_cfg.direction, args.family, family_flags(args), Geometry(**pair_cfg.geometry)
        )
    except (TypeError, ValueError) as e:
        raise Refusal(f"--family {args.family or profile.family_for(pair_cfg.direction)}: {e}") from None


def positive(name: str, value, allow_zero: bool = False):
    if (
        value is None
        or (value < 0 if allow_zero else value <= 0)
        or (isinstance(value, float) and not math.isfinite(value))
    ):
        raise Refusal(f"--{name} {value} is invalid: it must be a finite number {'≥ 0' if allow_zero else '> 0'}")
    return value


def artifact_bytes(empty, cfg: TrainConfig, args, state: dict | None, ckpt_dir: Path) -> int:
    """About what the run writes under --artifacts: the closed-form and distilled maps, and each checkpoint
    still to come (the maps and AdamW's two moments), less the old checkpoints a fresh run removes first."""
    maps = sum(v.numel() * v.element_size() for v in empty.state_dict().values())
    if args.closed_form_only:
        return maps
    start = state["update"] if state is not None else 0
    checkpoints = sum(1 for u in range(start + 1, cfg.updates + 1) if u % cfg.checkpoint_every == 0 or u == cfg.updates)
    removed = 0 if args.resume else sum(p.stat().st_size for p in ckpt_dir.glob("ckpt_*.pt") if p.is_file())
    return max(0, 2 * maps + checkpoints * 3 * maps - removed)


def finished_training(paths, key: str, args) -> dict | None:
    """The run's train.json when this training already finished: made under resume key `key` (config, data,
    models, code), the same kind of run (--closed-form-only or not, from --init-from maps with the same
    sha256), and its translators still there holding the maps it records."""
    old = resume.up_to_date(paths.report("train"), key)
    if old is None:
        return None
    art, init = old["results"].get("artifacts") or {}, old["inputs"].get("init_from")
    if (art.get("distilled") is None) != args.closed_form_only or bool(init) != bool(args.init_from):
        return None

    def maps_sha(folder: Path) -> str | None:
        maps = folder / MAPS_FILE
        return sha256_file(maps) if maps.is_file() and (folder / MANIFEST_FILE).is_file() else None

    def intact(folder: Path) -> bool:  # the manifest as written (its content hash) and the maps it records
        try:
            read_manifest(folder)
        except Refusal:
            return False
        return True

    if args.init_from and maps_sha(Path(args.init_from)) != init.get("maps_sha256"):
        return None
    kinds = ("closed_form",) if args.closed_form_only else ("closed_form", "distilled")
    return (
        old
        if all(maps_sha(paths.translator(k)) == art.get(f"{k}_sha256") and intact(paths.translator(k)) for k in kinds)
        else None
    )


def plot_curves(path: Path, loss: list, val: list, title: str) -> None:
    fig, ax = figure((7, 4))
    if loss:
        ax.plot([u for u, _ in loss], [x for _, x in loss], label="train loss (batch KL)", lw=1)
    ax.plot([u for u, _ in val], [x for _, x in val], "o-", label="validation KL")
    ax.set_xlabel("update")
    ax.set_ylabel("KL(native ‖ translated), nats per reply token")
    ax.set_title(title)
    ax.legend()
    atomic_write_bytes(path, figure_png(fig))


def closed_form_start(
    init_from: str | None,
    init: dict | None,
    pair,
    cfg: TrainConfig,
    fit_rows: list[dict],
    cf_dir: Path,
    fit_key: str,
    empty,
    world: distributed.World = distributed.SINGLE,
):
    """The run's closed-form translator, in memory: from --init-from (its checked manifest `init`), reused
    when cf_dir's fit key matches, or fitted into `empty` (an unfitted translator of the run's family). Returns
    (translator, fit stats, provenance to save, or None
    when cf_dir already holds it)."""
    if init_from:
        translator = load_state(init_from, init, pair.device).bind(pair.source, pair.target)
        same = Path(init_from).resolve() == cf_dir.resolve()
        return (
            translator,
            init.get("fit"),
            None if same else {"fit_key": init.get("fit_key"), "fit": init.get("fit"), "copied_from": str(init_from)},
        )
    if (cf_dir / MANIFEST_FILE).is_file():
        try:
            old = read_manifest(cf_dir)  # its maps against their hash, and itself against its content hash
        except ValueError as e:  # damaged or edited: fit again (the fit replaces it)
            print(f"closed-form fit not reused: {e} (this run fits it again)")
            old = {}
        if old.get("fit_key") == fit_key:
            print(f"closed-form fit up to date (same data, code, models and fit settings): {cf_dir}")
            return load_state(cf_dir, old, pair.device).bind(pair.source, pair.target), old.get("fit"), None
    translator = empty.to(pair.device).bind(pair.source, pair.target)
    bar = lambda rows: tqdm(rows, desc="closed-form fit", unit="conv", disable=not world.main)  # noqa: E731
    stats = fit_closed_form(
        pair.source,
        pair.target,
        translator,
        fit_rows,
        cfg.fit_weighting,
        cfg.ridge,
        progress=bar,
        world=world,
        kind=pair.cache,
    )
    return translator, stats, {"fit_key": fit_key, "fit": stats}


@refusals_exit("train_translator", resumable=True)
def main(argv=None) -> dict:
    args = parse_args(argv)
    t0 = time.time()
    profile = get_profile(args.profile)
    paths = run_paths(args)
    ckpt_dir, cf_dir, dist_dir = paths.checkpoints, paths.translator("closed_form"), paths.translator("distilled")

    # --------------------------------------------------------------------------- checks before any change
    pair_cfg, tokenizer = pair_config_from_args(args)  # configs and tokenizers only: refuses before weights
    world = distributed.init(pair_cfg.device)  # torchrun's ranks (kvlingo/train/distributed.py); else one process
    data_dir = Path(args.data) if args.data else default_data(profile.name)
    manifest = open_prepared(data_dir, pair_cfg)
    family, settings = family_from_args(args, profile, pair_cfg)
    data_hashes = {
        f: manifest["files"][f] for f in (split_path(data_dir, s, "natural").name for s in ("train", "validation"))
    }
    cfg = TrainConfig(
        profile=profile.name,
        family=family,
        family_settings=settings,
        key_space=args.key_space,
        fit_weighting=given(args.fit_weighting, profile.fit_weighting),
        ridge=ridge_value(str(given(args.ridge, profile.ridge))),
        aux_attn_weight=positive("aux-attn-weight", args.aux_attn_weight, allow_zero=True),
        refresh=str(args.refresh),
        context_weight=args.context_weight,
        onpolicy=args.onpolicy,
        keep_best=args.keep_best,
        n_train=args.n_train or 0,
        n_fit=positive("n-fit", given(args.n_fit, profile.n_fit)),
        updates=positive("updates", given(args.updates, profile.updates), allow_zero=True),
        batch=positive("batch", given(args.batch, profile.batch)),
        lr=positive("lr", given(args.lr, profile.lr_for(pair_cfg.direction))),
        weight_decay=positive("weight-decay", args.weight_decay, allow_zero=True),
        max_grad_norm=positive("max-grad-norm", args.max_grad_norm, allow_zero=True),
        val_every=positive("val-every", given(args.val_every, profile.val_every)),
        checkpoint_every=positive("checkpoint-every", given(args.checkpoint_every, profile.checkpoint_every)),
        seed=args.seed,
        pair=pair_cfg,
    )
    n_train = manifest.get("n_samples", {}).get("train.natural")
    if isinstance(n_train, int) and cfg.n_train > n_train:
        raise Refusal(
            f"--n-train {cfg.n_train} is more than the {n_train} training conversations in {data_dir}; "
            f"give --n-train {n_train} or less, or prepare a larger split"
        )
    if cfg.n_train:
        n_train = cfg.n_train
    if isinstance(n_train, int) and cfg.batch > n_train:
        raise Refusal(
            f"--batch {cfg.batch} is more than the {n_train} training conversations in {data_dir}: "
            f"every one would repeat within each update; give --batch {n_train} or less"
        )
    code_sha = resume.code_hash(SCRIPT)
    identity = resume.identity(cfg, {"data": data_hashes}, pair_cfg.identities(), code_sha)
    done = None if args.force else finished_training(paths, resume.resume_key(identity), args)
    if done is not None:  # read again under the run's locks: a training still rewriting it is refused
        lock_run(paths.res, "train")
        lock_run(paths.art, "train", root_flag="--artifacts")
        done = finished_training(paths, resume.resume_key(identity), args)
    if done is not None:
        if world.main:
            md = paths.beside("train", ".md")
            print(
                f"{paths.report('train')} is up to date (same config, inputs and code); --force re-trains\n"
                + (md.read_text() if md.is_file() else ""),
                end="",
            )
        distributed.close(world)
        return done
    state = None
    if args.resume:
        state = ckpt.newest_checkpoint(ckpt_dir, warn=lambda m: tqdm.write(m))
        if state is not None:
            resume.check(state["identity"], identity, f"{paths.run} from its checkpoint", ignore=RESUME_SAFE)
    # The family is built from the configs' geometry now, so a geometry it cannot map is refused before weights load.
    empty = build_translator(
        {
            "family": cfg.family,
            "key_space": cfg.key_space,
            "settings": cfg.family_settings,
            "geometry": pair_cfg.geometry,
        }
    )
    init = None
    if args.init_from:
        init = read_manifest(args.init_from)  # refuses a missing or damaged folder before anything is written
        check_expected(
            init, family=cfg.family, key_space=cfg.key_space, direction=pair_cfg.direction, models=pair_cfg.identities()
        )
    estimate: list[str] = []  # peak memory and time per update: printed once the outputs and the run lock are sure
    try:
        before_training(pair_cfg, empty, cfg, profile, world, args, say=estimate.append)
    except Refusal:  # a misfit: the estimate is its reason
        print("\n".join(estimate))
        raise
    check_outputs([paths.report("train"), paths.beside("train", ".md"), paths.beside("train", ".png")])
    check_outputs(
        [d / f for d in (cf_dir, dist_dir) for f in (MAPS_FILE, MANIFEST_FILE)],
        [ckpt_dir],
        "--artifacts",
        artifact_bytes(empty, cfg, args, state, ckpt_dir),
    )
    lock_run(paths.res, "train")  # one training per run: checkpoints and translators are its alone
    lock_run(paths.art, "train", root_flag="--artifacts")  # two --results roots still share one run's artifacts
    if world.main and estimate:
        print("\n".join(estimate))
    pair = load_pair(pair_cfg, tokenizer)
    models = {"source": pair.source, "target": pair.target}
    check_frozen(models)
    weights_before = fingerprints(models)
    vocab = pair.target.config.vocab_size
    train_rows, val_rows = (read_split(data_dir, s, "natural", vocab) for s in ("train", "validation"))
    if cfg.n_train:  # the split is a seeded sample already: its first n are a random subset, nested in larger ones
        train_rows = train_rows[: cfg.n_train]
    seed_everything(cfg.seed)
    fit_rows = [train_rows[i] for i in fit_selection(len(train_rows), cfg.n_fit, cfg.seed)]
    if len(fit_rows) < cfg.n_fit and not args.init_from:
        print(
            f"note: the train split holds {len(train_rows)} conversations, fewer than n_fit={cfg.n_fit}; fitting on all"
        )
    fit_key = sha256_json(
        {"fit": cfg.fit_settings(), "pair": pair_cfg, "data": data_hashes["train.natural.jsonl"], "code": code_sha}
    )
    translator, fit_stats, to_save = closed_form_start(
        args.init_from, init, pair, cfg, fit_rows, cf_dir, fit_key, empty, world
    )
    cf_sha = sha256_bytes(state_bytes(translator)) if to_save is not None else sha256_file(cf_dir / MAPS_FILE)
    if state is not None and state["closed_form_sha256"] != cf_sha:
        raise resume.ResumeRefused(
            f"refusing to resume {paths.run}: closed-form start changed: maps sha256 "
            f"{state['closed_form_sha256'][:12]}… → {cf_sha[:12]}…; start a fresh run (drop --resume) "
            "or restore the original inputs"
        )

    # --------------------------------------------------------------------------- now change things (rank 0)
    world.barrier()  # every rank has read what it needs
    if args.resume:
        print(
            f"resuming {paths.run} from update {state['update']}"
            if state
            else f"no checkpoint in {ckpt_dir}: starting fresh"
        )
        if state and state.get("world_size", 1) != world.size:
            print(
                f"note: the checkpoint was written by {state.get('world_size', 1)} rank(s), this run has {world.size}: "
                "the batch and data order are the same, the sums differ by rounding only"
            )
        if world.main:
            ckpt.clear_checkpoints(ckpt_dir, temp_only=True)  # half-written files of the interrupted run
    elif world.main and ckpt.clear_checkpoints(ckpt_dir):
        print(f"fresh run: removed the old checkpoints in {ckpt_dir}")
    provenance = {
        "direction": pair_cfg.direction,
        "models": pair.identities(),
        "data": data_hashes,
        "code_sha256": code_sha,
        "config": asdict(cfg),
        "config_sha256": sha256_json(cfg),
    }
    if world.main:
        # Until this run saves its own, no distilled manifest may vouch for a translator in this run's folder.
        (dist_dir / MANIFEST_FILE).unlink(missing_ok=True)
        if to_save is not None:
            save_translator(cf_dir, translator, {**provenance, "stage": "closed_form", **to_save})

    # --------------------------------------------------------------------------- distillation
    optimizer = make_optimizer(translator, cfg.lr, cfg.weight_decay)
    order = data_order(len(train_rows), cfg.seed, cfg.updates * cfg.batch)

    def validate() -> float:
        bar = lambda rows: tqdm(rows, desc="validation", unit="conv", leave=False, disable=not world.main)  # noqa: E731
        return validation_kl(
            pair.source, pair.target, translator, val_rows, pair.dtype, bar, world, refresh, pair.cache
        )

    def state_copy() -> dict:
        return {k: v.detach().cpu().clone() for k, v in translator.state_dict().items()}

    refresh = Refresh.parse(cfg.refresh)
    eos = stop_ids(pair.tokenizer) if cfg.onpolicy else None
    if state is None:
        history = {"loss": [], "val": [[0, validate()]], "wall_time_s": 0.0, "segments": []}
        start, resumed_from = 0, None
        best = {"update": 0, "val_kl": history["val"][0][1], "translator": state_copy()} if cfg.keep_best else None
    else:
        best = state.get("best")
        translator.load_state_dict(state["translator"])
        optimizer.load_state_dict(state["optimizer"])
        if state["data_order"].tolist() != order:
            raise resume.ResumeRefused(
                "refusing to resume: data changed: the saved data order differs; start a fresh run (drop --resume)"
            )
        set_rng_state(state["rng"])
        history, start, resumed_from = state["history"], state["update"], state["update"]
    cf_kl = history["val"][0][1]
    segment = {"checkpoint_every": cfg.checkpoint_every, "world_size": world.size}  # what a resume may change
    if not history["segments"] or {k: history["segments"][-1][k] for k in segment} != segment:
        history["segments"].append({"from_update": start, **segment})
    segment_t0 = time.time()

    def checkpoint(update: int) -> None:
        saved = {**history, "wall_time_s": history["wall_time_s"] + time.time() - segment_t0}  # never read by training
        if world.main:  # every rank holds the same state; the others wait at the barrier below
            ckpt.save_checkpoint(
                ckpt_dir,
                update,
                {
                    "config": asdict(cfg),
                    "identity": identity,
                    "closed_form_sha256": cf_sha,
                    "translator": {k: v.detach().cpu() for k, v in translator.state_dict().items()},
                    "optimizer": optimizer.state_dict(),
                    "rng": rng_state(),
                    "data_order": torch.tensor(order, dtype=torch.long),
                    "cursor": update * cfg.batch,
                    "history": saved,
                    "best": best,
                    "world_size": world.size,
                },
            )
        world.barrier()

    if not args.closed_form_only:
        bar = tqdm(
            range(start, cfg.updates),
            initial=start,
            total=cfg.updates,
            desc="distil",
            unit="update",
            disable=not world.main,
        )
        for u in bar:
            rows = [train_rows[i] for i in order[u * cfg.batch : (u + 1) * cfg.batch]]
            loss = distill_step(
                pair.source,
                pair.target,
                translator,
                rows,
                optimizer,
                pair.dtype,
                cfg.max_grad_norm,
                world=world,
                aux_weight=cfg.aux_attn_weight,
                refresh=refresh,
                context_weight=cfg.context_weight,
                onpolicy=cfg.onpolicy,
                first_index=u * cfg.batch,
                eos_ids=eos,
                kind=pair.cache,
            )
            done = u + 1
            history["loss"].append([done, loss])
            if done % cfg.val_every == 0 or done == cfg.updates:
                history["val"].append([done, validate()])
                if best is not None and history["val"][-1][1] < best["val_kl"]:
                    best = {"update": done, "val_kl": history["val"][-1][1], "translator": state_copy()}
            bar.set_postfix(loss=f"{loss:.4f}", val_kl=f"{history['val'][-1][1]:.4f}")
            if done % cfg.checkpoint_every == 0 or done == cfg.updates:
                checkpoint(done)
        bar.close()

    # --------------------------------------------------------------------------- outputs
    try:
        frozen = verify_frozen(models, weights_before)
    except FrozenWeightsChanged as e:
        raise FrozenWeightsChanged(
            f"{e}; the distilled translator was not saved. Nothing may write to the models during training."
        ) from None
    if not world.main:  # rank 0 writes the outputs
        distributed.close(world)
        return None
    dist_kl, dist_sha = None, None
    if not args.closed_form_only:
        dist_kl = history["val"][-1][1]
        if best is not None:  # early stopping: the translator of the lowest validation KL, the closed form included
            translator.load_state_dict(best["translator"])
            dist_kl = best["val_kl"]
        save_translator(
            dist_dir,
            translator,
            {
                **provenance,
                "stage": "distilled",
                "closed_form_sha256": cf_sha,
                "updates": cfg.updates,
                "val_kl": dist_kl,
            },
        )
        dist_sha = sha256_file(dist_dir / MAPS_FILE)
    wall = time.time() - t0
    plot = paths.beside("train", ".png")
    plot_curves(
        plot,
        history["loss"],
        history["val"],
        f"{paths.run}: {pair_cfg.direction}, {cfg.family}, {cfg.key_space}, lr {cfg.lr:g}",
    )
    results = TrainResults(
        closed_form_val_kl=cf_kl,
        distilled_val_kl=dist_kl,
        loss_curve=[{"update": u, "loss": x} for u, x in history["loss"]],
        val_kl_curve=[{"update": u, "val_kl": x} for u, x in history["val"]],
        fit=fit_stats,
        frozen_weights=frozen,
        resumed_from_update=resumed_from,
        segments=history["segments"],
        wall_time_s_total=history["wall_time_s"] + time.time() - segment_t0,
        best=None if best is None else {"update": best["update"], "val_kl": best["val_kl"]},
        translator={
            "family": cfg.family,
            "n_params": translator.n_params(),
            "flops_per_token": translator.flops_per_token(),
        },
        artifacts={
            "closed_form": str(cf_dir),
            "closed_form_sha256": cf_sha,
            "distilled": None if args.closed_form_only else str(dist_dir),
            "distilled_sha256": dist_sha,
            "checkpoints": str(ckpt_dir),
            "plot": str(plot),
        },
    )
    report = Report(
        "train",
        config=cfg,
        inputs={
            "data": data_hashes,
            "data_dir": str(data_dir),
            "code_sha256": code_sha,
            "models": pair.identities(),
            "init_from": args.init_from and {"path": args.init_from, "maps_sha256": cf_sha},
        },
        results=results,
        metrics=TrainResults.METRICS,
        n_samples={
            "fit_conversations": len(fit_rows) if not args.init_from else None,
            "train_conversations": len(train_rows),
            "validation_conversations": len(val_rows),
            "updates": 0 if args.closed_form_only else cfg.updates,
            "batch": cfg.batch,
        },
        seeds={"seed": cfg.seed},
        wall_time_s=wall,
        device=pair.device,
        dtype=pair_cfg.dtype,
        resume_key=resume.resume_key(identity),
        files={"train.png": sha256_file(plot)},
    ).write(paths.report("train"))
    table = fmt_table(
        ["translator", "validation KL (nats/token)", "artifact"],
        [["closed form", cf_kl, str(cf_dir)], ["distilled", dist_kl, str(dist_dir) if dist_sha else "—"]],
    )
    atomic_write_text(
        paths.beside("train", ".md"),
        (
            f"# train: {paths.run}\n\n{pair.source_spec.name_or_path} → {pair.target_spec.name_or_path} "
            f"({pair_cfg.direction}), family {cfg.family}, key space {cfg.key_space}, fit weighting "
            f"{cfg.fit_weighting}, "
            f"{pair_cfg.dtype} on {pair_cfg.device}; {cfg.updates} updates × batch {cfg.batch}, lr {cfg.lr:g}, "
            f"seed {cfg.seed}.\n\n{table}\nFrozen model weights verified unchanged. Wall time {wall:.1f} s.\n\n"
            "![curves](train.png)\n"
        ),
    )
    print(table, end="")
    print(f"report: {paths.report('train')}")
    distributed.close(world)
    return report


if __name__ == "__main__":
    main()
