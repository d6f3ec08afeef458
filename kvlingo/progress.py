"""Progress bars in logs. On a terminal a tqdm bar redraws in place; written to a file or a pipe every redraw
is another line, and a demo's log was mostly bars. `quiet_in_logs` makes every tqdm bar of the process (the
stages', transformers' and datasets') redraw at most once every LOG_INTERVAL_S when stderr is not a terminal:
a bar shorter than that leaves its first and last line, a long one a line per interval.
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
    from tqdm import std

    std.tqdm.__init__ = partialmethod(std.tqdm.__init__, mininterval=LOG_INTERVAL_S, maxinterval=LOG_INTERVAL_S)
    _quieted = True
    return True
