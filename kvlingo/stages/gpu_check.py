"""The GPU check (gpu_check.py): what a machine with one CUDA GPU measures of this suite, in one call and one table.

In order, each step bounded in time (and all of them by --budget-s: a step that would start past it is
skipped and the table says so):

  1. the tests marked `gpu` (`pytest -m gpu` over the test files that hold them);
  2. perf.py --device cuda at 4,096 / 8,192 / 16,384 tokens, l2s then s2l, each direction's default
     family (the pilot profile's), optimised: deferred values off and on, CUDA graphs on and off; the
     first run also times transformers' cache and attention as shipped, whose re-prefill (eager SDPA,
     DynamicCache) every row's second speedup is taken against;
  3. the toy demo's benchmark (benchmark.py --profile demo) on CUDA, on the trained demo run carried over;
  4. where the time goes: perf.py --kernels at 8,192 and 16,384 tokens, l2s then s2l, each direction's
     default handoff (token input with exact:0) as perf runs it optimised (CUDA graphs on), a few trials.

It writes OUT/gpu-check.md (the table, with the tests' and the toy benchmark's lines under it, then the
profile section), OUT/gpu-check.json (every row with its raw trials, and the profiles) and each perf
run's own report under OUT/perf/ (the profiled runs' in OUT/perf/profile-DIRECTION/, with their
profile.json and profile.md). The profile section holds, per direction and length, each phase of the
handoff (the translation, including the exact layer 0 and the token features of the default
translator; the new turn) and the re-prefill, each timed and profiled after warm-ups with device syncs
(kvlingo/bench/profile.py): the time per step, the device's busy time, the achieved TFLOP/s and GB/s
against the floors at the GPU's datasheet peaks (H100 and H200 variants; any other device: the perf
run's measured peaks, marked unknown device), and each phase's top kernels by self device time (name,
calls, total ms, share).
`--dry-run` runs the same steps on the CPU with the 2-layer stand-in pair at tiny lengths (and the
toy benchmark on a few conversations; the profile's kernels are the CPU's aten ops): everything but
the device (tests/stages/test_gpu_check.py runs it).

It runs with plain `python3` and the packages beside it (no .venv): torch with CUDA, transformers as
pinned in pyproject.toml, tokenizers, safetensors, numpy, tqdm, matplotlib and pytest; it names
whatever is missing or too old before running anything (exit 2). So nothing above `check` imports more
than the standard library.

On the GPU machine (torch 2.11 + CUDA 13, transformers 5.17, no network), prepared here on the CPU:

    pip download --no-deps -d .whl transformers==5.24.0     # the pinned transformers, as a wheel
    make toy && make prepare train PROFILE=demo              # artifacts/toy, data/demo, artifacts/demo-l2s

then one device call (the script straight away: `make gpu-check PY=python3` does the same into
results/gpu-check, but make would read $OUT as its own variable):

    run(command="python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && "
                "export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 && python3 gpu_check.py --out $OUT/gpu-check",
        carry=[".whl", "artifacts/toy", "data/demo", "artifacts/demo-l2s", "results/demo-l2s"], timeout_s=540)

and the table is $OUT/gpu-check/gpu-check.md. The steps' caps add up to more than the budget; the
budget (460 s by default) keeps the whole call inside the timeout with a minute to spare. The first
three steps took 275 s on an H200 (docs/results.md); the profile goes last, so a budget run short
skips it (the table says so) rather than a step before it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from ..errors import Refusal
from ..inputs.argtypes import number
from ..io import ROOT
from .skeleton import Stage

LENGTHS = (4096, 8192, 16384)
DRY_LENGTHS = (32, 64)
PROFILE_LENGTHS = (8192, 16384)  # where the handoff's time goes (a dry run: DRY_LENGTHS)
# (deferred values, CUDA graphs) per perf run; the first also times the shipped mode (the eager SDPA baseline)
CONFIGS = (("off", True), ("on", True), ("off", False), ("on", False))
REQUIRED = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "tqdm", "matplotlib", "pytest")
# each step's own cap on a GPU
STEP_SECONDS = {"tests": 150, "perf-l2s": 150, "perf-s2l": 210, "benchmark": 150, "profile": 150}
DRY_FACTOR = 4  # a dry run's caps: a shared CPU spends most of them importing torch and transformers


class GpuCheck(Stage):
    name = "gpu-check"
    script = "gpu_check.py"
    summary = "The GPU check: what a machine with one CUDA GPU measures of this suite, in one call and one table."
    examples = (
        "python3 gpu_check.py",
        ".venv/bin/python gpu_check.py --dry-run --out /tmp/gc",
        "# into $OUT through make: $$OUT (make would read $OUT as its own variable $O followed by UT)",
        "make gpu-check PY=python3 GPU_CHECK_ARGS='--out $$OUT/gpu-check'",
    )
    common = False

    @classmethod
    def add_args(cls, p) -> None:
        p.add_argument("--out", default="results/gpu-check", help="where the table, the JSON and the runs' reports go")
        p.add_argument(
            "--dry-run",
            action="store_true",
            help="the same steps on the CPU: the 2-layer stand-in pair, tiny "
            "lengths, the toy benchmark on a few conversations",
        )
        p.add_argument(
            "--budget-s",
            type=number(above=0),
            default=None,
            help="no step runs past this many seconds from the start (default 460; a dry run 1800)",
        )
        p.add_argument(
            "--skip",
            nargs="+",
            default=[],
            choices=("tests", "perf", "benchmark", "profile"),
            help="steps to leave out",
        )
        p.add_argument(
            "--directions", nargs="+", default=["l2s", "s2l"], choices=("l2s", "s2l"), help="perf's directions"
        )
        p.add_argument("--large", default="artifacts/toy/large", help="the toy benchmark's large model")
        p.add_argument("--small", default="artifacts/toy/small", help="the toy benchmark's small model")
        p.add_argument("--bench-profile", default="demo", help="the toy benchmark's profile")
        p.add_argument("--bench-data", default="data/demo", help="the toy benchmark's prepared data")
        p.add_argument("--bench-artifacts", default="artifacts", help="where the trained run's translators are")
        p.add_argument("--bench-run", default="demo-l2s", help="the trained run the toy benchmark scores")
        p.add_argument("--bench-results", default="results", help="where that run's CPU report is (compared, if there)")
        # the check's own subprocess: one direction's perf runs, in one process (torch and CUDA load once)
        p.add_argument("--perf-worker", choices=("l2s", "s2l"), default=None, help=argparse.SUPPRESS)
        # ... and the profile's: perf.py --kernels for each of --directions, in one process
        p.add_argument("--profile-worker", action="store_true", help=argparse.SUPPRESS)

    # ------------------------------------------------------------------ check
    def check(self) -> None:
        """Every package missing or too old and every benchmark input missing, named before anything runs."""
        self.t0, self.out = time.time(), Path(self.args.out)
        if self.args.perf_worker or self.args.profile_worker:
            return
        problems = missing_packages(need_cuda=not self.args.dry_run) + missing_inputs(self.args)
        if problems:
            raise Refusal("not ready:\n  " + "\n  ".join(problems))

    def load(self) -> None:
        if self.args.perf_worker or self.args.profile_worker:
            return
        import torch

        self.env_line = (
            f"{'dry run on the CPU' if self.args.dry_run else torch.cuda.get_device_name(0)}, "
            f"torch {torch.__version__}, transformers {importlib.import_module('transformers').__version__}, "
            f"python {sys.version.split()[0]}"
        )

    # ------------------------------------------------------------------ run
    def run(self) -> int | list[dict]:
        """The steps' records (a perf worker: its exit status)."""
        args, out = self.args, self.out
        if args.perf_worker:
            return perf_worker(args.perf_worker, args.dry_run, out)
        if args.profile_worker:
            return profile_worker(args.directions, args.dry_run, out)
        out.mkdir(parents=True, exist_ok=True)
        deadline = self.t0 + (args.budget_s if args.budget_s is not None else 1800.0 if args.dry_run else 460.0)
        factor = DRY_FACTOR if args.dry_run else 1.0
        print(f"gpu-check: {self.env_line}", flush=True)
        return [run_step(name, argv, deadline, out / log, factor) for name, argv, log in step_commands(args, out)]

    # ------------------------------------------------------------------ publish
    def publish(self, steps: int | list[dict]) -> int:
        """gpu-check.json, then gpu-check.md (last: its presence marks a finished check); the exit status."""
        from ..io import atomic_write_json, atomic_write_text

        args, out = self.args, self.out
        if args.perf_worker or args.profile_worker:
            return steps
        rows = perf_rows(out, args.directions, args.dry_run) if "perf" not in args.skip else []
        profiles = profile_reports(out, args.directions) if "profile" not in args.skip else {}
        notes = [
            f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {self.env_line}; {time.time() - self.t0:.0f} s in all.",
            *step_notes(steps, out, args),
        ]
        md = markdown(rows, notes, args.dry_run) + profile_section(profiles)
        atomic_write_json(
            out / "gpu-check.json",
            {
                "env": self.env_line,
                "dry_run": args.dry_run,
                "steps": steps,
                "rows": rows,
                "profile": profiles,
                "seconds": time.time() - self.t0,
            },
        )
        atomic_write_text(out / "gpu-check.md", md)  # last: its presence marks a finished check
        print("\n" + md, flush=True)
        return 0 if all(s["status"] == "passed" for s in steps) else 1


