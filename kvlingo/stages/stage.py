"""What the stage scripts share: the common flags, and refusals that end a run with one clear line.

A refusal (`kvlingo.errors.Refusal`) is an input the stage will not work on: a pair no translator
can join, a resume against other settings, a translator or data folder made for something else.
It is raised before anything on disk is touched; `refusals_exit` turns it, and a `Failure` after
the work (checks or a gate that did not pass), into one line on stderr ("stage: why, and the fix")
and the exit status the error carries (2 and 1), never a traceback.
"""

from __future__ import annotations

import argparse
import difflib
import fcntl
import functools
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from ..bench.timing import CV_LIMIT
from ..core.cache import CACHE_KINDS
from ..errors import Failure, Refusal, RunRefused
from ..inputs.argtypes import number, whole
from ..inputs.models import add_pair_args
from ..inputs.profiles import PROFILES
from ..progress import quiet_in_logs
from ..records.paths import add_run_args

INTERRUPTED_STATUS = 130  # a stage ended by Ctrl-C exits with the shell's status for it (128 + SIGINT)


def say(stage: str, message: str) -> None:
    """One line on stderr, from one process: under torchrun every rank ends alike."""
    if os.environ.get("RANK", "0") == "0":
        print(f"{stage}: {message}", file=sys.stderr)


def refusals_exit(stage: str, resumable: bool = False) -> Callable:
    """Decorator for a stage's main(): a `Refusal` (exit 2) or a `Failure` (exit 1) becomes one line, Ctrl-C one
    line and status 130 (saying that --resume goes on, for a `resumable` stage), and the run locks the
    stage took (`lock_run`) are released when it returns or fails. A stage run inside another
    (ablate's and frontier's cells) passes Ctrl-C on to the outer one, which stops as a whole. Progress bars
    are throttled when stderr is not a terminal (`kvlingo.progress`)."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def main(*args, **kwargs):
            global _depth
            held = len(_run_locks)
            quiet_in_logs()  # a log (stderr not a terminal) gets a bar's line at most every 30 s, not every redraw
            _depth += 1
            try:
                return fn(*args, **kwargs)
            except (Refusal, Failure) as e:
                say(stage, str(e))
                raise SystemExit(e.status) from None
            except KeyboardInterrupt:
                if _depth > 1:  # an inner stage: the interrupt belongs to the stage that runs it
                    raise
                say(
                    stage,
                    "interrupted; every file it wrote is whole (writes are atomic)"
                    + ("; run the same command with --resume to go on from where it stopped" if resumable else ""),
                )
                raise SystemExit(INTERRUPTED_STATUS) from None
            finally:
                _depth -= 1
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


class StageParser(argparse.ArgumentParser):
    """argparse as every stage uses it: a flag must be spelled out in full (argparse would take `--update 10` as
    `--updates 10` and run), and a parse error is one line, "script: what is wrong (see script --help)", exit 2;
    an unknown flag names the nearest real one."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        self.unknown = list(extras)  # parse_args reports them through error(), as one joined string
        return namespace, extras

    def error(self, message: str):
        unknown = getattr(self, "unknown", None)
        if unknown and message.startswith(_UNRECOGNIZED):
            message = unknown_flag(unknown, self)
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


_UNRECOGNIZED = argparse._("unrecognized arguments: %s").split("%s")[0]


def unknown_flag(extras: Sequence[str], parser: argparse.ArgumentParser) -> str:
    """'no flag --update; did you mean --updates?' for the first token a parser did not take."""
    flags = [t for t in extras if t.startswith("-")]
    if not flags:
        return f"unexpected argument {extras[0]!r}"
    given = flags[0].split("=")[0]
    options = sorted({o for a in parser._actions for o in a.option_strings if o.startswith("--")})
    longer = [o for o in options if o.startswith(given)]
    if longer:  # an abbreviation, which argparse would otherwise have expanded
        return (
            f"no flag {given} (flags are spelled out in full, never abbreviated); did you mean {' or '.join(longer)}?"
        )
    near = difflib.get_close_matches(given, options, n=1, cutoff=0.6)
    return f"no flag {given}" + (f"; did you mean {near[0]}?" if near else "")


def stage_parser(doc: str, examples: list[str], common: bool = False, data: bool = False) -> argparse.ArgumentParser:
    """A stage's parser (`StageParser`): the first paragraph of its docstring, `--help` ending with examples,
    and (with `common`) the flags every stage shares (`add_common_args`)."""
    parser = StageParser(
        description=doc.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n" + "".join(f"  {e}\n" for e in examples),
    )
    if common:
        add_common_args(parser, data)
    return parser


