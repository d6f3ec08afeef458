"""The training stage (train_translator.py): a closed-form fit, then distillation against the frozen target.

Reads DATA/{train,validation}.natural.jsonl (a complete prepared folder: its manifest, every
file's sha256 and its tokenizer are checked) and writes
  ARTIFACTS/RUN/closed_form/   the translator fitted in closed form (FP64 least squares)
  ARTIFACTS/RUN/distilled/     the same after distillation (KL to the native target)
  ARTIFACTS/RUN/checkpoints/   ckpt_<update>.pt + DONE_<update> markers (resume with --resume)
  RESULTS/RUN/train.json       the report (+ train.md summary and train.png curves beside it)

Every check (pair, data, tokenizer, --init-from, resume) runs before anything is written, so
a refused run leaves a finished one exactly as it was. A run that finished under the same config,
data, models, code and --init-from maps, its translators intact, is up to date: nothing runs
(--force trains again). The translator, its refresh, its objective and its learning-rate schedule default to the
profile's (`Profile.family`, `refresh`, `objective`, `lr_schedule`); a flag given wins.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

from ..errors import Refusal
from ..inputs.argtypes import number, share, whole
from ..inputs.flags import add_family_args, add_refresh_arg, family_flags
from ..inputs.profiles import get_profile
from ..train.config import DEFAULT_SEED
from ..train.footprint import add_estimate_args
from .skeleton import Stage, lock_run

FIT_WEIGHTINGS = ("uniform", "attention")  # kvlingo.train.weighting (a test holds them equal)
LR_SCHEDULES = ("constant", "linear", "cosine")  # kvlingo.train.distill.lr_at (a test holds them equal)
VALUE_FITS = ("values", "output")  # kvlingo.train.weighting
MEASURED_UPDATES = 3  # updates timed before the measured time per update is printed


class Train(Stage):
    name = "train_translator"
    script = "train_translator.py"
    summary = "Train a KV-cache translator: closed-form fit, then distillation against the frozen target."
    examples = (
        ".venv/bin/python train_translator.py --profile demo --large artifacts/toy/large --small artifacts/toy/small "
        "--device cpu --dtype float32",
        ".venv/bin/python train_translator.py --profile pilot --run pilot-l2s --device cuda --resume",
        ".venv/bin/python train_translator.py --profile pilot --run lr3e-4 --init-from "
        "artifacts/pilot-l2s/closed_form --lr 3e-4",
    )
    resumable = True
    data = True

    @classmethod
    def add_args(cls, p) -> None:
        add_family_args(p)  # --family and every family's option flags (kvlingo/core/families)
        p.add_argument(
            "--key-space", choices=("prenorm", "cache"), default="prenorm", help="what the key maps read and write"
        )
        add_refresh_arg(p, default=None, what="the profile's for the direction")  # trained and validated under it
        p.add_argument(
            "--aux-attn-weight",
            type=float,
            default=0.0,
            help="weight of the attention-output MSE added to the KL during distillation (default 0)",
        )
        p.add_argument(
            "--context-weight",
            type=share,
            default=None,
            help="α in [0, 1]: weight each reply token's KL by how much the context changes the native "
            "prediction there (kvlingo/train/objectives.py; default: the profile's objective, else 0)",
        )
        p.add_argument(
            "--onpolicy",
            type=share,
            default=None,
            help="λ in [0, 1]: share of conversations scored on a reply the target samples from the "
            "translated cache (on-policy distillation; default: the profile's objective, else 0)",
        )
        p.add_argument(
            "--keep-best",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="save the translator at the validation with the lowest KL (early stopping), not the last "
            "(default: the profile's objective)",
        )
        p.add_argument(
            "--weight-decay",
            type=number(at_least=0),
            default=None,
            help="AdamW weight decay (default: the profile's objective, else 0)",
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
            help="closed-form weighting: uniform, or context positions by the target's reply-time "
            "attention (default: the profile's)",
        )
        p.add_argument(
            "--value-fit",
            choices=VALUE_FITS,
            default="values",
            help="closed form of the value maps: fitted to the target's values, or to what its reply-time "
            "queries read from the context through them (the attention output; head-wise bases only; "
            "default: values)",
        )
        p.add_argument(
            "--ridge",
            default=None,
            help="ridge λ of the closed-form fit, or 'auto': chosen per block on held-out fit "
            "conversations (default: the profile's, auto)",
        )
        p.add_argument(
            "--lr",
            type=number(above=0),
            default=None,
            help="AdamW learning rate (default: the profile's for the direction)",
        )
        p.add_argument(
            "--lr-schedule",
            choices=LR_SCHEDULES,
            default=None,
            help="the learning rate over the updates: constant, or decayed to 0 by the last update, linearly or on a "
            "half cosine (default: the profile's, cosine)",
        )
        p.add_argument(
            "--max-grad-norm",
            type=number(at_least=0),
            default=1.0,
            help="clip the translator's gradient norm per update (0: off)",
        )
        p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed of the data order and every RNG")
        p.add_argument("--updates", type=whole(0), default=None, help="distillation updates (default: the profile's)")
        p.add_argument("--batch", type=whole(1), default=None, help="conversations per update (default: the profile's)")
        p.add_argument(
            "--n-fit", type=whole(1), default=None, help="conversations in the closed-form fit (default: the profile's)"
        )
        p.add_argument(
            "--val-every", type=whole(1), default=None, help="validation KL every N updates (default: the profile's)"
        )
        p.add_argument(
            "--checkpoint-every",
            type=whole(1),
            default=None,
            help="checkpoint every N updates (default: the profile's)",
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
        p.add_argument(
            "--closed-form-only", action="store_true", help="stop after the closed-form fit and its validation"
        )
        add_estimate_args(p)

    @classmethod
    def parse_args(cls, argv=None):
        import sys

        argv = list(sys.argv[1:] if argv is None else argv)
        return super().parse_args(argv[1:] if argv[:1] == ["--"] else argv)  # under torchrun the flags follow a `--`

    # ------------------------------------------------------------------ check
    def check(self) -> None:
        from ..inputs.data import open_prepared, split_path
        from ..inputs.models import pair_config_from_args
        from ..records import resume
        from ..records.paths import default_data, run_paths
        from ..train import distributed

        args, self.t0 = self.args, time.time()
        self.profile = get_profile(args.profile)
        self.paths = run_paths(args)
        self.pair_cfg, self.tokenizer = pair_config_from_args(args)  # configs and tokenizers only: before weights
        self.world = distributed.init(self.pair_cfg.device)  # torchrun's ranks (kvlingo/train/distributed.py)
        self.data_dir = Path(args.data) if args.data else default_data(self.profile.name)
        manifest = open_prepared(self.data_dir, self.pair_cfg, self.profile.name)
        names = (split_path(self.data_dir, s, "natural").name for s in ("train", "validation"))
        self.data_hashes = {f: manifest["files"][f] for f in names}
        self.cfg = train_config(args, self.profile, self.pair_cfg)
        check_split_size(self.cfg, manifest, self.data_dir)
        self.code_sha = resume.code_hash(self.script_path())
        self.identity = resume.identity(self.cfg, {"data": self.data_hashes}, self.pair_cfg.identities(), self.code_sha)
        self.key = resume.resume_key(self.identity)

    def up_to_date(self) -> dict | None:
        from ..train import distributed

        say = print if self.world.main else None
        if self.args.force or finished_training(self.paths, self.key, self.args, self.identity, say) is None:
            return None
        lock_run(self.paths.res, "train")  # read again under the run's locks: a training still rewriting it is refused
        lock_run(self.paths.art, "train", root_flag="--artifacts")
        done = finished_training(self.paths, self.key, self.args)
        if done is not None:
            if self.world.main:
                md = self.paths.beside("train", ".md")
                print(
                    f"{self.paths.report('train')} is up to date (same config, inputs and code); --force re-trains\n"
                    + (md.read_text() if md.is_file() else ""),
                    end="",
                )
            distributed.close(self.world)
        return done

    # ------------------------------------------------------------------ load
    def load(self) -> None:
        from ..inputs.data import read_split
        from ..inputs.models import load_pair
        from ..train.frozen import check_frozen, fingerprints
        from ..train.rng import seed_everything
        from ..train.rows import fit_selection

        self._refuse_before_weights()
        cfg = self.cfg
        self.pair = load_pair(self.pair_cfg, self.tokenizer)
        self.models = {"source": self.pair.source, "target": self.pair.target}
        check_frozen(self.models)
        self.weights_before = fingerprints(self.models)
        vocab = self.pair.target.config.vocab_size
        self.train_rows, self.val_rows = (
            read_split(self.data_dir, s, "natural", vocab) for s in ("train", "validation")
        )
        if cfg.n_train:  # the split is a seeded sample already: its first n are a random subset, nested in larger ones
            self.train_rows = self.train_rows[: cfg.n_train]
        seed_everything(cfg.seed)
        self.fit_rows = [self.train_rows[i] for i in fit_selection(len(self.train_rows), cfg.n_fit, cfg.seed)]
        if len(self.fit_rows) < cfg.n_fit and not self.args.init_from:
            print(
                f"note: the train split holds {len(self.train_rows)} conversations, fewer than n_fit={cfg.n_fit}; "
                "fitting on all"
            )
        self._closed_form()

    def _refuse_before_weights(self) -> None:
        """The resume, the family's geometry, --init-from, the estimate and the outputs, checked before weights load;
        then the run's locks."""
        from ..records import resume
        from ..records.paths import check_outputs
        from ..records.saved import MANIFEST_FILE, MAPS_FILE, check_expected, read_manifest
        from ..records.saved import build as build_translator
        from ..train import checkpoints as ckpt
        from ..train.config import RESUME_SAFE
        from ..train.footprint import before_training

        args, cfg, paths = self.args, self.cfg, self.paths
        self.state = None
        if args.resume:
            self.state = ckpt.newest_checkpoint(paths.checkpoints, warn=_write)
            if self.state is not None:
                resume.check(
                    self.state["identity"], self.identity, f"{paths.run} from its checkpoint", ignore=RESUME_SAFE
                )
        spec = {"family": cfg.family, "key_space": cfg.key_space, "settings": cfg.family_settings}
        self.empty = build_translator({**spec, "geometry": self.pair_cfg.geometry})  # a geometry it cannot map: now
        if args.init_from and cfg.value_fit != "values":
            raise Refusal(
                f"--value-fit {cfg.value_fit} with --init-from: the closed form is the folder's, fitted as it was; "
                "drop one of them"
            )
        if not args.init_from:
            from ..train.closed_form import check_value_fit

            try:
                check_value_fit(self.empty, cfg.value_fit)
            except ValueError as e:
                raise Refusal(f"--value-fit {cfg.value_fit}: {e}") from None
        self.init = None
        if args.init_from:
            self.init = read_manifest(args.init_from)  # refuses a missing or damaged folder before anything is written
            check_expected(
                self.init,
                family=cfg.family,
                key_space=cfg.key_space,
                direction=self.pair_cfg.direction,
                models=self.pair_cfg.identities(),
            )
        estimate: list[str] = []  # peak memory and time per update: printed once the outputs and the locks are sure
        try:
            self.estimate = before_training(
                self.pair_cfg, self.empty, cfg, self.profile, self.world, args, say=estimate.append
            )
        except Refusal:  # a misfit: the estimate is its reason
            print("\n".join(estimate))
            raise
        check_outputs([paths.report("train"), paths.beside("train", ".md"), paths.beside("train", ".png")])
        dirs = (paths.translator("closed_form"), paths.translator("distilled"))
        check_outputs(
            [d / f for d in dirs for f in (MAPS_FILE, MANIFEST_FILE)],
            [paths.checkpoints],
            "--artifacts",
            artifact_bytes(self.empty, cfg, args, self.state, paths.checkpoints),
        )
        lock_run(paths.res, "train")  # one training per run: checkpoints and translators are its alone
        lock_run(paths.art, "train", root_flag="--artifacts")  # two --results roots still share one run's artifacts
        if self.world.main and estimate:
            print("\n".join(estimate))

    def _closed_form(self) -> None:
        """The closed-form start (fitted, reused or --init-from), its hash against a resumed checkpoint's, then the
        checkpoints of an earlier run cleared and the closed form saved (rank 0)."""
        from ..io import sha256_bytes, sha256_file, sha256_json, to_jsonable
        from ..records import resume
        from ..records.saved import MANIFEST_FILE, MAPS_FILE, save_translator, state_bytes
        from ..train import checkpoints as ckpt

        args, cfg, paths, state, world = self.args, self.cfg, self.paths, self.state, self.world
        cf_dir = paths.translator("closed_form")
        fit_key = sha256_json(
            {
                "fit": cfg.fit_settings(),
                "pair": self.pair_cfg,
                "data": self.data_hashes["train.natural.jsonl"],
                "code": self.code_sha,
            }
        )
        self.translator, self.fit_stats, to_save = closed_form_start(
            args.init_from, self.init, self.pair, cfg, self.fit_rows, cf_dir, fit_key, self.empty, world
        )
        self.cf_sha = (
            sha256_bytes(state_bytes(self.translator)) if to_save is not None else sha256_file(cf_dir / MAPS_FILE)
        )
        if state is not None and state["closed_form_sha256"] != self.cf_sha:
            raise resume.ResumeRefused(
                f"refusing to resume {paths.run}: closed-form start changed: maps sha256 "
                f"{state['closed_form_sha256'][:12]}… → {self.cf_sha[:12]}…; start a fresh run (drop --resume) "
                "or restore the original inputs"
            )
        world.barrier()  # every rank has read what it needs; now things change (rank 0)
        if args.resume:
            print(
                f"resuming {paths.run} from update {state['update']}"
                if state
                else f"no checkpoint in {paths.checkpoints}: starting fresh"
            )
            if state and state.get("world_size", 1) != world.size:
                print(
                    f"note: the checkpoint was written by {state.get('world_size', 1)} rank(s), this run has "
                    f"{world.size}: the batch and data order are the same, the sums differ by rounding only"
                )
            if world.main:
                ckpt.clear_checkpoints(paths.checkpoints, temp_only=True)  # half-written files of the interrupted run
        elif world.main and ckpt.clear_checkpoints(paths.checkpoints):
            print(f"fresh run: removed the old checkpoints in {paths.checkpoints}")
        self.provenance = {
            "direction": self.pair_cfg.direction,
            "models": self.pair.identities(),
            "data": self.data_hashes,
            "code_sha256": self.code_sha,
            "config": to_jsonable(cfg),
            "config_sha256": sha256_json(cfg),
        }
        if world.main:
            # Until this run saves its own, no distilled manifest may vouch for a translator in this run's folder.
            (paths.translator("distilled") / MANIFEST_FILE).unlink(missing_ok=True)
            if to_save is not None:
                save_translator(cf_dir, self.translator, {**self.provenance, "stage": "closed_form", **to_save})

    # ------------------------------------------------------------------ run
    def run(self) -> dict:
        """Distillation from the closed form (or the resumed checkpoint): the loss and validation history."""
        from tqdm import tqdm

        from ..train.distill import distill_step, lr_at, make_optimizer
        from ..train.rows import data_order

        cfg, pair = self.cfg, self.pair
        self.optimizer = make_optimizer(self.translator, cfg.lr, cfg.weight_decay)
        self.order = data_order(len(self.train_rows), cfg.seed, cfg.updates * cfg.batch)
        history, start = self._start()
        self.segment_t0 = time.time()
        if self.args.closed_form_only:
            return history
        eos = _stop_ids(pair.tokenizer) if cfg.onpolicy else None
        bar = tqdm(
            range(start, cfg.updates),
            initial=start,
            total=cfg.updates,
            desc="distil",
            unit="update",
            disable=not self.world.main,
        )
        t_first = time.time()
        for u in bar:
            rows = [self.train_rows[i] for i in self.order[u * cfg.batch : (u + 1) * cfg.batch]]
            for group in self.optimizer.param_groups:
                group["lr"] = lr_at(cfg.lr, cfg.lr_schedule, u, cfg.updates)
            loss = distill_step(
                pair.source,
                pair.target,
                self.translator,
                rows,
                self.optimizer,
                pair.dtype,
                cfg.max_grad_norm,
                world=self.world,
                aux_weight=cfg.aux_attn_weight,
                refresh=cfg.refresh,
                context_weight=cfg.context_weight,
                onpolicy=cfg.onpolicy,
                first_index=u * cfg.batch,
                eos_ids=eos,
                kind=pair.cache,
            )
            done = u + 1
            history["loss"].append([done, loss])
            if done % cfg.val_every == 0 or done == cfg.updates:
                history["val"].append([done, *self._validate()])
                if self.best is not None and history["val"][-1][1] < self.best["val_kl"]:
                    self.best = {"update": done, "val_kl": history["val"][-1][1], "translator": self._state_copy()}
            bar.set_postfix(loss=f"{loss:.4f}", val_kl=f"{history['val'][-1][1]:.4f}")
            if done == start + MEASURED_UPDATES and done < cfg.updates and self.world.main:
                self._say_measured(done - start, time.time() - t_first, cfg.updates - done)
            if done % cfg.checkpoint_every == 0 or done == cfg.updates:
                self._checkpoint(done, history)
        bar.close()
        return history

    def _say_measured(self, n: int, seconds: float, left: int) -> None:
        """The measured time per update on this machine, beside what the estimate assumed (which counts FLOPs at
        the caps and no per-operation overhead, so small models on a CPU run slower than it says)."""
        import torch

        per = seconds / n
        assumed = getattr(self.estimate, "seconds_per_update", None)
        _write(
            f"measured: {per:.3g} s per update over the first {n} ({torch.get_num_threads()} thread(s)) → about "
            f"{per * left / 60:.3g} min for the {left:,} left (validations apart)"
            + (f"; the estimate assumed {assumed:.3g} s" if assumed else "")
        )

    def _start(self) -> tuple[dict, int]:
        """(history, first update): fresh from the closed form, validated, or the resumed checkpoint's."""
        from ..records import resume
        from ..train.rng import set_rng_state

        cfg, state = self.cfg, self.state
        if state is None:
            history = {"loss": [], "val": [[0, *self._validate()]], "wall_time_s": 0.0, "segments": []}
            start, self.resumed_from = 0, None
            self.best = (
                {"update": 0, "val_kl": history["val"][0][1], "translator": self._state_copy()}
                if cfg.keep_best
                else None
            )
        else:
            self.best = state.get("best")
            self.translator.load_state_dict(state["translator"])
            self.optimizer.load_state_dict(state["optimizer"])
            if state["data_order"].tolist() != self.order:
                raise resume.ResumeRefused(
                    "refusing to resume: data changed: the saved data order differs; start a fresh run (drop --resume)"
                )
            set_rng_state(state["rng"])
            history, start, self.resumed_from = state["history"], state["update"], state["update"]
        segment = {"checkpoint_every": cfg.checkpoint_every, "world_size": self.world.size}  # what a resume may change
        if not history["segments"] or {k: history["segments"][-1][k] for k in segment} != segment:
            history["segments"].append({"from_update": start, **segment})
        return history, start

    def _validate(self) -> tuple[float, float]:
        """(KL, SE): `validation_kl`'s figure and its SE over the validation conversations, as the benchmark's
        KL/conv ± SE (`mean_se` of each conversation's part). Leaves every RNG as it found it."""
        from tqdm import tqdm

        from ..eval.stats import mean_se
        from ..train.distill import validation_kl

        bar = lambda rows: tqdm(rows, desc="validation", unit="conv", leave=False, disable=not self.world.main)  # noqa: E731
        pair = self.pair
        kl, parts = validation_kl(
            pair.source,
            pair.target,
            self.translator,
            self.val_rows,
            pair.dtype,
            bar,
            self.world,
            self.cfg.refresh,
            pair.cache,
        )
        return kl, mean_se(parts)["se"]

    def _state_copy(self) -> dict:
        return {k: v.detach().cpu().clone() for k, v in self.translator.state_dict().items()}

    def _checkpoint(self, update: int, history: dict) -> None:
        import torch

        from ..io import to_jsonable
        from ..train import checkpoints as ckpt
        from ..train.rng import rng_state

        saved = {**history, "wall_time_s": history["wall_time_s"] + time.time() - self.segment_t0}
        if self.world.main:  # every rank holds the same state; the others wait at the barrier below
            ckpt.save_checkpoint(
                self.paths.checkpoints,
                update,
                {
                    "config": to_jsonable(self.cfg),
                    "identity": self.identity,
                    "closed_form_sha256": self.cf_sha,
                    "translator": {k: v.detach().cpu() for k, v in self.translator.state_dict().items()},
                    "optimizer": self.optimizer.state_dict(),
                    "rng": rng_state(),
                    "data_order": torch.tensor(self.order, dtype=torch.long),
                    "cursor": update * self.cfg.batch,
                    "history": saved,
                    "best": self.best,
                    "world_size": self.world.size,
                },
            )
        self.world.barrier()

    # ------------------------------------------------------------------ publish
    def publish(self, history: dict) -> dict | None:
        """The frozen models checked, the distilled translator saved, the report, its table and its curves."""
        from ..io import sha256_file
        from ..records.saved import MAPS_FILE, save_translator
        from ..train import distributed
        from ..train.frozen import FrozenWeightsChanged, verify_frozen

        try:
            frozen = verify_frozen(self.models, self.weights_before)
        except FrozenWeightsChanged as e:
            raise FrozenWeightsChanged(
                f"{e}; the distilled translator was not saved. Nothing may write to the models during training."
            ) from None
        if not self.world.main:  # rank 0 writes the outputs
            distributed.close(self.world)
            return None
        dist_kl, dist_sha, dist_dir = None, None, self.paths.translator("distilled")
        if not self.args.closed_form_only:
            dist_kl = history["val"][-1][1]
            if (
                self.best is not None
            ):  # early stopping: the translator of the lowest validation KL, closed form included
                self.translator.load_state_dict(self.best["translator"])
                dist_kl = self.best["val_kl"]
            save_translator(
                dist_dir,
                self.translator,
                {
                    **self.provenance,
                    "stage": "distilled",
                    "closed_form_sha256": self.cf_sha,
                    "updates": self.cfg.updates,
                    "val_kl": dist_kl,
                },
            )
            dist_sha = sha256_file(dist_dir / MAPS_FILE)
        report = self._report(history, frozen, dist_kl, dist_sha)
        distributed.close(self.world)
        return report

    def _report(self, history: dict, frozen: dict, dist_kl: float | None, dist_sha: str | None) -> dict:
        from ..io import atomic_write_text, sha256_file
        from ..records.report import Report, fmt_pm, fmt_table
        from ..train.config import TrainResults

        cfg, paths, pair = self.cfg, self.paths, self.pair
        cf_dir, dist_dir, wall = paths.translator("closed_form"), paths.translator("distilled"), time.time() - self.t0
        total = history["wall_time_s"] + time.time() - self.segment_t0  # every stretch's, this one's included
        val_se = {v[0]: v[2] for v in history["val"]}  # update → SE over the validation conversations
        dist_update = None if dist_kl is None else (self.best or {"update": history["val"][-1][0]})["update"]
        n_val, val_tokens = len(self.val_rows), sum(len(r["reply_ids"]) for r in self.val_rows)
        plot = paths.beside("train", ".png")
        plot_curves(
            plot,
            history["loss"],
            history["val"],
            f"{paths.run}: {self.pair_cfg.direction}, {cfg.family}, {cfg.key_space}, lr {cfg.lr:g}{_schedule(cfg)}",
        )
        results = TrainResults(
            closed_form_val_kl=history["val"][0][1],
            distilled_val_kl=dist_kl,
            loss_curve=[{"update": u, "loss": x} for u, x in history["loss"]],
            val_kl_curve=[{"update": u, "val_kl": x, "se": se} for u, x, se in history["val"]],
            fit=self.fit_stats,
            frozen_weights=frozen,
            resumed_from_update=self.resumed_from,
            segments=history["segments"],
            wall_time_s_total=total,
            best=None if self.best is None else {"update": self.best["update"], "val_kl": self.best["val_kl"]},
            closed_form_val_kl_se=val_se[0],
            distilled_val_kl_se=None if dist_update is None else val_se[dist_update],
            translator={
                "family": cfg.family,
                "n_params": self.translator.n_params(),
                "flops_per_token": self.translator.flops_per_token(),
            },
            artifacts={
                "closed_form": str(cf_dir),
                "closed_form_sha256": self.cf_sha,
                "distilled": None if self.args.closed_form_only else str(dist_dir),
                "distilled_sha256": dist_sha,
                "checkpoints": str(paths.checkpoints),
                "plot": str(plot),
            },
        )
        init_from = self.args.init_from and {"path": self.args.init_from, "maps_sha256": self.cf_sha}
        report = Report(
            "train",
            config=cfg,
            inputs={
                "data": self.data_hashes,
                "data_dir": str(self.data_dir),
                "code_sha256": self.code_sha,
                "models": pair.identities(),
                "init_from": init_from,
            },
            results=results,
            metrics=TrainResults.METRICS,
            n_samples={
                "fit_conversations": len(self.fit_rows) if not self.args.init_from else None,
                "train_conversations": len(self.train_rows),
                "validation_conversations": n_val,
                "validation_reply_tokens": val_tokens,
                "updates": 0 if self.args.closed_form_only else cfg.updates,
                "batch": cfg.batch,
            },
            seeds={"seed": cfg.seed},
            wall_time_s=wall,
            device=pair.device,
            dtype=self.pair_cfg.dtype,
            resume_key=self.key,
            identity=self.identity,
            files={"train.png": sha256_file(plot)},
        ).write(paths.report("train"))
        table = fmt_table(
            ["translator", "validation KL ± SE (nats/token)", "artifact"],
            [
                [
                    "closed form",
                    fmt_pm({"mean": results.closed_form_val_kl, "se": results.closed_form_val_kl_se}),
                    str(cf_dir),
                ],
                [
                    "distilled",
                    fmt_pm({"mean": dist_kl, "se": results.distilled_val_kl_se}) if dist_update is not None else None,
                    str(dist_dir) if dist_sha else "—",
                ],
            ],
        )
        choice = (self.fit_stats or {}).get("layer_choice")
        chosen = (
            f"Token features at target layers {', '.join(map(str, choice['chosen']))} of "
            f"{len(choice['held_out_share_removed'])}, chosen by the closed form on {choice['held_out_tokens']} "
            "held-out tokens (each layer's share of the base's held-out error they remove: train.json, "
            "results.fit.layer_choice).\n\n"
            if choice
            else ""
        )
        atomic_write_text(
            paths.beside("train", ".md"),
            (
                f"# train: {paths.run}\n\n{pair.source_spec.name_or_path} → {pair.target_spec.name_or_path} "
                f"({self.pair_cfg.direction}), family {cfg.family}, key space {cfg.key_space}, refresh {cfg.refresh}, "
                f"fit weighting {cfg.fit_weighting}, value fit {cfg.value_fit}, {self.pair_cfg.dtype} on "
                f"{self.pair_cfg.device}; {cfg.updates} "
                f"updates × batch {cfg.batch}, lr {cfg.lr:g}{_schedule(cfg)}, seed {cfg.seed}.\n\n{chosen}{table}\n"
                f"Validation: the mean over n = {n_val} conversations ({val_tokens} reply tokens) of each one's "
                f"mean reply-token KL, ± its SE over the conversations.\n\nFrozen model weights verified "
                f"unchanged. Wall time {total:.1f} s distilling in all (every resumed stretch), {wall:.1f} s this "
                "invocation.\n\n![curves](train.png)\n"
            ),
        )
        print(table, end="")
        print(f"report: {paths.report('train')}")
        return report