# --------------------------------------------------------------------------- what the machine has
def pinned_transformers() -> tuple[int, ...]:
    """The lowest transformers version pyproject.toml allows."""
    text = (ROOT / "pyproject.toml").read_text()
    found = re.search(r'"transformers>=([0-9.]+)', text)
    return tuple(int(x) for x in found.group(1).split(".")) if found else (0,)


def version_of(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def missing_packages(need_cuda: bool) -> list[str]:
    """One line per package that is missing or too old (empty: ready)."""
    problems = []
    for name in REQUIRED:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            problems.append(f"{name} is missing ({e})")
            continue
        if name == "transformers" and version_of(module.__version__) < pinned_transformers():
            want = ".".join(map(str, pinned_transformers()))
            problems.append(
                f"transformers {module.__version__} is older than the {want} pyproject.toml pins: carry "
                f"a wheel (pip download --no-deps -d .whl transformers=={want}) and install it first "
                "(python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && "
                "export PYTHONPATH=/tmp/site)"
            )
    if need_cuda and not problems:
        import torch

        if not torch.cuda.is_available():
            problems.append(f"torch {torch.__version__} sees no CUDA device (use --dry-run on a CPU)")
    return problems


def missing_inputs(args) -> list[str]:
    """The benchmark's inputs that are not there, with the command that makes them."""
    if "benchmark" in args.skip:
        return []
    need = {
        Path(args.large): "make toy",
        Path(args.small): "make toy",
        Path(args.bench_data): "make prepare PROFILE=demo",
        Path(args.bench_artifacts) / args.bench_run / "distilled" / "manifest.json": "make train PROFILE=demo",
    }
    return [
        f"{path} is missing ({make} makes it; carry it to the GPU machine, or pass --skip benchmark)"
        for path, make in need.items()
        if not path.exists()
    ]


# --------------------------------------------------------------------------- steps
def step_commands(args, out: Path) -> list[tuple[str, list[str], str]]:
    """(step, command, log file name) of each step not skipped, in order: the GPU tests, perf per direction (this
    script again, as --perf-worker), the toy benchmark."""
    py = sys.executable
    steps = []
    if "tests" not in args.skip:
        steps.append(
            ("tests", [py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *gpu_test_files()], "tests.log")
        )
    if "perf" not in args.skip:
        dry = ["--dry-run"] if args.dry_run else []
        for d in args.directions:
            worker = [py, str(ROOT / "gpu_check.py"), "--perf-worker", d, "--out", str(out), *dry]
            steps.append((f"perf-{d}", worker, f"perf-{d}.log"))
    if "benchmark" not in args.skip:
        steps.append(("benchmark", benchmark_argv(args, out, py), "benchmark.log"))
    if "profile" not in args.skip:  # last: a budget run short skips it, not the table's steps before it
        dry = ["--dry-run"] if args.dry_run else []
        worker = [py, str(ROOT / "gpu_check.py"), "--profile-worker", "--directions", *args.directions]
        steps.append(("profile", [*worker, "--out", str(out), *dry], "profile.log"))
    return steps


def benchmark_argv(args, out: Path, py: str) -> list[str]:
    """benchmark.py on the trained demo run (a dry run: on the CPU, a few conversations)."""
    return [
        py,
        "benchmark.py",
        "--profile",
        args.bench_profile,
        "--large",
        args.large,
        "--small",
        args.small,
        "--data",
        args.bench_data,
        "--artifacts",
        args.bench_artifacts,
        "--run",
        args.bench_run,
        "--results",
        str(out / "benchmark"),
        "--device",
        "cpu" if args.dry_run else "cuda",
        "--dtype",
        "float32",
        "--allow-cv",
        "--force",
        *(["--limit", "4"] if args.dry_run else []),
    ]


def perf_argv(direction: str, defer: str, graphs: bool, first: bool, dry: bool, out: Path) -> list[str]:
    device = (
        [
            "--device",
            "cpu",
            "--arch",
            "tiny",
            "--new-turn-tokens",
            "4",
            "--timing-warmups",
            "0",
            "--timing-repeats",
            "2",
            "--max-repeats",
            "2",
        ]
        if dry
        else ["--device", "cuda", "--timing-repeats", "20", "--max-repeats", "40"]
    )
    return [
        *device,
        "--direction",
        direction,
        "--lengths",
        *map(str, DRY_LENGTHS if dry else LENGTHS),
        "--modes",
        *(("shipped", "optimised") if first else ("optimised",)),
        "--defer-values",
        defer,
        *([] if graphs else ["--no-cuda-graphs"]),
        "--allow-cv",
        "--results",
        str(out / "perf"),
        "--run",
        run_name(direction, defer, graphs),
    ]


def run_name(direction: str, defer: str, graphs: bool) -> str:
    return f"{direction}-defer-{defer}-graphs-{'on' if graphs else 'off'}"


def perf_worker(direction: str, dry: bool, out: Path) -> int:
    """Every perf run of one direction in this process (torch and the CUDA context load once); each run
    writes its report as it finishes, so a step stopped at its time cap keeps the runs before it."""
    from .perf import Perf

    status = 0
    for i, (defer, graphs) in enumerate(CONFIGS):
        argv = perf_argv(direction, defer, graphs, i == 0, dry, out)
        print(f"gpu-check: perf.py {' '.join(argv)}", flush=True)
        try:
            Perf.main(argv)
        except SystemExit as e:
            status = status or (e.code if isinstance(e.code, int) else 1)
        if not dry:
            import torch

            torch.cuda.empty_cache()
    return status


def profile_argv(direction: str, dry: bool, out: Path) -> list[str]:
    """perf.py --kernels at PROFILE_LENGTHS, optimised as perf runs it by default, a few timed trials (the
    profile times and profiles each phase itself)."""
    device = (
        ["--device", "cpu", "--arch", "tiny", "--new-turn-tokens", "4", "--timing-warmups", "0"]
        if dry
        else ["--device", "cuda"]
    )
    return [
        *device,
        "--timing-repeats",
        "2" if dry else "5",
        "--max-repeats",
        "2" if dry else "5",
        "--direction",
        direction,
        "--lengths",
        *map(str, DRY_LENGTHS if dry else PROFILE_LENGTHS),
        "--allow-cv",
        "--kernels",
        "--results",
        str(out / "perf"),
        "--run",
        f"profile-{direction}",
    ]


def profile_worker(directions, dry: bool, out: Path) -> int:
    """perf.py --kernels for each direction in this process; each run writes its profile as it finishes."""
    from .perf import Perf

    status = 0
    for direction in directions:
        argv = profile_argv(direction, dry, out)
        print(f"gpu-check: perf.py {' '.join(argv)}", flush=True)
        try:
            Perf.main(argv)
        except SystemExit as e:
            status = status or (e.code if isinstance(e.code, int) else 1)
        if not dry:
            import torch

            torch.cuda.empty_cache()
    return status


def run_step(name: str, argv: list[str], deadline: float, log: Path, factor: float = 1.0) -> dict:
    """A subprocess bounded by its own cap (× `factor`) and the deadline; its output goes to `log` and the console."""
    left = deadline - time.time()
    cap = min(factor * STEP_SECONDS[name], left)
    if cap < 20:
        return {"step": name, "status": "skipped", "why": f"the budget had {max(0, left):.0f} s left"}
    t0 = time.time()
    with open(log, "w") as f:
        try:
            proc = subprocess.run(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=cap)
            status = "passed" if proc.returncode == 0 else f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            status = f"stopped at its {cap:.0f} s cap"
    text = log.read_text(errors="replace")
    print(text[-4000:], flush=True)
    return {
        "step": name,
        "status": status,
        "seconds": round(time.time() - t0, 1),
        "log": log.name,
        "tail": text[-2000:],
    }


def gpu_test_files() -> list[str]:
    return sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if "pytest.mark.gpu" in p.read_text()
    )


