"""Train the KV-cache translator: closed-form fit, then distillation against the frozen target.

Reads data/<profile>/{train,validation}.natural.jsonl (checked against the data manifest when
there is one) and writes
  artifacts/<run>/closed_form/   maps fitted in closed form (FP64 least squares)
  artifacts/<run>/distilled/     the same maps after distillation (KL to the native target)
  artifacts/<run>/checkpoints/   ckpt_<update>.pt + DONE_<update> markers (resume with --resume)
  results/<run>/train.json       the report (+ train.md summary and train.png curves beside it)

Usage:
  python train_translator.py --profile demo --run demo-l2s --large PATH --small PATH --device cpu --dtype float32
  python train_translator.py --profile pilot --run pilot-l2s --device cuda --resume
  python train_translator.py --profile pilot --run lr3e-4 --init-from artifacts/pilot-l2s/closed_form --lr 3e-4
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from kvlingo import train as T
from kvlingo.data import MANIFEST as DATA_MANIFEST, SplitIntegrityError, split_path, verify_split
from kvlingo.maps import MANIFEST_FILE, Translator, load_maps, save_maps
from kvlingo.models import add_pair_args, dtype_name, pair_from_args
from kvlingo.profiles import get_profile
from kvlingo.report import (atomic_write_bytes, figure_png, atomic_write_json, atomic_write_text, code_hash, fmt_table,
                            make_report, sha256_file, sha256_json)

SCRIPT = Path(__file__).resolve()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Fit the head-wise KV translator in closed form, then distil it against the frozen target.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  python train_translator.py --profile demo --run demo-l2s --large PATH --small PATH --device cpu --dtype float32\n"
        "  python train_translator.py --profile pilot --run pilot-l2s --device cuda --resume\n"
        "  python train_translator.py --profile pilot --run lr3e-4 --init-from artifacts/pilot-l2s/closed_form --lr 3e-4",
    )
    p.add_argument("--profile", default="pilot", help="run profile (pilot, paper-budget, demo, tiny)")
    p.add_argument("--data", default=None, help="prepared data folder (default data/<profile>)")
    p.add_argument("--run", required=True, help="run name: outputs go to <artifacts>/<run>/ and <results>/<run>/")
    add_pair_args(p)
    p.add_argument("--key-space", choices=("prenorm", "cache"), default="prenorm", help="what the key maps read and write")
    p.add_argument("--fit-weighting", choices=T.FIT_WEIGHTINGS, default="uniform",
                   help="closed-form weighting: uniform, or context positions by the target's reply-time attention")
    p.add_argument("--ridge", type=float, default=0.0, help="ridge λ of the closed-form fit (default 0)")
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default 1e-4 for l2s, 1e-3 for s2l)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default 0)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the maps' gradient norm per update (0: off)")
    p.add_argument("--seed", type=int, default=42, help="seed of the data order and every RNG")
    p.add_argument("--updates", type=int, default=None, help="distillation updates (default: the profile's)")
    p.add_argument("--batch", type=int, default=None, help="conversations per update (default: the profile's)")
    p.add_argument("--n-fit", type=int, default=None, help="conversations in the closed-form fit (default: the profile's)")
    p.add_argument("--val-every", type=int, default=None, help="validation KL every N updates (default: the profile's)")
    p.add_argument("--checkpoint-every", type=int, default=None, help="checkpoint every N updates (default: the profile's)")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint of --run")
    p.add_argument("--init-from", default=None, help="start from an existing closed-form maps folder instead of fitting")
    p.add_argument("--closed-form-only", action="store_true", help="stop after the closed-form fit and its validation")
    p.add_argument("--artifacts", default="artifacts", help="root folder for maps and checkpoints")
    p.add_argument("--results", default="results", help="root folder for reports")
    p.add_argument("--code-salt", default="", help=argparse.SUPPRESS)  # tests: stands in for a code edit
    return p.parse_args(argv)


def given(value, default):
    return default if value is None else value


def positive(name: str, value, allow_zero: bool = False):
    if value is None or (value < 0 if allow_zero else value <= 0) or (isinstance(value, float) and not math.isfinite(value)):
        raise SystemExit(f"--{name} {value} is invalid: it must be {'≥ 0' if allow_zero else '> 0'}")
    return value


def load_data(data_dir: Path, vocab: int) -> tuple[list[dict], list[dict], dict[str, str]]:
    """Train and validation rows, checked against the manifest if there is one; sha256 of each file read."""
    if not data_dir.is_dir():
        raise SystemExit(f"{data_dir} not found: prepare the data first (python paper_data.py --profile ...) or pass --data")
    if (data_dir / DATA_MANIFEST).is_file():
        try:
            verify_split(data_dir)
        except SplitIntegrityError as e:
            raise SystemExit(str(e)) from e
    out, hashes = [], {}
    for split in ("train", "validation"):
        path = split_path(data_dir, split, "natural")
        try:
            out.append(T.read_rows(path, vocab))
        except ValueError as e:
            raise SystemExit(str(e)) from e
        hashes[path.name] = sha256_file(path)
    return out[0], out[1], hashes


def plot_curves(path: Path, loss: list, val: list, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if loss:
        ax.plot([u for u, _ in loss], [x for _, x in loss], label="train loss (batch KL)", lw=1)
    ax.plot([u for u, _ in val], [x for _, x in val], "o-", label="validation KL")
    ax.set_xlabel("update")
    ax.set_ylabel("KL(native ‖ translated), nats per reply token")
    ax.set_title(title)
    ax.legend()
    atomic_write_bytes(path, figure_png(fig))


def closed_form_maps(args, pair, cfg: T.TrainConfig, fit_rows: list[dict], cf_dir: Path, fit_key: str,
                     manifest_base: dict):
    """The run's closed-form maps, saved in cf_dir: copied from --init-from, reused when its fit key matches, or fitted."""
    if args.init_from:
        try:
            maps, init = load_maps(args.init_from, pair.device)
            T.check_maps_for_pair(init, cfg.direction, manifest_base["models"], cfg.key_space)
        except (FileNotFoundError, ValueError) as e:
            raise SystemExit(f"--init-from {args.init_from}: {e}") from e
        if init.get("data", {}).get("train.natural.jsonl") != manifest_base["data"]["train.natural.jsonl"]:
            print("note: the --init-from maps were fitted on other train data than this run reads")
        if Path(args.init_from).resolve() != cf_dir.resolve():
            save_maps(cf_dir, maps, {**manifest_base, "stage": "closed_form", "fit_key": init.get("fit_key"),
                                     "fit": init.get("fit"), "copied_from": str(args.init_from)})
        return maps, init.get("fit")
    if (cf_dir / MANIFEST_FILE).is_file():
        try:
            maps, old = load_maps(cf_dir, pair.device)
        except ValueError:  # damaged: fit again
            old = {}
        if old.get("fit_key") == fit_key:
            print(f"closed-form fit up to date (same data, code, models and fit settings): {cf_dir}")
            return maps, old.get("fit")
    bar = lambda rows: tqdm(rows, desc="closed-form fit", unit="conv")  # noqa: E731
    maps, stats = T.fit_closed_form(pair.source, pair.target, fit_rows, cfg.key_space, cfg.fit_weighting, cfg.ridge,
                                    progress=bar)
    save_maps(cf_dir, maps, {**manifest_base, "stage": "closed_form", "fit_key": fit_key, "fit": stats})
    return maps, stats


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0 = time.time()
    profile = get_profile(args.profile)
    run_dir, res_dir = Path(args.artifacts) / args.run, Path(args.results) / args.run
    ckpt_dir, cf_dir, dist_dir = run_dir / "checkpoints", run_dir / "closed_form", run_dir / "distilled"

    # --------------------------------------------------------------------------- inputs and identity
    pair = pair_from_args(args)
    models = {"source": pair.source, "target": pair.target}
    try:
        T.check_frozen(models)
    except T.FrozenWeightsChanged as e:
        raise SystemExit(str(e)) from e
    weights_before = T.fingerprints(models)
    train_rows, val_rows, data_hashes = load_data(Path(args.data or f"data/{profile.name}"), pair.target.config.vocab_size)
    cfg = T.TrainConfig(
        profile=profile.name, direction=pair.direction, key_space=args.key_space, fit_weighting=args.fit_weighting,
        ridge=positive("ridge", args.ridge, allow_zero=True),
        n_fit=positive("n-fit", given(args.n_fit, profile.n_fit)),
        updates=positive("updates", given(args.updates, profile.updates), allow_zero=True),
        batch=positive("batch", given(args.batch, profile.batch)),
        lr=positive("lr", given(args.lr, T.DEFAULT_LR[pair.direction])),
        weight_decay=positive("weight-decay", args.weight_decay, allow_zero=True),
        max_grad_norm=positive("max-grad-norm", args.max_grad_norm, allow_zero=True),
        val_every=positive("val-every", given(args.val_every, profile.val_every)),
        checkpoint_every=positive("checkpoint-every", given(args.checkpoint_every, profile.checkpoint_every)),
        seed=args.seed, device=pair.device, dtype=dtype_name(pair.dtype),
    )
    code_sha = code_hash(SCRIPT)
    if args.code_salt:
        code_sha = sha256_json({"code": code_sha, "salt": args.code_salt})
    model_ids = {"source": pair.source_spec.identity(), "target": pair.target_spec.identity()}
    identity = T.run_identity(cfg, data_hashes, code_sha, model_ids, weights_before)
    T.seed_everything(cfg.seed)

    # Resume is decided before any work, so that a refusal costs nothing.
    state = None
    if args.resume:
        try:
            state = T.newest_checkpoint(ckpt_dir, warn=lambda m: tqdm.write(m))
            if state is not None:
                T.check_resume(state["identity"], identity)
        except (T.ResumeRefused, T.CheckpointError) as e:
            raise SystemExit(str(e)) from e
        print(f"resuming {args.run} from update {state['update']}" if state
              else f"no checkpoint in {ckpt_dir}: starting fresh")
        T.clear_checkpoints(ckpt_dir, temp_only=True)  # half-written files of the interrupted run
    elif T.clear_checkpoints(ckpt_dir):
        print(f"fresh run: removed the old checkpoints in {ckpt_dir}")
    # Until this run saves its own, no distilled manifest may vouch for maps in this run's folder.
    (dist_dir / MANIFEST_FILE).unlink(missing_ok=True)

    # --------------------------------------------------------------------------- closed-form maps
    fit_rows = [train_rows[i] for i in T.fit_selection(len(train_rows), cfg.n_fit, cfg.seed)]
    if len(fit_rows) < cfg.n_fit and not args.init_from:
        print(f"note: the train split holds {len(train_rows)} conversations, fewer than n_fit={cfg.n_fit}; fitting on all")
    fit_key = sha256_json({"config": {k: getattr(cfg, k) for k in ("key_space", "fit_weighting", "ridge", "n_fit", "seed",
                                                                   "direction", "device", "dtype")},
                           "data": data_hashes["train.natural.jsonl"], "code": code_sha, "models": model_ids})
    manifest_base = {"direction": cfg.direction, "models": model_ids, "data": data_hashes, "code_sha256": code_sha,
                     "config": asdict(cfg), "config_sha256": sha256_json(cfg)}
    maps, fit_stats = closed_form_maps(args, pair, cfg, fit_rows, cf_dir, fit_key, manifest_base)
    cf_sha = sha256_file(cf_dir / "maps.safetensors")
    if state is not None and state["closed_form_sha256"] != cf_sha:
        raise SystemExit(f"refusing to resume: closed-form start changed: maps sha256 {state['closed_form_sha256'][:12]}… "
                         f"→ {cf_sha[:12]}…; start a fresh run (drop --resume) or restore the original inputs")

    # --------------------------------------------------------------------------- distillation
    translator = Translator(maps, pair.source, pair.target)
    optimizer = T.make_optimizer(maps, cfg)
    order = T.data_order(len(train_rows), cfg.seed, cfg.updates * cfg.batch)
    def validate() -> float:
        bar = lambda rows: tqdm(rows, desc="validation", unit="conv", leave=False)  # noqa: E731
        return T.validation_kl(pair.source, pair.target, translator, val_rows, pair.dtype, bar)

    if state is None:
        history = {"loss": [], "val": [[0, validate()]], "wall_time_s": 0.0}
        start, resumed_from = 0, None
    else:
        with torch.no_grad():
            maps.weight.copy_(state["maps"]["weight"])
            maps.bias.copy_(state["maps"]["bias"])
        optimizer.load_state_dict(state["optimizer"])
        if state["data_order"].tolist() != order:
            raise SystemExit("refusing to resume: data changed: the saved data order differs; "
                             "start a fresh run (drop --resume)")
        T.set_rng_state(state["rng"])
        history, start, resumed_from = state["history"], state["update"], state["update"]
    cf_kl = history["val"][0][1]
    segment_t0 = time.time()

    def checkpoint(update: int) -> None:
        saved = {**history, "wall_time_s": history["wall_time_s"] + time.time() - segment_t0}  # never read by training
        T.save_checkpoint(ckpt_dir, update, {
            "config": asdict(cfg), "identity": identity, "closed_form_sha256": cf_sha,
            "maps": {"weight": maps.weight.detach().cpu(), "bias": maps.bias.detach().cpu()},
            "optimizer": optimizer.state_dict(), "rng": T.rng_state(),
            "data_order": torch.tensor(order, dtype=torch.long), "cursor": update * cfg.batch, "history": saved,
        })

    if not args.closed_form_only:
        bar = tqdm(range(start, cfg.updates), initial=start, total=cfg.updates, desc="distil", unit="update")
        for u in bar:
            rows = [train_rows[i] for i in order[u * cfg.batch:(u + 1) * cfg.batch]]
            loss = T.distill_step(pair.source, pair.target, translator, rows, optimizer, pair.dtype, cfg.max_grad_norm)
            done = u + 1
            history["loss"].append([done, loss])
            if done % cfg.val_every == 0 or done == cfg.updates:
                history["val"].append([done, validate()])
            bar.set_postfix(loss=f"{loss:.4f}", val_kl=f"{history['val'][-1][1]:.4f}")
            if done % cfg.checkpoint_every == 0 or done == cfg.updates:
                checkpoint(done)
        bar.close()

    # --------------------------------------------------------------------------- outputs
    try:
        frozen = T.verify_frozen(models, weights_before)
    except T.FrozenWeightsChanged as e:
        raise SystemExit(f"{e}; the distilled maps were not saved. Nothing may write to the models during training.") from e
    dist_kl, dist_sha = None, None
    if not args.closed_form_only:
        dist_kl = history["val"][-1][1]
        save_maps(dist_dir, maps, {**manifest_base, "stage": "distilled", "closed_form_sha256": cf_sha,
                                   "updates": cfg.updates, "val_kl": dist_kl})
        dist_sha = sha256_file(dist_dir / "maps.safetensors")
    wall = time.time() - t0
    plot = res_dir / "train.png"
    plot_curves(plot, history["loss"], history["val"], f"{args.run}: {cfg.direction}, {cfg.key_space}, lr {cfg.lr:g}")
    results = {
        "closed_form_val_kl": cf_kl, "distilled_val_kl": dist_kl,
        "loss_curve": [{"update": u, "loss": x} for u, x in history["loss"]],
        "val_kl_curve": [{"update": u, "val_kl": x} for u, x in history["val"]],
        "fit": fit_stats, "frozen_weights": frozen, "resumed_from_update": resumed_from,
        "wall_time_s_total": history["wall_time_s"] + time.time() - segment_t0,
        "metric": {"name": "val_kl", "definition": "mean over validation conversations of the mean reply-token "
                   "KL(native target || target on the translated cache), nats", "higher_is_better": False},
        "artifacts": {"closed_form": str(cf_dir), "closed_form_sha256": cf_sha,
                      "distilled": None if args.closed_form_only else str(dist_dir), "distilled_sha256": dist_sha,
                      "checkpoints": str(ckpt_dir), "plot": str(plot)},
    }
    report = make_report(
        "train", config=cfg,
        inputs={"data": data_hashes, "data_dir": str(args.data or f"data/{profile.name}"), "code_sha256": code_sha,
                "models": model_ids, "init_from": args.init_from and {"path": args.init_from, "maps_sha256": cf_sha}},
        results=results,
        n_samples={"fit_conversations": len(fit_rows) if not args.init_from else None,
                   "train_conversations": len(train_rows), "validation_conversations": len(val_rows),
                   "updates": 0 if args.closed_form_only else cfg.updates, "batch": cfg.batch},
        seeds={"seed": cfg.seed}, wall_time_s=wall, device=pair.device, dtype=cfg.dtype,
    )
    atomic_write_json(res_dir / "train.json", report)
    table = fmt_table(["maps", "validation KL (nats/token)", "artifact"],
                      [["closed form", cf_kl, str(cf_dir)], ["distilled", dist_kl, str(dist_dir) if dist_sha else "—"]])
    atomic_write_text(res_dir / "train.md", (
        f"# train: {args.run}\n\n{pair.source_spec.name_or_path} → {pair.target_spec.name_or_path} ({cfg.direction}), "
        f"key space {cfg.key_space}, fit weighting {cfg.fit_weighting}, {cfg.dtype} on {cfg.device}; "
        f"{cfg.updates} updates × batch {cfg.batch}, lr {cfg.lr:g}, seed {cfg.seed}.\n\n{table}\n"
        f"Frozen model weights verified unchanged. Wall time {wall:.1f} s.\n\n![curves](train.png)\n"
    ))
    print(table, end="")
    print(f"report: {res_dir / 'train.json'}")
    return report


if __name__ == "__main__":
    main()
