"""The estimate stage (estimate.py): the peak memory per rank and the time per update of a profile's distillation,
for a device you do not have at hand (a planned GPU by name, or this machine), from the models' shapes alone.

Nothing is loaded or measured: the real Qwen3 shapes are known (kvlingo/bench/shapes.py), other models'
configs are read. The same estimate runs inside train_translator.py before its weights load
(kvlingo/train/footprint.py), which refuses a run that cannot fit; here a misfit is refused the same way
(exit 2), naming a profile that fits.
"""

from __future__ import annotations

from ..core.families import FAMILIES
from ..core.settings import DIRECTIONS
from ..inputs.argtypes import whole
from ..inputs.flags import LARGE_ID, SMALL_ID
from ..inputs.profiles import PROFILES
from ..train.footprint import DEVICES, add_estimate_args
from .skeleton import Stage


class Estimate(Stage):
    name = "estimate"
    script = "estimate.py"
    summary = (
        "Estimate the peak memory per rank and the time per update of a profile's distillation, for a device you\n"
        "do not have at hand (a planned GPU by name, or this machine), from the models' shapes alone."
    )
    examples = (
        ".venv/bin/python estimate.py --profile paper-budget --gpu H100 --nproc 8",
        ".venv/bin/python estimate.py --profile pilot --device cpu",
    )
    common = False

    @classmethod
    def add_args(cls, p) -> None:
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

    def check(self) -> None:
        """Both models' shapes, the profile, and the translator's family and settings for the direction."""
        from ..core.settings import Geometry
        from ..inputs.models import ModelSpec, pair_specs
        from ..inputs.profiles import get_profile
        from ..train.config import resolve_family

        args = self.args
        src_spec, tgt_spec = pair_specs(args.direction, ModelSpec.parse(args.large), ModelSpec.parse(args.small))
        self.source, self.target = shape(src_spec.name_or_path), shape(tgt_spec.name_or_path)
        s, t = self.source, self.target
        self.geometry = Geometry(s.layers, s.kv_heads, s.head_dim, t.layers, t.kv_heads, t.head_dim)
        self.profile = get_profile(args.profile)
        self.family, self.settings = resolve_family(self.profile, args.direction, args.family, {}, self.geometry)

    def run(self):
        """The estimate (printed by `check_run`), refused when the run does not fit (RunRefused, exit 2)."""
        from dataclasses import asdict

        from ..inputs.models import resolve_device, resolve_dtype
        from ..records.saved import build
        from ..train.footprint import check_run

        args, profile = self.args, self.profile
        spec = {"family": self.family, "key_space": args.key_space, "geometry": asdict(self.geometry)}
        translator = build({**spec, "settings": self.settings})
        return check_run(
            self.source,
            self.target,
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


def shape(name: str):
    """A model's shape (kvlingo.train.footprint.Shape): the known Qwen3 shapes without a download, any other
    model from its config."""
    from ..bench.shapes import QWEN3_ARCH
    from ..inputs.models import ModelSpec, load_config
    from ..train.footprint import Shape

    spec = ModelSpec.parse(name)
    if spec.name_or_path in QWEN3_ARCH:
        return Shape.of(QWEN3_ARCH[spec.name_or_path])
    return Shape.of(load_config(spec))