def tests_summary(step: dict) -> str:
    found = re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", step.get("tail", ""))
    return ", ".join(f"{n} {what}" for n, what in found) or step["status"]


# --------------------------------------------------------------------------- the table
def perf_rows(out: Path, directions, dry: bool) -> list[dict]:
    """One row per (direction, length, deferred values, CUDA graphs), plus the shipped rows, from the reports."""
    rows = []
    for direction in directions:
        eager = {}  # length → the shipped re-prefill's trials: the eager SDPA baseline
        for defer, graphs in CONFIGS:
            path = out / "perf" / run_name(direction, defer, graphs) / "perf.json"
            if not path.is_file():
                rows.append({"direction": direction, "run": run_name(direction, defer, graphs), "missing": True})
                continue
            report = json.loads(path.read_text())
            for point in report["results"]["lengths"]:
                n = point["context_tokens"]
                for mode, r in point["modes"].items():
                    if mode == "shipped":
                        eager[n] = r["paths"]["target_reprefill"]["trials_s"]
                    rows.append(perf_row(direction, report, point, mode, r, eager.get(n)))
    return rows


def perf_row(direction: str, report: dict, point: dict, mode: str, r: dict, base: list[float] | None) -> dict:
    """One mode's row at one length of a perf report; `base`: the shipped re-prefill's trials there, if timed."""
    from ..eval.stats import ratio_of_medians_interval

    cfg, handoff = report["config"], r["paths"]["source_cache_handoff"]
    return {
        "direction": direction,
        "family": cfg["family"],
        "settings": cfg["family_settings"],
        "context": point["context_tokens"],
        "mode": mode,
        "deferred": r["deferred_values"],
        "graphs": bool(r["cuda_graphs"]),
        "graphed": r["cuda_graphs"],
        "graph_errors": r["graph_errors"],
        "reprefill_ms": 1e3 * r["paths"]["target_reprefill"]["median_s"],
        "handoff_ms": 1e3 * handoff["median_s"],
        "speedup": r["speedup"]["source_cache_handoff"],
        "interval": r["speedup_interval"]["source_cache_handoff"],
        "vs_eager": None if base is None else _median(base) / handoff["median_s"],
        "vs_eager_interval": None if base is None else ratio_of_medians_interval(base, handoff["trials_s"]),
        "translate_ms": 1e3 * r["breakdown"]["translate"]["median_s"],
        "new_turn_ms": 1e3 * r["breakdown"]["new_turn"]["median_s"],
        "limit": point["limit"]["speedup_limit"],
        "noisy": r["noisy"],
        "reprefill_trials_s": r["paths"]["target_reprefill"]["trials_s"],
        "handoff_trials_s": handoff["trials_s"],
        "device": report["env"].get("device"),
    }


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2])


