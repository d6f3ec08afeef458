"""Progress bars in logs. On a terminal a tqdm bar redraws in place; written to a file or a pipe every redraw
is another line, and a demo's log was mostly bars. `quiet_in_logs` makes every tqdm bar of the process (the
stages', transformers' and datasets') redraw at most once every LOG_INTERVAL_S when stderr is not a terminal,
a new postfix or description waiting for that redraw: a bar shorter than that leaves its first and last
line, a long one a line per interval.
"""

from __future__ import annotations

import sys
from functools import partialmethod

LOG_INTERVAL_S = 30.0
_quieted = False


def quiet_in_logs(stream=None) -> bool:
    """Throttle every tqdm bar when `stream` (default stderr, where the bars go) is not a terminal; True when it
    did. Idempotent; arguments a bar is given explicitly still win."""
    global _quieted
    stream = sys.stderr if stream is None else stream
    if _quieted or (hasattr(stream, "isatty") and stream.isatty()):
        return _quieted
    try:
        from tqdm import std
    except ImportError:  # no tqdm, no bars (gpu_check.py names it missing under a bare python3)
        return False

    std.tqdm.__init__ = partialmethod(std.tqdm.__init__, mininterval=LOG_INTERVAL_S, maxinterval=LOG_INTERVAL_S)
    # a new postfix or description shows at the next redraw instead of forcing one (a loss per update would)
    std.tqdm.set_postfix = partialmethod(std.tqdm.set_postfix, refresh=False)
    std.tqdm.set_description = partialmethod(std.tqdm.set_description, refresh=False)
    _quieted = True
    return True
