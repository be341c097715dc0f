"""What a run's playbook holds it to: budgets, regression and restart limits.

As recorded at launch while the playbook file has not changed since, else as
the file says now.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dflashctl.core.units import NA, fmt_duration, fmt_tok_s
from dflashctl.runs.recorded import playbook_now, thresholds_of
from dflashctl.store import Run


@dataclass(frozen=True)
class Thresholds:
    """What the run's playbook holds it to (as its file says now)."""

    source: str | None
    error: str | None  # why the playbook could not be read (the defaults are shown)
    baseline_tok_s: float | None  # the playbook's; None: learned from earlier healthy runs
    regression_fraction: float
    regression_windows: int
    max_eta_s: float | None
    stall_window_s: float
    compile_budget_s: float
    startup_budget_s: float
    poll_interval_s: float
    max_restarts: int
    restart_window_s: float
    crash_loop_k: int

    def lines(self) -> list[tuple[str, str]]:
        """(name, value) pairs for the detail view."""
        return [
            ("baseline", fmt_tok_s(self.baseline_tok_s) if self.baseline_tok_s else "learned from earlier healthy runs"),
            ("regression", f"below {self.regression_fraction:.0%} of baseline for {self.regression_windows} windows"),
            ("max ETA", fmt_duration(self.max_eta_s) if self.max_eta_s else "none"),
            ("stall window", fmt_duration(self.stall_window_s)),
            ("compile budget", fmt_duration(self.compile_budget_s)),
            ("startup budget", fmt_duration(self.startup_budget_s)),
            ("poll interval", fmt_duration(self.poll_interval_s)),
            ("restarts", f"at most {self.max_restarts} in {fmt_duration(self.restart_window_s)}; "
                         f"stop after {self.crash_loop_k} without progress"),
            ("playbook", self.source or NA),
        ] + ([("warning", self.error)] if self.error else [])


def _thresholds_of(run: Run, playbooks_dir: str | None) -> Thresholds:
    """The run's playbook thresholds: as recorded at launch while the playbook file
    has not changed since, else read from the file (it was launched from, else by
    name) as it says now."""
    source = (run.config or {}).get("playbook_source")
    recorded = (run.config or {}).get("thresholds")
    if isinstance(recorded, dict) and source and os.path.isfile(source) and os.path.getmtime(source) <= run.created:
        try:
            return Thresholds(source, None, **recorded)
        except TypeError:
            pass  # recorded by another version: read the file
    pb, error = playbook_now(run, None, playbooks_dir)  # pydantic: only when the file must be read
    if pb is not None:
        return Thresholds(pb.source, None, **thresholds_of(pb))
    return Thresholds(source, f"playbook {run.playbook} cannot be read ({error}): default thresholds shown",
                      **thresholds_of(None))