def _x(value, interval=None) -> str:
    if value is None:
        return "—"
    return f"{value:.3g}×" + (f" ({interval[0]:.3g}–{interval[1]:.3g})" if interval else "")


TABLE_HEAD = (
    "direction",
    "family",
    "context",
    "mode",
    "values",
    "CUDA graphs",
    "re-prefill ms",
    "handoff ms",
    "speedup (95% interval)",
    "vs eager SDPA re-prefill",
    "translate ms",
    "new turn ms",
    "limit",
    "CV flags",
)


def table(rows: list[dict]) -> str:
    head = TABLE_HEAD
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.get("missing"):
            lines.append(f"| {r['direction']} | | | | | {r['run']}: no report | " + "| " * (len(head) - 6))
            continue
        family = r["family"] + "".join(
            f" {k}={v}" for k, v in r["settings"].items() if k in ("k", "rank", "key_rank") and v
        )
        graphs = ("on" if r["graphed"] else "off") + (
            " (failed: " + "; ".join(r["graph_errors"]) + ")" if r["graph_errors"] else ""
        )
        cells = [
            r["direction"],
            family,
            f"{r['context']:,}",
            r["mode"],
            "deferred" if r["deferred"] else "translated",
            graphs if r["mode"] == "optimised" else "—",
            f"{r['reprefill_ms']:.4g}",
            f"{r['handoff_ms']:.4g}",
            _x(r["speedup"], r["interval"]),
            _x(r["vs_eager"], r["vs_eager_interval"]),
            f"{r['translate_ms']:.4g}",
            f"{r['new_turn_ms']:.4g}",
            f"{r['limit']:.3g}×",
            ", ".join(r["noisy"]) or "",
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def benchmark_line(out: Path, args) -> str:
    path = out / "benchmark" / args.bench_run / "benchmark.json"
    if not path.is_file():
        return "toy demo benchmark: no report"
    res = json.loads(path.read_text())["results"]
    arms = res["quality"]["arms"]
    kl = {name: arms[name]["kl_token_mean"] for name in ("closed_form", "distilled", "control") if name in arms}
    cpu = Path(args.bench_results) / args.bench_run / "benchmark.json"
    here = ""
    if cpu.is_file():
        cpu_arms = json.loads(cpu.read_text())["results"]["quality"]["arms"]
        here = "; the carried CPU report: " + ", ".join(
            f"{k} {cpu_arms[k]['kl_token_mean']:.4f}" for k in kl if k in cpu_arms
        )
    controls = "; ".join(
        f"{d}: reconstruction {c['reconstruction']['passed']}/{c['reconstruction']['n']}, identity "
        f"{c['identity']['passed']}/{c['identity']['n']}"
        for d, c in res["controls"].items()
        if isinstance(c, dict) and "reconstruction" in c
    )
    return (
        "toy demo benchmark (KL/token): "
        + ", ".join(f"{k} {v:.4f}" for k, v in kl.items())
        + here
        + (f"; native controls {controls}" if controls else "")
    )


def step_notes(steps: list[dict], out: Path, args) -> list[str]:
    """The lines under the table: the GPU tests' counts, the toy benchmark's KLs, every step that did not pass."""
    by = {s["step"]: s for s in steps}
    notes = []
    if "tests" in by:
        notes.append(f"GPU tests (pytest -m gpu, {len(gpu_test_files())} files): {tests_summary(by['tests'])}.")
    if "benchmark" in by:
        notes.append(benchmark_line(out, args) + f" ({by['benchmark']['status']}).")
    return notes + [
        f"{s['step']}: {s['status']}" + (f" ({s['why']})" if s.get("why") else "") + "."
        for s in steps
        if s["status"] != "passed" and s["step"] != "benchmark"
    ]


def profile_reports(out: Path, directions) -> dict[str, dict | None]:
    """Each direction's profile.json (None where the step left none)."""
    paths = {d: out / "perf" / f"profile-{d}" / "profile.json" for d in directions}
    return {d: json.loads(path.read_text()) if path.is_file() else None for d, path in paths.items()}


def profile_section(profiles: dict[str, dict | None]) -> str:
    """Where the time goes, per direction (kvlingo/bench/profile.py's tables); empty when the step was skipped."""
    if not profiles:
        return ""
    from ..bench.profile import markdown as profile_markdown

    return "\n" + "\n".join(
        profile_markdown(report, level="###") if report else f"### Where the time goes ({d}): no profile\n"
        for d, report in profiles.items()
    )


def markdown(rows: list[dict], notes: list[str], dry: bool) -> str:
    return (
        "## GPU check"
        + (" (dry run on the CPU: the device is all that differs)" if dry else "")
        + "\n\n"
        + "BF16 on CUDA (FP32 in a dry run), random weights at the real shapes (the 2-layer stand-in in a dry run), "
        "16-token new turn; speedup = re-prefill ÷ the handoff from an existing source cache, both in the row's "
        "mode; vs eager SDPA = transformers' own re-prefill as shipped (DynamicCache, sdpa, no graph) ÷ the "
        "row's handoff.\n\n" + table(rows) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    )
