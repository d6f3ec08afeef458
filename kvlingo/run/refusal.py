"""The refusal of a run the machine cannot carry as asked (kept apart so that light modules can raise it).

It is one of `stage.REFUSALS`: one line on stderr and exit status 2, before anything is written.
"""

INTERRUPTED_STATUS = 130  # a stage ended by Ctrl-C exits with the shell's status for it (128 + SIGINT)


class RunRefused(ValueError):
    """A run the machine cannot carry as asked: it would not fit in memory, or launch settings it cannot honour."""