# --------------------------------------------------------------------------- the config, from flags and profile
def given(value, default):
    return default if value is None else value


def positive(name: str, value, allow_zero: bool = False):
    if (
        value is None
        or (value < 0 if allow_zero else value <= 0)
        or (isinstance(value, float) and not math.isfinite(value))
    ):
        raise Refusal(f"--{name} {value} is invalid: it must be a finite number {'≥ 0' if allow_zero else '> 0'}")
    return value


def distillation_updates(args, value):
    """--updates: at least 1 (0 would write the closed-form maps as a "distilled" translator and report a
    distillation that did not happen); the closed-form maps alone are --closed-form-only."""
    positive("updates", value, allow_zero=True)
    if value == 0 and not args.closed_form_only:
        raise Refusal(
            "--updates 0 distils nothing: for the closed-form maps alone pass --closed-form-only "
            "(make train TRAIN_ARGS=--closed-form-only)"
        )
    return value


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
    from ..core.settings import Geometry
    from ..train.config import resolve_family

    try:
        return resolve_family(
            profile, pair_cfg.direction, args.family, family_flags(args), Geometry(**pair_cfg.geometry)
        )
    except (TypeError, ValueError) as e:
        raise Refusal(f"--family {args.family or profile.family_for(pair_cfg.direction)}: {e}") from None


