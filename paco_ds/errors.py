"""User-facing errors: one clear line, exit code 2, no traceback.

Everything a user can get wrong (a config key, a data file, a reward name, a server endpoint)
raises a subclass of `UserError`. Entry points wrap their body in `exit_on_user_error`, which
prints the message on one line and exits with status 2. Programming errors keep their tracebacks.

kernels/ sits below paco_ds and raises its own `kernels.BackendError` (a ValueError) when the
configured `kernels.backend` cannot run here (e.g. 'cpp' on GPU tensors, 'triton' without CUDA);
`exit_on_user_error` reports it as the config error it is.

In a multi-process run, a rank whose collective lost a peer that failed (and printed its own
line) says so in one line too (paco_ds.distributed.exit_after_peer), not in a traceback.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator


class UserError(Exception):
    """A mistake in the user's input; the message names the key, file:line or endpoint."""

    exit_code = 2


class ConfigError(UserError):
    pass


class DataError(UserError):
    pass


class TrainingDiverged(UserError):
    """The run stopped itself: too many non-finite losses or rewards in a row."""

    exit_code = 3


class RewardError(UserError):
    """A reward could not be computed (server down, model not served, bad response)."""


@contextlib.contextmanager
def exit_on_user_error(prog: str = "paco_ds") -> Iterator[None]:
    try:
        yield
    except UserError as err:
        _exit(prog, str(err), err.exit_code)
    except ValueError as err:
        kernels = sys.modules.get("kernels")  # no BackendError can come from a kernels never imported
        if kernels is None or not isinstance(err, getattr(kernels, "BackendError", ())):
            raise
        _exit(prog, f"config key 'kernels.backend': {err}", ConfigError.exit_code)
    except RuntimeError as err:  # a collective whose other rank failed (and said why) first
        dist = sys.modules.get("paco_ds.distributed")
        if dist is None or dist.peer_gone(err) is None:
            raise
        dist.exit_after_peer(prog, err)


def _exit(prog: str, message: str, code: int) -> None:
    msg = " ".join(message.split("\n"))
    print(f"{prog}: error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(code) from None
