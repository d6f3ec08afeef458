"""Running the recipe's cells: in turn, as concurrent local processes, or as SLURM job arrays (submitit).

A cell (kvlingo.stages.cells.Cell) is run as a `CellJob`: picklable and self-contained (its two
command lines, report, ledger entry and log), executed wherever it lands, a thread of the
recipe's process or a SLURM job. The job records itself in the ledger (kvlingo.stages.ledger, under
its file lock): running, then done or failed. A launcher runs one dependency level's cells (the
recipe builds the next level from their reports) and returns one `Outcome` per cell.

local  at most --max-parallel cells at once, each its own process with its own GPUs: a group of
       --gpus-per-cell of the visible GPUs, in CUDA_VISIBLE_DEVICES, held until the cell ends.
       A training cell with several GPUs runs under torchrun, one rank per GPU. A cell killed by
       a signal (preemption, the OOM killer, a kill) is requeued with the stage's resume flag,
       at most --max-requeues times; a nonzero exit status fails it.
slurm  a level's cells go out as one job array through submitit: --partition, --gpus-per-cell,
       --time-limit, --account, at most --max-parallel tasks at once. On preemption or near the
       time limit submitit signals the job, whose `checkpoint` stops the stage and hands submitit
       the same job with the resume flag to requeue: the stage goes on from its newest checkpoint.
       The recipe's process waits for the array before it builds the next level.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import Failure, RunRefused
from ..inputs.argtypes import number, whole
from ..io import ROOT, read_json
from .ledger import Ledger

PREEMPT_SIGNAL = signal.SIGUSR2  # what submitit (and SLURM's --signal) send before a preemption or the time limit


class StageFailed(Failure, RuntimeError):
    """A stage process that exited nonzero or wrote no report."""


class StageKilled(StageFailed):
    """A stage process ended by a signal: requeue it with its resume flag."""


# --------------------------------------------------------------------------- one stage process
def stage_command(argv: Sequence[str], nproc: int = 1) -> list[str]:
    """The command of a stage: this interpreter, or torchrun (from the same environment) with `nproc` ranks."""
    if nproc <= 1:
        return [sys.executable, *argv]
    from ..train.distributed import torchrun_command

    return torchrun_command(sys.executable, nproc, argv)


def run_stage(
    argv: Sequence[str],
    report: str | os.PathLike,
    log: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
    nproc: int = 1,
    hold: Callable | None = None,
    ignore: Sequence[int] = (),
) -> dict[str, Any]:
    """Run one stage script as a subprocess, then read the report it wrote last.

    Its output goes to `log` (appended) or to this terminal; `hold(proc)` sees the process while it
    runs; the signals in `ignore` are ignored by the stage (and by what it starts). Raises
    StageKilled when a signal ended it, StageFailed on a nonzero status or a missing report.
    """
    command = stage_command(argv, nproc)
    out = None
    if log:
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        out = open(log, "ab")  # noqa: SIM115 — closed below
        out.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command)}\n".encode())
        out.flush()
    saved = {s: signal.signal(s, signal.SIG_IGN) for s in ignore}  # inherited through fork and exec
    try:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT if out else None, env=env)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    try:
        if hold is not None:
            hold(proc)
        rc = proc.wait()
    finally:
        if out is not None:
            out.close()
    where = f" (log: {log})" if log else " (its output is above)"
    if rc < 0 and -rc != signal.SIGINT:  # an interrupt (Ctrl-C) stops the recipe; other signals are requeued
        raise StageKilled(f"{Path(argv[0]).name} was killed by {signal.Signals(-rc).name}{where}")
    if rc != 0:
        how = f"was interrupted ({signal.Signals(-rc).name})" if rc < 0 else f"exited with status {rc}"
        raise StageFailed(f"{Path(argv[0]).name} {how}{where}")
    if not Path(report).is_file():
        raise StageFailed(f"{Path(argv[0]).name} exited cleanly but wrote no {report}{where}")
    return read_json(report)


def stop(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGTERM a stage (torchrun passes it to its ranks), SIGKILL it after `grace_s`, and reap it.

    Called from a signal handler that interrupted `proc.wait()`, which holds Popen's wait lock:
    so the child is reaped with os.waitpid, not through Popen."""
    try:
        proc.terminate()
    except ProcessLookupError:
        return
    deadline = time.time() + grace_s
    try:
        while os.waitpid(proc.pid, os.WNOHANG)[0] == 0:
            if time.time() > deadline:
                proc.kill()
                os.waitpid(proc.pid, 0)
                return
            time.sleep(0.05)
    except ChildProcessError:  # already reaped
        pass


