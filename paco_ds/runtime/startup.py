"""Where a rank's start-up goes: seconds from the process's start to each milestone of a run (the
interpreter and its imports (`imports`), the process group, the checks, the models, the engine, waiting for the
judges, the rewards), logged once when the first epoch starts and kept in its metrics as
`time/startup/<milestone>` (seconds since the process started, so each is also the sum of all before).
"""
from __future__ import annotations

import time

import psutil

_MARKS: dict[str, float] = {}


def process_age() -> float:
    """Seconds since this process started (its start time as the kernel records it)."""
    return time.time() - psutil.Process().create_time()


def mark(milestone: str) -> None:
    """This process reached `milestone` now (the first time counts)."""
    _MARKS.setdefault(milestone, process_age())


def marks() -> dict[str, float]:
    return dict(_MARKS)


def summary() -> str:
    """'12.3 s: imports 4.1, process group 0.5, ...': each milestone's own seconds, in order."""
    out, before = [], 0.0
    for name, at in _MARKS.items():
        out.append(f"{name.replace('_', ' ')} {at - before:.1f}")
        before = at
    return f"{before:.1f} s since the process started: " + ", ".join(out)
