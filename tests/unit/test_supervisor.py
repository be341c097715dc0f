"""The supervisor's pure helpers: which part of a host's log is the current
process's own output (after the last restart marker)."""

from __future__ import annotations

from dflashctl.supervise.supervisor import RESTART_MARKER, _attempt_output


def test_only_the_current_process_output_is_classified():
    from dflashctl.hosts.probe import ProbeResult

    log = "\n".join([
        "step 10/100",
        "Detected that you are using FX to symbolically trace a dynamo-optimized function",
        f"{RESTART_MARKER} restart 1 at 2026-01-01 00:00:00 (fx_race, serialized warm-up) ---",
        "step 12/100",
    ])
    pr = ProbeResult(run_dir="/r", session="s", host_time=0.0, log_tail=log, pane_tail=None)
    assert _attempt_output(pr) == "step 12/100"
    pr.log_tail = log.rsplit("\n", 1)[0]  # nothing printed since the restart: the pane (None) -> ""
    assert _attempt_output(pr) == ""