def train_config(args, profile, pair_cfg):
    """The TrainConfig of a run: the flags given, else the profile's (translator, refresh and objective for the
    direction, budgets), each checked."""
    from ..core.settings import Refresh
    from ..train.config import TrainConfig

    family, settings = family_from_args(args, profile, pair_cfg)
    objective = profile.objective_for(pair_cfg.direction) if args.family is None else {}
    refresh = args.refresh if args.refresh is not None else Refresh.parse(profile.refresh_for(pair_cfg.direction))
    refresh.check_layers(pair_cfg.geometry["target_layers"])
    return TrainConfig(
        profile=profile.name,
        family=family,
        family_settings=settings,
        key_space=args.key_space,
        fit_weighting=given(args.fit_weighting, profile.fit_weighting),
        value_fit=args.value_fit,
        ridge=ridge_value(str(given(args.ridge, profile.ridge))),
        aux_attn_weight=positive("aux-attn-weight", args.aux_attn_weight, allow_zero=True),
        refresh=refresh,
        context_weight=given(args.context_weight, objective.get("context_weight", 0.0)),
        onpolicy=given(args.onpolicy, objective.get("onpolicy", 0.0)),
        keep_best=given(args.keep_best, objective.get("keep_best", False)),
        n_train=args.n_train or 0,
        n_fit=positive("n-fit", given(args.n_fit, profile.n_fit)),
        updates=distillation_updates(args, given(args.updates, profile.updates)),
        batch=positive("batch", given(args.batch, profile.batch)),
        lr=positive("lr", given(args.lr, profile.lr_for(pair_cfg.direction))),
        lr_schedule=given(args.lr_schedule, profile.lr_schedule),
        weight_decay=positive(
            "weight-decay", given(args.weight_decay, objective.get("weight_decay", 0.0)), allow_zero=True
        ),
        max_grad_norm=positive("max-grad-norm", args.max_grad_norm, allow_zero=True),
        val_every=positive("val-every", given(args.val_every, profile.val_every)),
        checkpoint_every=positive("checkpoint-every", given(args.checkpoint_every, profile.checkpoint_every)),
        seed=args.seed,
        pair=pair_cfg,
    )


