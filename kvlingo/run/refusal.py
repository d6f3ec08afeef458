"""The refusal of a run the machine cannot carry as asked (kept apart so that light modules can raise it).

It is one of `stage.REFUSALS`: one line on stderr and exit status 2, before anything is written.
"""


class RunRefused(ValueError):
    """A run the machine cannot carry as asked: it would not fit in memory, or launch settings it cannot honour."""
