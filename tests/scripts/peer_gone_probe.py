"""Two ranks under the deepspeed launcher: rank 0 fails with a one-line error while rank 1 waits
for it in a barrier (as a full disk on rank 0 does while rank 1 waits to save a checkpoint)."""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from paco_ds.runtime import stopping  # noqa: E402
from paco_ds.runtime.distributed import barrier, setup_distributed  # noqa: E402
from paco_ds.errors import UserError, exit_on_user_error  # noqa: E402


class ProbeFailure(UserError):
    exit_code = 74


def main():
    stopping.install()
    dist = setup_distributed()
    with exit_on_user_error("probe"):
        barrier()  # both ranks are up
        if dist.rank == 0:
            time.sleep(1.0)  # rank 1 is in the barrier below by now
            # Close this rank's connections first and give rank 1 time to see it: the launcher stops
            # every rank (SIGTERM) within a second of this process's exit, and on a loaded machine
            # that stop could otherwise reach rank 1 before it was scheduled to read the lost peer.
            torch.distributed.destroy_process_group()
            time.sleep(3.0)
            raise ProbeFailure("rank 0 failed on purpose")
        barrier()


if __name__ == "__main__":
    main()