def check_split_size(cfg, manifest: dict, data_dir: Path) -> None:
    """--n-train within the split, and the batch within the conversations trained on."""
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


# --------------------------------------------------------------------------- helpers
def _schedule(cfg) -> str:
    """How the report names a decaying learning rate (nothing for a constant one)."""
    return "" if cfg.lr_schedule == "constant" else f" ({cfg.lr_schedule} decay to 0)"


def _write(message: str) -> None:
    from tqdm import tqdm

    tqdm.write(message)


def _stop_ids(tokenizer):
    from ..core.handoff import stop_ids

    return stop_ids(tokenizer)


def artifact_bytes(empty, cfg, args, state: dict | None, ckpt_dir: Path) -> int:
    """About what the run writes under --artifacts: the closed-form and distilled maps, and each checkpoint
    still to come (the maps and AdamW's two moments), less the old checkpoints a fresh run removes first."""
    maps = sum(v.numel() * v.element_size() for v in empty.state_dict().values())
    if args.closed_form_only:
        return maps
    start = state["update"] if state is not None else 0
    checkpoints = sum(1 for u in range(start + 1, cfg.updates + 1) if u % cfg.checkpoint_every == 0 or u == cfg.updates)
    removed = 0 if args.resume else sum(p.stat().st_size for p in ckpt_dir.glob("ckpt_*.pt") if p.is_file())
    return max(0, 2 * maps + checkpoints * 3 * maps - removed)


