"""User-facing errors: one clear line, exit code 2, no traceback.

Everything a user can get wrong (a config key, a data file, a reward name, a server endpoint)
raises a subclass of `UserError`. Entry points wrap their body in `exit_on_user_error`, which
prints the message on one line and exits with status 2. Programming errors keep their tracebacks.

kernels/ sits below paco_ds and raises its own `kernels.BackendError` (a ValueError) when the
configured `kernels.backend` cannot run here (e.g. 'cpp' on GPU tensors, 'triton' without CUDA);
`exit_on_user_error` reports it as the config error it is.

In a multi-process run, a rank whose collective lost a peer that failed (and printed its own
line) says so in one line too (paco_ds.runtime.distributed.exit_after_peer), not in a traceback.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator, NoReturn


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
        dist = sys.modules.get("paco_ds.runtime.distributed")
        if dist is None or dist.peer_gone(err) is None:
            raise
        dist.exit_after_peer(prog, err)


def _exit(prog: str, message: str, code: int) -> None:
    msg = " ".join(message.split("\n"))
    print(f"{prog}: error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(code) from None


def run_entry_point(main: Callable[[], object]) -> NoReturn:
    """Run an entry point's `main` and end the process with its status (0, or its SystemExit's code)
    without interpreter teardown.

    Why: a finished 2-rank run sometimes died at exit with "terminate called without an active
    exception" (SIGABRT, exit 250 from the launcher; tiny qwen_edit and SD3 runs, about 1 in 20):
    a native library's worker thread (gloo's, after the process groups are shut down) was still
    joinable when the interpreter's teardown destroyed its owner. By the time `main` returns every
    file is written and closed, every judge it started is stopped and every rank has passed the
    final barrier, so teardown has nothing left to do but that; skipping it (os._exit after
    flushing) makes the status the run's own every time. An exception that escapes `main` (a bug)
    keeps Python's usual traceback and exit 1. faulthandler prints every thread's Python stack if
    a native crash still happens."""
    import faulthandler
    import logging
    import os

    faulthandler.enable()
    try:
        main()
        code = 0
    except SystemExit as err:
        if err.code is None or isinstance(err.code, int):
            code = err.code or 0
        else:  # SystemExit("message"): Python prints it and exits 1
            print(err.code, file=sys.stderr)
            code = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said
            pass
    os._exit(code)
