"""The export stage (export.py): a finished run's translator as a shareable folder with its evidence (loads with
kvlingo.Relay).

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

from ..core.settings import DIRECTIONS
from ..inputs.flags import add_run_args
from ..inputs.profiles import PROFILES
from ..records.paths import TRANSLATORS
from .skeleton import Stage


class Export(Stage):
    name = "export"
    script = "export.py"
    summary = "Export a finished run's translator as a shareable folder with its evidence (loads with kvlingo.Relay)."
    examples = (
        ".venv/bin/python export.py --profile demo --direction l2s",
        ".venv/bin/python export.py --run pilot-l2s --out exports/qwen3-1.7b-to-0.6b",
    )
    common = False

    @classmethod
    def add_args(cls, p) -> None:
        p.add_argument(
            "--profile", default="pilot", choices=sorted(PROFILES), help="profile (for the default run name)"
        )
        p.add_argument("--direction", choices=DIRECTIONS, default="l2s", help="direction (for the default run name)")
        add_run_args(p)
        p.add_argument("--translator", choices=TRANSLATORS, default="distilled", help="which of the run's translators")
        p.add_argument("--out", type=Path, default=None, help="output folder (default ARTIFACTS/RUN/export)")
        p.add_argument(
            "--no-evidence",
            action="store_true",
            help="export without benchmark figures (Relay.load then needs allow_unproven=True)",
        )

    def check(self) -> None:
        from ..records.paths import run_paths

        self.paths = run_paths(self.args)
        self.out = self.args.out or self.paths.art / "export"

    def load(self) -> None:
        """The maps, their config and the evidence, each checked against the others; then the output folder."""
        from ..inputs.reads import handoff_reads
        from ..records.paths import check_outputs, writable
        from ..records.saved import EXPORT_FILES, gather

        self.maps, self.config, self.evidence = gather(
            self.paths, self.args.translator, evidence=not self.args.no_evidence
        )
        c = self.config
        c["reads"] = handoff_reads(c["family"], c["refresh"], c["models"]["target"], c["key_space"])
        check_outputs([self.out / name for name in EXPORT_FILES], flag="--out", need_bytes=len(self.maps))
        writable(self.out, "--out")

    def run(self):
        """The export folder, config.json last; the gate's verdict at its default thresholds."""
        from ..records.saved import write_export

        return write_export(self.out, self.maps, self.config, self.evidence)

    def publish(self, verdict) -> None:
        from ..records.saved import CONFIG_FILE

        print(
            f"wrote {self.out} ({self.config['family']} {self.config['direction']}, {self.args.translator} maps of "
            f"run {self.paths.run}; {CONFIG_FILE} last)"
        )
        if self.evidence is None:
            print("gate: no evidence (exported with --no-evidence); Relay.load needs allow_unproven=True")
        elif verdict.passed:
            print("gate: PASSED (default thresholds)")
        else:
            print(
                "gate: FAILED (default thresholds): "
                + "; ".join(verdict.failures)
                + "\nRelay.load refuses these maps unless allow_unproven=True"
            )
