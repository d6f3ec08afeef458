"""The flags every stage shares, and the parser they are read with. No torch here: `--help` and a refused flag
cost what Python's start does, and the heavy imports follow the parse.

    StageParser         argparse as every stage uses it: flags spelled out in full, negative numbers read as
                        numbers, a float flag refused unless finite, one line per error naming the nearest flag
    add_common_args     --profile, --cache, the pair, the run folders (and --data)
    add_pair_args       --large, --small, --direction, --device, --dtype
    add_run_args        --run, --artifacts, --results
    add_family_args     --family and every family's option flags (kvlingo/core/families declares them)
    add_refresh_arg     --refresh (kvlingo.core.settings.Refresh, parsed here, once)
    add_timing_args     --new-turn-tokens, --timing-warmups, --timing-repeats, --cv-limit, --allow-cv
    add_task_data_args  --data-root, --skip-tasks, --resume of the stages that run IFEval and GSM8K as cells
"""

from __future__ import annotations

import argparse
import difflib
import math
import re
from collections.abc import Sequence
from pathlib import Path

from ..core.settings import CACHE_KINDS, DIRECTIONS, Refresh, RefreshError
from ..errors import Refusal
from .argtypes import number, whole
from .profiles import PROFILES

LARGE_ID = "Qwen/Qwen3-1.7B"  # the default pair (pinned revisions: kvlingo.inputs.models)
SMALL_ID = "Qwen/Qwen3-0.6B"
CV_LIMIT = 0.10  # a timing whose trials vary more than this (SD / mean) is flagged as noisy
GENERATIVE_TASKS = ("ifeval", "gsm8k")


class StageParser(argparse.ArgumentParser):
    """argparse as every stage uses it: a flag must be spelled out in full (argparse would take `--update 10` as
    `--updates 10` and run), a negative number is a value (`--lr -1e-3` reaches the flag's own check), a flag
    of type float takes finite numbers only (`--max-accuracy-loss nan` is refused when parsed, not after the
    work), and a parse error is one line, "script: what is wrong (see script --help)", exit 2; an unknown
    flag names the nearest real one."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)
        # argparse's own pattern misses exponents (-1e-3), which then read as an unknown flag
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")

    def add_argument(self, *args, **kwargs):
        if kwargs.get("type") is float:
            kwargs["type"] = finite
        return super().add_argument(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        self.unknown = list(extras)  # parse_args reports them through error(), as one joined string
        return namespace, extras

    def error(self, message: str):
        unknown = getattr(self, "unknown", None)
        if unknown and message.startswith(_UNRECOGNIZED):
            message = unknown_flag(unknown, self)
        message = near_choice(message)
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


_UNRECOGNIZED = argparse._("unrecognized arguments: %s").split("%s")[0]
_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)$")


def near_choice(message: str) -> str:
    """argparse's "invalid choice: 'pliot' (choose from ...)" with "; did you mean 'pilot'?" added when one is
    close."""
    m = _INVALID_CHOICE.search(message)
    if not m:
        return message
    choices = re.findall(r"'([^']*)'", m.group(2)) or [c.strip() for c in m.group(2).split(",")]
    near = difflib.get_close_matches(m.group(1), choices, n=1, cutoff=0.6)
    return message + (f"; did you mean {near[0]!r}?" if near else "")


def finite(text: str) -> float:
    """A float flag's value: a finite number (nan and inf would pass every comparison a stage makes)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return value


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


