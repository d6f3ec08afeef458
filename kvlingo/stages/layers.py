"""The per-layer diagnostic (layers.py): where trained translators' error lives, layer by layer.

For each run of --runs (a trained translator, each under the refresh it was trained with), on the first
--limit conversations of the test split (kvlingo/eval/layers.py): every target layer's KL when it alone is
translated and the rest is the target's own, and the KL it removes when it alone is made the target's own.
Each layer's share of the handoff's error, per run, goes in one table and one plot, so that a run with the
target's exact layer 0 and the token features sits beside one without them.

Writes RESULTS/OUT/layers.{json,md,png} (OUT: --out, default RUN-layers, else PROFILE-DIRECTION-layers); up to
date when the runs' maps, the data, the models, the settings and the code are the same.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import Refusal
from ..inputs.argtypes import whole
from ..inputs.profiles import get_profile
from ..records.paths import TRANSLATORS, RunPaths, check_outputs, default_data, default_run
from .skeleton import Stage, lock_run

if TYPE_CHECKING:
    from ..inputs.models import PairConfig


@dataclass(frozen=True)
class LayersConfig:
    out: str  # the report goes to RESULTS/OUT
    runs: tuple[str, ...]  # trained runs whose translators are diagnosed
    translator: str  # which translator of each run: distilled or closed_form
    data: str  # prepared data folder
    split: str  # the prepared split scored
    limit: int  # conversations scored (the split's first N)
    pair: PairConfig


class Layers(Stage):
    name = "layers"
    script = "layers.py"
    summary = "The per-layer diagnostic: where trained translators' error lives, layer by layer."
    examples = (
        "make layers PROFILE=demo LAYERS_ARGS='--runs demo-l2s-ablate/token-w3 demo-l2s-ablate/crosshead'",
        ".venv/bin/python layers.py --profile demo --large artifacts/toy/large --small artifacts/toy/small "
        "--device cpu --dtype float32 --runs demo-l2s --limit 32",
    )
    data = True

    @classmethod
    def add_args(cls, p) -> None:
        p.add_argument(
            "--runs",
            nargs="+",
            default=None,
            help="trained runs to diagnose (ARTIFACTS/RUN/TRANSLATOR; default: --run's, PROFILE-DIRECTION)",
        )
        p.add_argument("--translator", choices=TRANSLATORS, default="distilled", help="which translator of each run")
        p.add_argument("--split", choices=("test", "validation"), default="test", help="the prepared split scored")
        p.add_argument("--limit", type=whole(1), default=64, help="conversations scored: the split's first N")
        p.add_argument(
            "--out",
            default=None,
            help="report folder under --results (default RUN-layers, else PROFILE-DIRECTION-layers)",
        )
        p.add_argument("--force", action="store_true", help="run again even when the report is up to date")

    def check(self) -> None:
        from ..inputs.data import open_prepared, split_path
        from ..inputs.models import pair_config_from_args
        from ..records import resume
        from ..records.saved import MANIFEST_FILE, MAPS_FILE, read_manifest

        args, self.t0 = self.args, time.time()
        profile = get_profile(args.profile)
        pair, self.tokenizer = pair_config_from_args(args)
        runs = tuple(args.runs or [args.run or default_run(profile.name, pair.direction)])
        self.folders = {r: RunPaths(r, args.artifacts, args.results).translator(args.translator) for r in runs}
        for run, folder in self.folders.items():
            if not (folder / MANIFEST_FILE).is_file():
                raise Refusal(f"no trained translator at {folder}: train the run first (make train RUN={run})")
            read_manifest(folder)  # refuses a damaged or edited manifest, or maps that do not match it
        data_dir = Path(args.data) if args.data else default_data(profile.name)
        manifest = open_prepared(data_dir, pair, profile.name)
        self.data_dir = data_dir
        self.cfg = LayersConfig(
            args.out or f"{args.run or default_run(profile.name, pair.direction)}-layers",  # the deep pair: its RUN
            runs,
            args.translator,
            str(data_dir),
            args.split,
            args.limit,
            pair,
        )
        self.paths = RunPaths(self.cfg.out, args.artifacts, args.results)
        split_file = split_path(data_dir, args.split, "natural").name
        from ..io import sha256_file

        maps = {r: sha256_file(f / MAPS_FILE) for r, f in self.folders.items()}
        self.identity = resume.identity(
            self.cfg,
            {"data": manifest["files"][split_file], "maps": maps},
            pair.identities(),
            resume.code_hash(self.script_path()),
        )
        self.key = resume.resume_key(self.identity)
        check_outputs([self.paths.report("layers"), *(self.paths.beside("layers", x) for x in (".md", ".png"))])
        lock_run(self.paths.res, "layers")

    def up_to_date(self) -> dict | None:
        from ..records import resume

        if self.args.force:
            return None
        done = resume.up_to_date(self.paths.report("layers"), self.key, self.identity)
        if done is not None:
            print(f"{self.paths.report('layers')} is up to date (same runs, data, models and code); --force redoes it")
        return done

    def load(self) -> None:
        from ..core.settings import Refresh
        from ..inputs.data import read_split
        from ..inputs.models import load_pair
        from ..records.saved import load_translator

        self.pair = load_pair(self.cfg.pair, self.tokenizer)
        vocab = self.pair.target.config.vocab_size
        self.rows = read_split(self.data_dir, self.cfg.split, "natural", vocab, limit=self.cfg.limit)
        if self.cfg.limit > len(self.rows):
            print(
                f"note: --limit {self.cfg.limit} but the data holds {len(self.rows)} conversations; scoring all of them"
            )
        self.translators = {}
        for run, folder in self.folders.items():
            translator, info = load_translator(folder, self.pair)
            refresh = Refresh.parse((info.get("config") or {}).get("refresh"))  # the one it was trained under
            self.translators[run] = (translator, refresh, info)

    def run(self) -> dict:
        from tqdm import tqdm

        from ..eval.layers import layer_errors, summarize

        out = {}
        for run, (translator, refresh, info) in self.translators.items():
            rows = [
                layer_errors(
                    self.pair.source, self.pair.target, translator, conv, self.pair.dtype, refresh, self.pair.cache
                )
                for conv in tqdm(self.rows, desc=f"layers {run}", unit="conv")
            ]
            out[run] = {
                "family": info["family"],
                "settings": info["settings"],
                "refresh": str(refresh),
                **summarize(rows),
            }
        return out

    def publish(self, results: dict) -> dict:
        from ..io import atomic_write_bytes, atomic_write_text, sha256_file
        from ..records.report import Metric, Report

        png = self.paths.beside("layers", ".png")
        atomic_write_bytes(png, plot(results, f"{self.cfg.pair.direction}: each layer's share of the handoff's KL"))
        md = markdown(self.cfg, results)
        atomic_write_text(self.paths.beside("layers", ".md"), md)
        first = next(iter(results.values()))
        report = Report(
            "layers",
            config=self.cfg,
            inputs={"runs": {r: str(f) for r, f in self.folders.items()}},
            results=results,
            metrics=(Metric("*.layers.*.alone_share", False, "the layer's share of the error when alone translated"),),
            n_samples={"conversations": first["n_conversations"], "reply_tokens": first["n_tokens"]},
            wall_time_s=time.time() - self.t0,
            device=self.cfg.pair.device,
            dtype=self.cfg.pair.dtype,
            resume_key=self.key,
            identity=self.identity,
            files={png.name: sha256_file(png)},
        ).write(self.paths.report("layers"))
        print(md)
        return report


def markdown(cfg: LayersConfig, results: dict) -> str:
    from ..eval.layers import where
    from ..records.report import fmt_pm, fmt_table

    first = next(iter(results.values()))  # every run scores the same conversations
    lines = [
        f"# Where the error lives: {cfg.out}\n",
        f"{cfg.pair.direction}, {cfg.split} split, first {first['n_conversations']} conversations "
        f"({first['n_tokens']} reply tokens); KL(native target ‖ handoff) "
        "per reply token. alone: the layer translated, every other the target's own; removed: what making the "
        "layer the target's own removes from the full handoff's KL. Share = of the sum of the alone KLs, and "
        "of the full KL.\n",
    ]
    for run, r in results.items():
        lines.append(
            f"## {run}: {r['family']} (refresh {r['refresh']}), full KL {fmt_pm(r['full_kl'])}; "
            f"most error alone in layers {', '.join(map(str, where(r)))}\n"
        )
        rows = [
            [
                x["layer"],
                fmt_pm(x["alone_kl"]),
                f"{100 * x['alone_share']:.1f}%",
                fmt_pm(x["removed_kl"]),
                f"{100 * x['removed_share']:.1f}%",
            ]
            for x in r["layers"]
        ]
        lines.append(fmt_table(["layer", "alone KL ± SE", "alone share", "removed KL ± SE", "removed share"], rows))
    return "\n".join(lines)


def plot(results: dict, title: str) -> bytes:
    from ..records.report import figure, figure_png

    fig, ax = figure((7, 4))
    for i, (run, r) in enumerate(results.items()):
        xs = [x["layer"] for x in r["layers"]]
        ax.plot(
            xs,
            [100 * x["alone_share"] for x in r["layers"]],
            "o-",
            ms=3,
            color=f"C{i}",
            label=f"{run} ({r['refresh']}): alone",
        )
        ax.plot(
            xs,
            [100 * x["removed_share"] for x in r["layers"]],
            "--",
            color=f"C{i}",
            label=f"{run}: removed when native",
        )
    ax.set_xlabel("target layer")
    ax.set_ylabel("share of the handoff's KL (%)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=6)
    return figure_png(fig)
