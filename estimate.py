"""Estimate the peak memory per rank and the time per update of a profile's distillation, for a device you
do not have at hand (a planned GPU by name, or this machine), from the models' shapes alone.

Nothing is loaded or measured: the real Qwen3 shapes are known (kvlingo/bench/shapes.py), other models'
configs are read. The same estimate runs inside train_translator.py before its weights load
(kvlingo/train/footprint.py), which refuses a run that cannot fit; here a misfit is refused the same way
(exit 2), naming a profile that fits.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

from kvlingo.bench.shapes import QWEN3_ARCH
from kvlingo.core.families import FAMILIES
from kvlingo.core.translator import Geometry
from kvlingo.inputs.argtypes import whole
from kvlingo.inputs.models import (
    DIRECTIONS,
    LARGE_ID,
    SMALL_ID,
    ModelSpec,
    load_config,
    pair_specs,
    resolve_device,
    resolve_dtype,
)
from kvlingo.inputs.profiles import PROFILES, get_profile
from kvlingo.records.saved import build
from kvlingo.stages.stage import StageParser, refusals_exit
from kvlingo.train.config import resolve_family
from kvlingo.train.footprint import DEVICES, Estimate, Shape, add_estimate_args, check_run


def build_parser() -> argparse.ArgumentParser:
    p = StageParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  python estimate.py --profile paper-budget --gpu H100 --nproc 8\n"
        "  python estimate.py --profile pilot --device cpu",
    )
    p.add_argument(
        "--profile", default="paper-budget", choices=sorted(PROFILES), help="run profile (caps, batch, updates)"
    )
    p.add_argument("--large", default=LARGE_ID, help="larger model: a Hub id with known shapes, or a local folder")
    p.add_argument("--small", default=SMALL_ID, help="smaller model, the same way")
    p.add_argument("--direction", choices=DIRECTIONS, default="l2s", help="which model builds the cache")
    p.add_argument("--dtype", default="bfloat16", help="model dtype")
    p.add_argument(
        "--family",
        choices=sorted(FAMILIES),
        default=None,
        help="translator family at its default settings (default: the profile's for the direction, with its flags)",
    )
    p.add_argument("--key-space", choices=("prenorm", "cache"), default="prenorm", help="translator key space")
    p.add_argument("--batch", type=whole(1), default=None, help="conversations per update (default: the profile's)")
    p.add_argument("--nproc", type=whole(1), default=1, help="data-parallel ranks (torchrun --nproc-per-node)")
    p.add_argument("--device", default="auto", help="cuda, mps, cpu or auto (this machine's)")
    p.add_argument(
        "--gpu", default=None, help=f"a planned CUDA GPU by name ({', '.join(DEVICES)}) instead of this machine's"
    )
    add_estimate_args(p)
    return p


def shape(name: str) -> Shape:
    """A model's shape: the known Qwen3 shapes without a download, any other model from its config."""
    spec = ModelSpec.parse(name)
    if spec.name_or_path in QWEN3_ARCH:
        return Shape.of(QWEN3_ARCH[spec.name_or_path])
    return Shape.of(load_config(spec))


@refusals_exit("estimate")
def main(argv=None) -> Estimate:
    args = build_parser().parse_args(argv)
    src_spec, tgt_spec = pair_specs(args.direction, ModelSpec.parse(args.large), ModelSpec.parse(args.small))
    source, target = shape(src_spec.name_or_path), shape(tgt_spec.name_or_path)
    geometry = Geometry(
        source.layers, source.kv_heads, source.head_dim, target.layers, target.kv_heads, target.head_dim
    )
    profile = get_profile(args.profile)
    family, settings = resolve_family(profile, args.direction, args.family, {}, geometry)
    translator = build(
        {"family": family, "key_space": args.key_space, "geometry": asdict(geometry), "settings": settings}
    )
    return check_run(
        source,
        target,
        translator,
        profile=profile,
        batch=args.batch or profile.batch,
        updates=profile.updates,
        val_every=profile.val_every,
        n_validation=profile.n_validation,
        dtype_bytes=resolve_dtype(args.dtype).itemsize,
        device_kind="cuda" if args.gpu else resolve_device(args.device).split(":")[0],
        nproc=args.nproc,
        memory_limit_gib=args.memory_limit_gib,
        assume_tflops=args.assume_tflops,
        device_name=args.gpu,
        memory_check=not args.no_memory_check,
    )


if __name__ == "__main__":
    main()
