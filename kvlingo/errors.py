"""How a stage says no: a refusal before any work, or a failure after it.

Every refusal derives from `Refusal`: an input or setting the suite will not work on (a pair no
translator can join, a resume against other settings, a damaged file, a flag out of range). Its
message names the problem and the fix. A `Failure` is a stage that ran and wrote every file, but
whose checks, gate or cells did not pass. A stage's main (`kvlingo.stages.skeleton.refusals_exit`)
catches both in one place: one line on stderr, "stage: message", and the exit status below.
"""


class Refusal(Exception):
    """An input or setting the suite will not work on, refused before anything is written."""

    status = 2


class RunRefused(Refusal, ValueError):
    """A run the machine cannot carry as asked: it would not fit in memory, or launch settings it cannot honour."""


class Failure(Exception):
    """A stage that ran and wrote its files, whose checks, gate or cells failed (its report says which)."""

    status = 1