# --------------------------------------------------------------------------- one cell as a job
@dataclass
class CellJob:
    name: str  # the cell's ledger entry
    entry: dict[str, Any]  # what the ledger records when it starts (kvlingo.stages.ledger.entry_of)
    argv: tuple[str, ...]  # script and flags of a first run
    resume_argv: tuple[str, ...]  # the same with the stage's resume flag (a requeue, or a resumed recipe)
    report: str  # the report the stage writes last
    ledger: str  # recipe-state.json
    log: str | None = None  # the stage's output file (None: the job's own output)
    nproc: int = 1  # ranks of the stage (torchrun when > 1)
    resume: bool = False  # run resume_argv
    preemptible: bool = False  # under submitit: the stage ignores the preemption signal, `checkpoint` stops it
    runner: Callable | None = None  # an in-process stand-in for the stage process (tests); None: run_stage
    _proc: Any = field(default=None, repr=False, compare=False)  # the stage process while it runs

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_proc": None}

    def __call__(self, env: dict[str, str] | None = None) -> dict[str, Any]:
        """Run the stage and record it in the ledger; the stage's report, or StageFailed."""
        ledger = Ledger.attach(self.ledger)
        job_id = os.environ.get("SLURM_JOB_ID")
        ledger.start(self.name, self.entry, {"slurm_job_id": job_id} if job_id else None)
        argv, t0 = list(self.resume_argv if self.resume else self.argv), time.time()
        try:
            if self.runner is not None:
                report = self.runner(argv, Path(self.report))
            else:
                main = threading.current_thread() is threading.main_thread()
                report = run_stage(
                    argv,
                    self.report,
                    self.log,
                    env,
                    self.nproc,
                    self._keep,
                    ignore=(PREEMPT_SIGNAL,) if self.preemptible and main else (),
                )
        except StageFailed as e:
            ledger.fail(self.name, str(e))
            raise
        ledger.finish(self.name, self.report, time.time() - t0)
        return report

    def _keep(self, proc) -> None:
        self._proc = proc

    def checkpoint(self, *args, **kwargs):
        """submitit, on preemption or near the time limit: stop the stage; requeue this job with the resume flag."""
        from submitit.helpers import DelayedSubmission

        if self._proc is not None:
            stop(self._proc)
        return DelayedSubmission(replace(self, resume=True, _proc=None), *args, **kwargs)


@dataclass
class Outcome:
    name: str  # the cell
    report: dict | None  # the stage's report, or None when it failed
    error: str | None = None  # why it failed
    log: str | None = None  # where its output is


