"""Time helpers: wait on a condition until a deadline, never for a fixed time, and
deadlines that stretch with the machine's load.

A deadline here is how long a test is willing to wait for something that does
happen on a healthy system; reaching it fails the test. On a loaded machine
(other suites, a CPU-bound process per core) everything takes longer, so each
deadline is scaled by ``time_scale()``: 1 on an idle machine, the load per CPU
above that (at most ``MAX_SCALE``), or DFLASHCTL_TEST_TIME_SCALE when set. A
scaled deadline never weakens a test: a condition that is met is met sooner,
and one that is never met still fails, later.
"""

from __future__ import annotations

import os
import time
from typing import Callable, TypeVar

T = TypeVar("T")

MAX_SCALE = 8.0
SCALE_ENV = "DFLASHCTL_TEST_TIME_SCALE"


def time_scale() -> float:
    """How many times longer than on an idle machine a deadline may be, now."""
    given = os.environ.get(SCALE_ENV)
    if given:
        return max(1.0, float(given))
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this platform
        return 1.0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1.0, min(MAX_SCALE, load / max(1, cpus)))


def scaled(seconds: float) -> float:
    """A deadline of ``seconds`` on an idle machine, stretched by the load now."""
    return seconds * time_scale()


def wait_for(predicate: Callable[[], T], timeout: float = 30.0, what: str = "condition", every: float = 0.1,
             tick: Callable[[], object] | None = None) -> T:
    """Poll ``predicate`` (calling ``tick`` first, when given) until it returns a true
    value, which is returned. ``timeout`` is the deadline on an idle machine; it is
    stretched by the load (``time_scale``) checked again as it runs out."""
    start = time.monotonic()
    while True:
        if tick is not None:
            tick()
        value = predicate()
        if value:
            return value
        waited = time.monotonic() - start
        if waited > timeout and waited > timeout * time_scale():
            raise AssertionError(f"timed out after {waited:.3g}s waiting for {what} (deadline {timeout:g}s, scaled "
                                 f"by the load)")
        time.sleep(every)

