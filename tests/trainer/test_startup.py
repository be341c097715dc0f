"""The trainer's start-up clock: ``startup_s.process`` (interpreter start up to the
training code) is only as true as the process start time it is measured from."""

from __future__ import annotations

import subprocess
import sys
import time

from tests import harness

REPO = str(harness.REPO)


def test_process_start_time_is_when_the_process_started_to_a_clock_tick():
    code = "from trainer.train import process_start_time; print(repr(process_start_time()))"
    for _ in range(3):  # /proc/stat's whole-second btime was up to a second early, most starts
        before = time.time()
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
        after = time.time()
        started = float(out.stdout.strip())
        # One clock tick (10 ms at the usual 100 Hz) of rounding, and a little for clocks read apart.
        assert before - 0.03 <= started <= after, (before, started, after)