# --------------------------------------------------------------------------- launchers
class LocalLauncher:
    """Cells as processes on this machine, at most `max_parallel` at once, each with its own GPU group."""

    def __init__(
        self,
        max_parallel: int = 1,
        gpus: Sequence[str] = (),
        gpus_per_cell: int = 1,
        max_requeues: int = 1,
        say: Callable[[str], None] = print,
    ):
        if max_parallel < 1 or gpus_per_cell < 1 or max_requeues < 0:
            raise RunRefused("--max-parallel and --gpus-per-cell must be ≥ 1, --max-requeues ≥ 0")
        gpus = list(gpus)
        if len(set(gpus)) != len(gpus):
            twice = sorted({g for g in gpus if gpus.count(g) > 1})
            raise RunRefused(
                f"--gpus names {', '.join(twice)} more than once: two cells would share a GPU; name each GPU once"
            )
        self.groups = [gpus[i : i + gpus_per_cell] for i in range(0, len(gpus) - gpus_per_cell + 1, gpus_per_cell)]
        if gpus and not self.groups:
            raise RunRefused(
                f"--gpus-per-cell {gpus_per_cell} but only {len(gpus)} GPU(s) are visible "
                f"({','.join(gpus)}); lower --gpus-per-cell or pass --gpus"
            )
        self.width = min(max_parallel, len(self.groups)) if self.groups else max_parallel
        self.nproc, self.max_requeues, self.say = gpus_per_cell, max_requeues, say

    @property
    def writes_logs(self) -> bool:
        """Whether cells write their output to log files (several at once) or to this terminal."""
        return self.width > 1

    def run(self, jobs: list[CellJob]) -> list[Outcome]:
        if self.width == 1 or len(jobs) == 1:
            group = self.groups[0] if self.groups else []
            return [self._one(job, group) for job in jobs]
        free: queue.Queue = queue.Queue()
        for g in (self.groups or [[]] * self.width)[: self.width]:
            free.put(g)

        def one(job: CellJob) -> Outcome:
            group = free.get()
            try:
                return self._one(job, group)
            finally:
                free.put(group)

        with ThreadPoolExecutor(self.width) as pool:
            return list(pool.map(one, jobs))

    def _one(self, job: CellJob, group: list[str]) -> Outcome:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(group)} if group else None
        for attempt in range(self.max_requeues + 1):
            try:
                return Outcome(job.name, job(env=env), log=job.log)
            except StageKilled as e:
                if attempt == self.max_requeues:
                    return Outcome(job.name, None, f"{e}; requeued {attempt} time(s) already", job.log)
                self.say(f"[recipe] {job.name}: {e}; requeued with its resume flag")
                job = replace(job, resume=True)
            except StageFailed as e:
                return Outcome(job.name, None, str(e), job.log)
        raise AssertionError("unreachable")


@dataclass(frozen=True)
class SlurmSettings:
    partition: str | None  # SLURM partition (None: the cluster's default)
    account: str | None  # SLURM account to charge (None: the user's default)
    gpus_per_cell: int  # GPUs of each cell's job (and torchrun ranks of a training cell)
    time_limit_min: int  # each job's time limit; a job near it is requeued from its checkpoint
    max_parallel: int  # array tasks running at once
    cpus_per_cell: int | None  # CPUs per job (None: the partition's default)
    mem_gb: float | None  # host memory per job (None: the partition's default)
    max_requeues: int  # requeues after the time limit, at most (preemptions do not count)

    def parameters(self) -> dict[str, Any]:
        """submitit AutoExecutor parameters (slurm_* apply on SLURM only)."""
        params: dict[str, Any] = {
            "name": "kvlrelay-cell",
            "timeout_min": self.time_limit_min,
            "nodes": 1,
            "tasks_per_node": 1,
            "gpus_per_node": self.gpus_per_cell,
            "slurm_array_parallelism": self.max_parallel,
        }
        for key, value in (
            ("slurm_partition", self.partition),
            ("slurm_account", self.account),
            ("cpus_per_task", self.cpus_per_cell),
            ("mem_gb", self.mem_gb),
        ):
            if value is not None:
                params[key] = value
        return params


