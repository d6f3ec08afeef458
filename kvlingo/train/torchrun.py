"""torchrun, as the suite launches it: `python -m kvlingo.train.torchrun --standalone --nproc-per-node N script --
flags` takes torchrun's own flags and runs its launcher, but when a rank fails it says so in one line per rank that
died by a signal (the ranks that stopped because of it say why themselves, in one line each) instead of torchrun's
error summary and traceback, and exits with status 1.
"""

from __future__ import annotations

import logging
import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # its summary is said below
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as e:
        # SIGTERM is the launcher stopping the ranks left once one failed; any other signal killed a rank
        killed = {r: f for r, f in e.failures.items() if f.exitcode < 0 and f.signal_name() != "SIGTERM"}
        for rank, failure in sorted(killed.items()):
            print(
                f"torchrun: rank {rank} was killed ({failure.signal_name()}); the job stopped with it: run the same "
                "command again with --resume (make train TRAIN_ARGS=--resume NPROC=...)",
                file=sys.stderr,
            )
        statuses = {f.exitcode for f in e.failures.values() if f.exitcode > 0}
        return max(statuses) if statuses and not killed else 1
    except KeyboardInterrupt:
        print("torchrun: interrupted; run the same command again with --resume", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
