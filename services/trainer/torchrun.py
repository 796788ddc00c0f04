"""How `opsd run` starts a trainer of several ranks: torchrun, plus what a role owes `opsd run`.

    python -m services.trainer.torchrun --standalone --nproc-per-node N -m services.trainer --config C --run-dir D

takes torchrun's arguments and adds two things torchrun alone does not do:
- it stops when `opsd run` dies, even by SIGKILL (`opsd.service.die_with_parent`); torchrun then
  stops its ranks, so none is left behind;
- it exits FATAL_EXIT when a rank did (torchrun exits 1 for any failed rank), so the supervisor
  stops the run with its reason instead of restarting a trainer that cannot start.
"""

from __future__ import annotations

import sys
import threading

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from opsd.service import FATAL_EXIT, die_with_parent


def main(argv: list[str]) -> int:
    """Run torchrun with `argv`; returns 0, FATAL_EXIT (a rank exited with it) or 1 (another failure)."""
    stop = threading.Event()
    die_with_parent(stop)
    if stop.is_set():  # `opsd run` is already gone
        return 0
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        return FATAL_EXIT if any(f.exitcode == FATAL_EXIT for f in e.failures.values()) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