class SlurmLauncher:
    """Each level's cells as one SLURM job array through submitit (`cluster` local or debug: the same jobs
    run on this machine through submitit's own executors, for checks without a cluster)."""

    writes_logs = False  # the stage's output is the job's, in submitit's folder

    def __init__(
        self,
        folder: str | os.PathLike,
        settings: SlurmSettings,
        cluster: str = "slurm",
        say: Callable[[str], None] = print,
    ):
        if cluster == "slurm" and shutil.which("srun") is None:  # submitit's own test, which it fails with a traceback
            raise RunRefused(
                "--launcher slurm: no SLURM on this machine (`srun` is not on PATH); run with --launcher local, "
                "or add --submitit-cluster local (or debug) to try the slurm path on this machine"
            )
        self.folder, self.settings, self.cluster, self.say = Path(folder), settings, cluster, say
        self.nproc = settings.gpus_per_cell

    def executor(self):
        import submitit

        ex = submitit.AutoExecutor(
            folder=self.folder / "%j", cluster=self.cluster, slurm_max_num_timeout=self.settings.max_requeues
        )
        ex.update_parameters(**self.settings.parameters())
        return ex

    def submit(self, jobs: list[CellJob]) -> list:
        """Submit the jobs (one array on SLURM); their submitit handles, in order. Jobs inherit this
        environment, with the repository on PYTHONPATH so that they can load their CellJob."""
        ex = self.executor()
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *([saved] if saved else [])])
        try:
            with ex.batch():
                handles = [ex.submit(replace(job, preemptible=True)) for job in jobs]
        finally:
            if saved is None:
                os.environ.pop("PYTHONPATH")
            else:
                os.environ["PYTHONPATH"] = saved
        return handles

    def run(self, jobs: list[CellJob]) -> list[Outcome]:
        handles = self.submit(jobs)
        self.say(
            f"[recipe] submitted {len(jobs)} cell(s) ({self.cluster}): "
            + ", ".join(f"{j.name} = job {h.job_id}" for j, h in zip(jobs, handles))
        )
        outcomes = []
        for job, h in zip(jobs, handles):
            log = f"{h.paths.stdout} and {h.paths.stderr}"
            try:
                outcomes.append(Outcome(job.name, h.result(), log=log))
            except Exception as e:  # noqa: BLE001 — submitit raises the job's error in several wrappers
                lines = [x for x in str(e).splitlines() if x.strip()]
                outcomes.append(
                    Outcome(job.name, None, f"job {h.job_id}: {lines[-1] if lines else type(e).__name__}", log)
                )
        return outcomes


# --------------------------------------------------------------------------- flags
def visible_gpus() -> list[str]:
    """The GPUs this process may hand out: CUDA_VISIBLE_DEVICES, else every device torch sees."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g for g in env.split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def add_launch_args(parser) -> None:
    g = parser.add_argument_group("launching cells (settings of the run, not of its results: a resume may change them)")
    g.add_argument(
        "--launcher",
        choices=("local", "slurm"),
        default="local",
        help="local: cells as processes on this machine; slurm: each level's cells as a job array",
    )
    g.add_argument("--max-parallel", type=whole(1), default=1, help="cells (or array tasks) running at once")
    g.add_argument(
        "--gpus-per-cell",
        type=whole(1),
        default=1,
        help="GPUs of each cell; a training cell runs under torchrun with one rank per GPU",
    )
    g.add_argument("--gpus", nargs="+", default=None, help="local: GPU ids to hand out (default: all visible)")
    g.add_argument(
        "--max-requeues",
        type=whole(0),
        default=1,
        help="local: reruns of a cell killed by a signal; slurm: requeues after the time limit",
    )
    g.add_argument("--partition", default=None, help="slurm: partition")
    g.add_argument("--account", default=None, help="slurm: account")
    g.add_argument(
        "--time-limit", type=whole(1), default=24 * 60, help="slurm: minutes per job (requeued from its checkpoint)"
    )
    g.add_argument("--cpus-per-cell", type=whole(1), default=None, help="slurm: CPUs per job")
    g.add_argument("--mem-gb", type=number(above=0), default=None, help="slurm: host memory per job, GB")
    g.add_argument("--slurm-folder", default=None, help="slurm: submitit's folder (default RESULTS/RUN/slurm)")
    g.add_argument(
        "--submitit-cluster",
        choices=("slurm", "local", "debug"),
        default="slurm",
        help="with --launcher slurm, where the jobs run: slurm (default): on the cluster, through sbatch; "
        "local: as processes on this machine, through submitit's local executor; debug: one after another "
        "in this process, through submitit's debug executor, which opens pdb on a failure (checks without a cluster)",
    )


def launcher_from_args(args, results_dir: Path, say: Callable[[str], None] = print):
    if args.launcher == "local":
        gpus = args.gpus if args.gpus is not None else visible_gpus()
        return LocalLauncher(args.max_parallel, gpus, args.gpus_per_cell, args.max_requeues, say)
    settings = SlurmSettings(
        args.partition,
        args.account,
        args.gpus_per_cell,
        args.time_limit,
        args.max_parallel,
        args.cpus_per_cell,
        args.mem_gb,
        args.max_requeues,
    )
    return SlurmLauncher(args.slurm_folder or results_dir / "slurm", settings, args.submitit_cluster, say)
