"""The stage skeleton: every stage is a `Stage`, run by `Stage.main` in one order.

    parse       the stage's flags (`add_args`; no torch until they are parsed, so --help is quick)
    check       the config from flags and profile; bad input refused while nothing on disk has changed
    up_to_date  the finished report, when everything it was made from is the same: nothing runs
    load        models and data (the heavy imports)
    run         the work
    publish     the report (atomic, written last) and a summary on stdout

A stage script is a few lines: its usage docstring and `main = SomeStage.main`. A `Refusal` (exit 2) or a
`Failure` (exit 1) from any step becomes one line on stderr, "stage: why, and the fix", never a traceback;
Ctrl-C and SIGTERM become one line and the shell's status for them (saying that --resume goes on, for a
resumable stage); the run locks a stage took (`lock_run`) are released however it ends. A stage run inside
another (ablate's and frontier's cells) passes an interrupt on to the outer one, which stops as a whole.
"""

from __future__ import annotations

import fcntl
import functools
import os
import signal
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from ..errors import Failure, Refusal, RunRefused
from ..inputs.flags import StageParser, stage_parser
from ..io import ROOT
from ..progress import quiet_in_logs

INTERRUPTED_STATUS = 130  # a stage ended by Ctrl-C exits with the shell's status for it (128 + SIGINT)
TERMINATED_STATUS = 143  # ... and by SIGTERM (128 + SIGTERM)


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that a stage ends as an interrupted one does."""


class Stage(ABC):
    """One stage of the suite (see the module docstring). A subclass sets the class attributes, adds its flags in
    `add_args`, and writes the steps it has; `run` is the one every stage needs."""

    name: ClassVar[str] = ""  # what its one-line messages start with
    script: ClassVar[str] = ""  # the command a user types: .venv/bin/python SCRIPT
    summary: ClassVar[str] = ""  # the first paragraph of --help
    examples: ClassVar[tuple[str, ...]] = ()  # the end of --help, as typed
    resumable: ClassVar[bool] = False  # an interrupted run goes on with --resume
    common: ClassVar[bool] = True  # the flags every stage shares: --profile, the pair, the run folders, --cache
    data: ClassVar[bool] = False  # ... and --data (the prepared chats)

    @classmethod
    def script_path(cls) -> Path:
        """The script's path in the repository (what the stage's code hash starts from)."""
        return ROOT / cls.script

    def __init__(self, args):
        self.args = args

    # ------------------------------------------------------------------ flags
    @classmethod
    def add_args(cls, parser: StageParser) -> None:
        """The stage's own flags (light: no heavy import here)."""
        return None

    @classmethod
    def parser(cls) -> StageParser:
        p = stage_parser(cls.summary, cls.examples, cls.common, cls.data, prog=cls.script or None)
        cls.add_args(p)
        return p

    @classmethod
    def parse_args(cls, argv=None):
        return cls.parser().parse_args(argv)

    # ------------------------------------------------------------------ the steps
    def check(self) -> None:
        """Resolve the config; refuse what cannot run, before anything on disk changes."""
        return None

    def up_to_date(self) -> Any | None:
        """The finished result when nothing it depends on changed (then nothing else runs), else None."""
        return None

    def load(self) -> None:
        """Load models and data."""
        return None

    @abstractmethod
    def run(self) -> Any:
        """The work; its result goes to `publish`."""

    def publish(self, result: Any) -> Any:
        """Write the report and print the summary; returns what `main` returns."""
        return result

    # ------------------------------------------------------------------ running it
    @classmethod
    def main(cls, argv=None, **options) -> Any:
        """Parse `argv` (default: the command line) and run the steps in order; `options` go to the constructor
        (what a caller injects: the recipe's cell runner in tests)."""

        @refusals_exit(cls.name, cls.resumable)
        def steps():
            stage = cls(cls.parse_args(argv), **options)
            stage.check()
            done = stage.up_to_date()
            if done is not None:
                return done
            stage.load()
            return stage.publish(stage.run())

        return steps()


# --------------------------------------------------------------------------- one line, one exit status
def say(stage: str, message: str) -> None:
    """One line on stderr, from one process: under torchrun every rank ends alike."""
    if os.environ.get("RANK", "0") == "0":
        print(f"{stage}: {message}", file=sys.stderr)


def _terminate(signum, frame):
    raise Terminated


def refusals_exit(stage: str, resumable: bool = False) -> Callable:
    """Decorator for a stage's main(): a `Refusal` (exit 2) or a `Failure` (exit 1) becomes one line; Ctrl-C and
    SIGTERM one line each and status 130 or 143 (saying that --resume goes on, for a `resumable` stage); the
    run locks the stage took (`lock_run`) are released when it returns or fails. Progress bars are throttled
    when stderr is not a terminal (`kvlingo.progress`)."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def main(*args, **kwargs):
            global _depth
            held = len(_run_locks)
            quiet_in_logs()  # a log (stderr not a terminal) gets a bar's line at most every 30 s, not every redraw
            outer = _depth == 0 and threading.current_thread() is threading.main_thread()
            before = signal.signal(signal.SIGTERM, _terminate) if outer else None
            _depth += 1
            try:
                return fn(*args, **kwargs)
            except (Refusal, Failure) as e:
                say(stage, str(e))
                raise SystemExit(e.status) from None
            except (KeyboardInterrupt, Terminated) as e:
                if _depth > 1:  # an inner stage: the interrupt belongs to the stage that runs it
                    raise
                how = "stopped by SIGTERM" if isinstance(e, Terminated) else "interrupted"
                say(
                    stage,
                    f"{how}; every file it wrote is whole (writes are atomic)"
                    + ("; run the same command with --resume to go on from where it stopped" if resumable else ""),
                )
                raise SystemExit(TERMINATED_STATUS if isinstance(e, Terminated) else INTERRUPTED_STATUS) from None
            finally:
                _depth -= 1
                if outer:
                    signal.signal(signal.SIGTERM, before)
                while len(_run_locks) > held:  # this call's own (a stage may run another in-process)
                    release = _run_locks.pop()
                    fcntl.flock(release, fcntl.LOCK_UN)
                    release.close()

        return main

    return wrap


_run_locks: list = []  # open lock files of the stages running in this process, innermost last
_depth = 0  # stages running in this process, one inside another (a driver's in-process cells)


def lock_run(folder: str | Path, name: str, elsewhere: str = "--run", root_flag: str = "--results") -> None:
    """Take `folder/.NAME.lock` (an exclusive flock) for the rest of the stage's main (`refusals_exit` frees
    it), or refuse at once when another process holds it: two runs of one stage writing one run's files
    would mix their checkpoints, rows and reports. The lock dies with its process, so a killed run never
    leaves it behind. Under torchrun rank 0 takes it for the job.

    Taking it also makes the folder and writes a file there, so a stage that calls it before its models
    load learns then, not after its work, that its reports could not be saved (RunRefused naming
    `root_flag`, the flag that chose the folder)."""
    if os.environ.get("RANK", "0") != "0":
        return
    folder = Path(folder)
    path = folder / f".{name}.lock"
    if any(h.name == str(path) for h in _run_locks):  # this process holds it already
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")
    except OSError as e:
        raise RunRefused(
            f"cannot write to {folder} ({e.strerror or e}); give {root_flag} a folder you can write to"
        ) from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise RunRefused(
            f"another {name} is still running in {folder} (it holds {path}); wait for it to finish, "
            f"or give this one another {elsewhere}"
        ) from None
    _run_locks.append(handle)