def stage_parser(
    doc: str, examples: Sequence[str], common: bool = False, data: bool = False, prog: str | None = None
) -> StageParser:
    """A stage's parser (`StageParser`): the first paragraph of its docstring, `--help` ending with examples,
    and (with `common`) the flags every stage shares (`add_common_args`)."""
    parser = StageParser(
        prog=prog,
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
        raise ValueError(f"{message} (see .venv/bin/python {script} --help)")

    if any(t in ("-h", "--help") for t in tokens):
        fail(f"--help passed through to {script} would print its help in place of running it")
    parser.prog, parser.allow_abbrev = script, False
    parser.error = fail  # every parse error (a bad value, a missing argument) raises instead of exiting
    parser.exit = lambda status=0, message=None: fail(message or f"{script} would exit")
    _, unknown = parser.parse_known_args(list(tokens))
    if unknown:
        fail(f"{script}: {unknown_flag(unknown, parser)}")


# --------------------------------------------------------------------------- the shared flags
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


def add_pair_args(parser, default_dtype: str = "bfloat16") -> None:
    """The flags every stage uses to name its pair."""
    parser.add_argument(
        "--large",
        default=LARGE_ID,
        help=f"larger model: Hub id[@rev] or local folder (default {LARGE_ID} @ pinned rev)",
    )
    parser.add_argument(
        "--small",
        default=SMALL_ID,
        help=f"smaller model: Hub id[@rev] or local folder (default {SMALL_ID} @ pinned rev)",
    )
    parser.add_argument(
        "--direction",
        choices=DIRECTIONS,
        default="l2s",
        help="l2s: large builds the cache, small continues; s2l the reverse",
    )
    parser.add_argument("--device", default="auto", help="cuda, mps, cpu or auto (cuda, then mps, then cpu)")
    parser.add_argument("--dtype", default=default_dtype, help="model dtype: bfloat16 or float32")


def add_run_args(parser, required: bool = False) -> None:
    """--run, --artifacts and --results: the same three flags on every stage."""
    parser.add_argument(
        "--run",
        required=required,
        default=None,
        help="run name: files go to ARTIFACTS/RUN/ and RESULTS/RUN/ (default PROFILE-DIRECTION)",
    )
    parser.add_argument("--artifacts", default="artifacts", help="artifacts root: translators and checkpoints")
    parser.add_argument("--results", default="results", help="results root: reports")


def family_options() -> dict[str, list]:
    """Every family's options by training flag: {flag: [(family, Option), ...]} (families share flags: --rank)."""
    from ..core.families import FAMILIES

    out: dict[str, list] = {}
    for name, fam in FAMILIES.items():
        for option in fam.options:
            out.setdefault(option.flag_name, []).append((name, option))
    return out


def add_family_args(parser, what: str = "the profile's, with its settings") -> None:
    """--family and every family's option flags (declared in kvlingo/core/families), each None unless given (the
    run takes the profile's variant or the family's own defaults: kvlingo.train.config.resolve_family)."""
    from ..core.families import FAMILIES

    parser.add_argument(
        "--family",
        choices=sorted(FAMILIES),
        default=None,
        help="translator family: " + ", ".join(sorted(FAMILIES)) + f" (default: {what})",
    )
    for flag, owners in family_options().items():
        first = owners[0][1]
        by_help: dict[str, list[str]] = {}  # families that share an option's meaning share its line
        defaults: dict[str, list[str]] = {}
        for name, option in owners:
            by_help.setdefault(option.help, []).append(name)
            if option.default is not None:
                shown = option.default.__doc__.split(" (")[0].lower() if callable(option.default) else option.default
                defaults.setdefault(str(shown), []).append(name)
        helps = "; ".join(f"{', '.join(names)}: {text}" for text, names in by_help.items())
        shown = "; ".join(f"{', '.join(names)} {value}" for value, names in defaults.items())
        choices = sorted({c for _, o in owners for c in o.choices}) if all(o.choices for _, o in owners) else None
        parser.add_argument(
            flag,
            type=whole(first.minimum) if first.minimum is not None else first.type,
            choices=choices,
            default=None,
            help=helps + (f" (default: {shown})" if shown else ""),
        )


def family_flags(args) -> dict:
    """The family option flags given on the command line, by `Option.dest`."""
    dests = {option.dest for owners in family_options().values() for _, option in owners}
    return {d: getattr(args, d) for d in dests if getattr(args, d, None) is not None}


def refresh_setting(text: str) -> Refresh:
    """--refresh's type: the text parsed into a `Refresh`, once, here."""
    try:
        return Refresh.parse(text)
    except RefreshError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_refresh_arg(parser, default: str | None = "none", what: str = "none") -> None:
    """--refresh (a `Refresh`; `default` None: the stage picks one, `what` says which)."""
    parser.add_argument(
        "--refresh",
        default=None if default is None else Refresh.parse(default),
        type=refresh_setting,
        help="recompute part of the translated context natively: none, tail:W, layers:K "
        "(W, K: a count or a percentage), select:R (a fraction), layer:l (diagnostic: target layer l "
        "native, the rest translated), or exact:0 (the target's layer 0 from the token ids); see "
        f"kvlingo/core/refresh.py (default: {what})",
    )


def add_timing_args(parser, warmups: str = "the profile's", repeats: str = "the profile's") -> None:
    """The timing flags: new-turn length, warm-ups, trials and the CV screen (`warmups`/`repeats`: their defaults,
    in words)."""
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


def add_task_data_args(parser, resume_note: str = "") -> None:
    """--data-root, --skip-tasks and --resume of the stages that run IFEval and GSM8K as cells (ablate, frontier);
    `resume_note`: what else --resume allows, in words."""
    parser.add_argument(
        "--data-root", default="data", help="prepared IFEval and GSM8K data root (ROOT/ifeval, ROOT/gsm8k)"
    )
    parser.add_argument(
        "--skip-tasks", nargs="*", choices=GENERATIVE_TASKS, default=[], help="generative evaluations to leave out"
    )
    parser.add_argument(
        "--resume", action="store_true", help="keep finished cells whose key matches; refuse changed ones" + resume_note
    )


def generative_tasks(args) -> tuple[str, ...]:
    """The tasks not skipped, each refused unless its prepared data exists (the message names the command that
    prepares it offline, as `make ablate` does)."""
    tasks = tuple(t for t in GENERATIVE_TASKS if t not in args.skip_tasks)
    for t in tasks:
        if not (Path(args.data_root) / t / "manifest.json").is_file():
            how = {
                "ifeval": f"make {args.data_root}/ifeval/manifest.json EVAL_ROOT={args.data_root} "
                "IFEVAL_SOURCE=artifacts/toy/corpus/ifeval.jsonl",
                "gsm8k": f"make {args.data_root}/gsm8k/manifest.json EVAL_ROOT={args.data_root} "
                "TASK_SOURCE_DIR=artifacts/toy/corpus",
            }[t]
            raise Refusal(
                f"no prepared {t} data under {args.data_root}/{t}: prepare it (on the toy world: {how}; "
                f"`make ablate PROFILE=demo` does it for you) or pass --skip-tasks {t}"
            )
    return tasks