def check_passthrough(parser: argparse.ArgumentParser, tokens: Sequence[str], script: str) -> None:
    """Parse `tokens`, flags passed through to stage `script`, with that stage's own `parser` now: an unknown
    flag or a bad value raises ValueError naming it before anything runs, rather than when the stage starts
    (perhaps hours into a recipe). Flags must be spelled out in full: the stage would expand an abbreviation
    silently, past any check on the exact names."""

    def fail(message: str):
        raise ValueError(f"{message} (see python {script} --help)")

    if any(t in ("-h", "--help") for t in tokens):
        fail(f"--help passed through to {script} would print its help in place of running it")
    parser.prog, parser.allow_abbrev = script, False
    parser.error = fail  # every parse error (a bad value, a missing argument) raises instead of exiting
    parser.exit = lambda status=0, message=None: fail(message or f"{script} would exit")
    _, unknown = parser.parse_known_args(list(tokens))
    if unknown:
        fail(f"{script}: {unknown_flag(unknown, parser)}")


def add_timing_args(parser, warmups: str = "the profile's", repeats: str = "the profile's") -> None:
    """The timing flags: new-turn length, warm-ups, trials and the CV screen (`warmups`/`repeats`: their defaults, in
    words)."""
    parser.add_argument(
        "--new-turn-tokens", type=whole(1), default=16, help="k: tokens of the new turn after the context"
    )
    parser.add_argument(
        "--timing-warmups", type=whole(0), default=None, help=f"untimed warm-ups per path (default: {warmups})"
    )
    parser.add_argument(
        "--timing-repeats", type=whole(1), default=None, help=f"timed trials per path (default: {repeats})"
    )
    parser.add_argument(
        "--cv-limit", type=number(at_least=0), default=CV_LIMIT, help="flag timings whose CV exceeds this"
    )
    parser.add_argument(
        "--allow-cv",
        action="store_true",
        help="do not fail the run on CV flags; they stay in the report (default: the profile's)",
    )


def add_refresh_arg(parser) -> None:
    parser.add_argument(
        "--refresh",
        default="none",
        type=refresh_setting,
        help="recompute part of the translated context natively: none, tail:W, layers:K "
        "(W, K: a count or a percentage), select:R (a fraction), layer:l (diagnostic: target layer l "
        "native, the rest translated), or exact:0 (the target's layer 0 from the token ids); see "
        "kvlingo/core/refresh.py",
    )


def refresh_setting(text: str):
    from ..core.refresh import Refresh, RefreshError

    try:
        return Refresh.parse(text)
    except RefreshError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


GENERATIVE_TASKS = ("ifeval", "gsm8k")


def add_task_data_args(parser) -> None:
    """--data-root, --skip-tasks and --resume of the stages that run IFEval and GSM8K as cells (ablate, frontier)."""
    parser.add_argument(
        "--data-root", default="data", help="prepared IFEval and GSM8K data root (ROOT/ifeval, ROOT/gsm8k)"
    )
    parser.add_argument(
        "--skip-tasks", nargs="*", choices=GENERATIVE_TASKS, default=[], help="generative evaluations to leave out"
    )
    parser.add_argument(
        "--resume", action="store_true", help="keep finished cells whose key matches; refuse changed ones"
    )


def generative_tasks(args) -> tuple[str, ...]:
    """The tasks not skipped, each refused unless its prepared data exists (the message names how to prepare it)."""
    tasks = tuple(t for t in GENERATIVE_TASKS if t not in args.skip_tasks)
    for t in tasks:
        if not (Path(args.data_root) / t / "manifest.json").is_file():
            how = "ifeval.py --prepare" if t == "ifeval" else "task_eval.py --task gsm8k --prepare"
            raise Refusal(
                f"no prepared {t} data under {args.data_root}/{t}: prepare it ({how}) or pass --skip-tasks {t}"
            )
    return tasks


def add_common_args(parser, data: bool = False, default_profile: str = "pilot") -> None:
    """--profile, the pair flags, the run-folder flags and --cache (and --data for stages that read prepared chats)."""
    parser.add_argument(
        "--profile",
        default=default_profile,
        choices=sorted(PROFILES),
        help=f"run profile: budgets and settings (default {default_profile})",
    )
    parser.add_argument(
        "--cache",
        choices=CACHE_KINDS,
        default=CACHE_KINDS[0],
        help="preallocated: the translation writes the target's cache, no copies, attention without "
        "repeated K/V; dynamic: transformers' DynamicCache and sdpa as shipped (default preallocated)",
    )
    add_pair_args(parser)
    add_run_args(parser)
    if data:
        parser.add_argument("--data", default=None, help="prepared data folder (default data/<profile>)")
