"""``train.profile_steps``: torch.profiler over a window of training steps.

The coordinator calls ``before(step)`` and ``after(steps_done)`` around each step.
GPU kernels are recorded for the whole process (every thread's streams), so the
table's kernel rows show the target, drafter and optimiser work of the window's
steps; operator rows (``aten::...``) and their CPU times come from the
coordinator's thread only (the optimiser step).
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch

TABLE_FILE = "profile.txt"
TRACE_FILE = "profile.json"


class StepProfiler:
    def __init__(self, run_dir: str, first_step: int, steps: int, log: Callable[[str], None]):
        self.run_dir, self.first, self.steps, self.log = run_dir, first_step, steps, log
        self._prof: Optional[torch.profiler.profile] = None

    def before(self, step: int) -> None:
        if self.steps <= 0 or step != self.first or self._prof is not None:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities)
        self._prof.__enter__()
        self.log(f"profile: steps {step + 1}-{step + self.steps}")

    def after(self, steps_done: int) -> None:
        if self._prof is None or steps_done < self.first + self.steps:
            return
        self.close()

    def close(self) -> None:
        """Stop and write the files (also when the run ends inside the window)."""
        prof, self._prof = self._prof, None
        if prof is None:
            return
        for device in range(torch.cuda.device_count()):
            torch.cuda.synchronize(device)
        prof.__exit__(None, None, None)
        averages = prof.key_averages()
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        with open(os.path.join(self.run_dir, TABLE_FILE), "w") as f:
            f.write(averages.table(sort_by=sort, row_limit=40, max_name_column_width=90))
        prof.export_chrome_trace(os.path.join(self.run_dir, TRACE_FILE))
        self.log(f"profile: wrote {TABLE_FILE} and {TRACE_FILE} in {self.run_dir}")