def finished_training(paths, key: str, args, identity: dict | None = None, say=None) -> dict | None:
    """The run's train.json when this training already finished: made under resume key `key` (config, data,
    models, code), the same kind of run (--closed-form-only or not, from --init-from maps with the same
    sha256), and its translators still there holding the maps it records."""
    from ..io import sha256_file
    from ..records import resume
    from ..records.saved import MANIFEST_FILE, MAPS_FILE, read_manifest

    old = resume.up_to_date(paths.report("train"), key, identity, say)
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
    ok = all(maps_sha(paths.translator(k)) == art.get(f"{k}_sha256") and intact(paths.translator(k)) for k in kinds)
    return old if ok else None


def plot_curves(path: Path, loss: list, val: list, title: str) -> None:
    from ..io import atomic_write_bytes
    from ..records.report import figure, figure_png

    fig, ax = figure((7, 4))
    if loss:
        ax.plot([u for u, _ in loss], [x for _, x in loss], label="train loss (batch KL)", lw=1)
    ax.plot([v[0] for v in val], [v[1] for v in val], "o-", label="validation KL")  # [update, KL, SE]
    ax.set_xlabel("update")
    ax.set_ylabel("KL(native ‖ translated), nats per reply token")
    ax.set_title(title)
    ax.legend()
    atomic_write_bytes(path, figure_png(fig))


def closed_form_start(
    init_from: str | None, init: dict | None, pair, cfg, fit_rows: list[dict], cf_dir: Path, fit_key: str, empty, world
) -> tuple[Any, dict | None, dict | None]:
    """The run's closed-form translator, in memory: from --init-from (its checked manifest `init`), reused
    when cf_dir's fit key matches, or fitted into `empty` (an unfitted translator of the run's family). Returns
    (translator, fit stats, provenance to save, or None when cf_dir already holds it)."""
    from tqdm import tqdm

    from ..records.saved import MANIFEST_FILE, load_state, read_manifest
    from ..train.closed_form import fit_closed_form

    if init_from:
        translator = load_state(init_from, init, pair.device).bind(pair.source, pair.target)
        same = Path(init_from).resolve() == cf_dir.resolve()
        saved = {"fit_key": init.get("fit_key"), "fit": init.get("fit"), "copied_from": str(init_from)}
        return translator, init.get("fit"), None if same else saved
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
        value_fit=cfg.value_fit,
        native_layers=cfg.refresh.own_layers(translator.geometry.target_layers),
    )
    return translator, stats, {"fit_key": fit_key, "fit": stats}
