"""The GPU split from measured capacities, as a table; and `dflashctl advise` reading a
real run directory's metrics.jsonl through the local host (a real store, a real file)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dflashctl import contract
from dflashctl.placement import PlacementError, advise
from dflashctl.store import Store

T0 = 1_800_000_000.0


def line(step: int, *, target_tok_s, target_busy, seq_tok_s, step_ms, wait_ms, drafters, phase="training"):
    return contract.Metrics(time=T0 + step, step=step, total_steps=1000, tok_s=1.0, phase=phase, extra={
        "target_tok_s": target_tok_s, "target_busy": target_busy, "tok_s_per_drafter": [1.0] * drafters,
        "seq_tok_s": seq_tok_s, "step_ms": step_ms, "time_ms": {"wait": wait_ms}})


@pytest.mark.parametrize("case,total,expect", [
    # 1+1: the target makes 100K/s busy 100 %, the drafter waits half its step: it could take 100K/s.
    ("drafter-waits", None, (1, 1, "target")),
    # 1+1, target idles half the time: a drafter takes 50K/s, a target could make 200K/s -> 8 GPUs: 2+6.
    ("target-idles", 8, (2, 6, "drafter")),
    ("balanced", 8, (4, 4, "balanced")),
])
def test_split_from_measured_capacities(case, total, expect):
    figures = {
        "drafter-waits": dict(target_tok_s=[50_000.0], target_busy=[1.0], seq_tok_s=50_000.0, step_ms=400.0,
                              wait_ms=200.0, drafters=1),
        "target-idles": dict(target_tok_s=[50_000.0], target_busy=[0.25], seq_tok_s=50_000.0, step_ms=400.0,
                             wait_ms=0.0, drafters=1),
        "balanced": dict(target_tok_s=[50_000.0], target_busy=[1.0], seq_tok_s=50_000.0, step_ms=400.0,
                         wait_ms=0.0, drafters=1),
    }[case]
    lines = [line(s, **figures) for s in range(1, 6)]
    a = advise(lines, total)
    assert (a.targets, a.drafters, a.bottleneck) == expect
    assert a.lines == 5 and a.current == (1, 1) and f"{a.targets} target + {a.drafters} drafter" in a.reason


def test_no_figures_no_advice():
    with pytest.raises(PlacementError, match="let the run train"):
        advise([contract.Metrics(time=T0, step=1, total_steps=10, tok_s=1.0, phase="training")])
    starting = line(1, target_tok_s=[1.0], target_busy=[1.0], seq_tok_s=1.0, step_ms=1.0, wait_ms=0.0,
                    drafters=1, phase="compiling")
    with pytest.raises(PlacementError):
        advise([starting])


def test_advise_reads_a_run_directory_on_its_host(tmp_path):
    store_path = tmp_path / "runs.db"
    store = Store(str(store_path))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [line(s, target_tok_s=[50_000.0], target_busy=[1.0], seq_tok_s=50_000.0, step_ms=400.0, wait_ms=200.0,
                  drafters=1).to_line() for s in range(1, 8)]
    (run_dir / contract.METRICS_FILE).write_text("\n".join(["{not json", *lines]) + "\n")
    store.create_run("calib", "local", {}, T0, run_id="calib-1", run_dir=str(run_dir))
    done = subprocess.run([sys.executable, "-m", "dflashctl", "advise", "calib-1", "--gpus", "8", "--json"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "DFLASHCTL_STORE": str(store_path)})
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert (got["targets"], got["drafters"], got["bottleneck"], got["lines"]) == (5, 3, "target", 7)
