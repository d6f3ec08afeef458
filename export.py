"""Export a finished run's translator as a shareable folder with its evidence (loads with kvlingo.Relay).

Reads ARTIFACTS/RUN/distilled/ (or --translator closed_form), RESULTS/RUN/benchmark.json (the
acceptance arms: native target, translated, control, no-context) and, when it exists,
RESULTS/RUN/ifeval.json; writes to --out (default ARTIFACTS/RUN/export/):

    maps.safetensors   the maps, byte for byte
    evidence.json      the benchmark's arms (n, KL ± SE, top-1, NLL Δ), IFEval if it ran, the gate's verdict
    README.md          a model card generated from those numbers
    config.json        last: family, key space, geometry, direction, pair ids with revisions,
                       tokenizer digest, provenance, and the sha256 of the maps and the evidence

Reports that scored other maps or another pair are refused before anything is written (exit 2).
A translator that fails the gate is still exported, and its card says so; `Relay.load` refuses
it unless told `allow_unproven=True`. The layout and the gate: kvlingo/records/saved.py, evidence.py.
"""

from __future__ import annotations

from pathlib import Path

from kvlingo.inputs.models import DIRECTIONS
from kvlingo.inputs.profiles import PROFILES
from kvlingo.records.paths import TRANSLATORS, add_run_args, check_outputs, run_paths, writable
from kvlingo.records.saved import CONFIG_FILE, EXPORT_FILES, gather, write_export
from kvlingo.stages.stage import refusals_exit, stage_parser


def parse_args(argv=None):
    parser = stage_parser(
        __doc__,
        [
            "python export.py --profile demo --direction l2s",
            "python export.py --run pilot-l2s --out exports/qwen3-1.7b-to-0.6b",
        ],
    )
    parser.add_argument(
        "--profile", default="pilot", choices=sorted(PROFILES), help="profile (for the default run name)"
    )
    parser.add_argument("--direction", choices=DIRECTIONS, default="l2s", help="direction (for the default run name)")
    add_run_args(parser)
    parser.add_argument("--translator", choices=TRANSLATORS, default="distilled", help="which of the run's translators")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default ARTIFACTS/RUN/export)")
    parser.add_argument(
        "--no-evidence",
        action="store_true",
        help="export without benchmark figures (Relay.load then needs allow_unproven=True)",
    )
    return parser.parse_args(argv)


@refusals_exit("export")
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    paths = run_paths(args)
    out = args.out or paths.art / "export"
    maps, config, evidence = gather(paths, args.translator, evidence=not args.no_evidence)
    check_outputs([out / name for name in EXPORT_FILES], flag="--out", need_bytes=len(maps))
    writable(out, "--out")
    verdict = write_export(out, maps, config, evidence)
    print(
        f"wrote {out} ({config['family']} {config['direction']}, {args.translator} maps of run {paths.run}; "
        f"{CONFIG_FILE} last)"
    )
    if evidence is None:
        print("gate: no evidence (exported with --no-evidence); Relay.load needs allow_unproven=True")
    elif verdict.passed:
        print("gate: PASSED (default thresholds)")
    else:
        print(
            "gate: FAILED (default thresholds): "
            + "; ".join(verdict.failures)
            + "\nRelay.load refuses these maps unless allow_unproven=True"
        )


if __name__ == "__main__":
    main()
