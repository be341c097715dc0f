"""The GPU split from measured capacities, as a table; and `dflashctl advise` reading a
real run directory's metrics.jsonl through the local host (a real store, a real file)."""

from __future__ import annotations

import json

from dflashctl.core import contract
from dflashctl.store import Store
from tests.harness import cli
from tests.harness.placement import T0, line

SPLIT = {"target": ["cuda:0"], "drafter": ["cuda:1"]}


def test_advise_reads_a_run_directory_on_its_host(tmp_path):
    store_path = tmp_path / "runs.db"
    store = Store(str(store_path))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [line(s, target_tok_s=[50_000.0], target_busy=[1.0], seq_tok_s=50_000.0, step_ms=400.0, wait_ms=200.0,
                  drafters=1, gpus=SPLIT, peaks={"cuda:0": 90.0, "cuda:1": 60.0}).to_line() for s in range(1, 8)]
    (run_dir / contract.METRICS_FILE).write_text("\n".join(["{not json", *lines]) + "\n")
    store.create_run("calib", "local", {}, T0, run_id="calib-1", run_dir=str(run_dir))
    done = cli.invoke("advise", "calib-1", "--gpus", "8", "--json", env={"DFLASHCTL_STORE": str(store_path)})
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert (got["mode"], got["targets"], got["drafters"], got["bottleneck"], got["lines"]) == ("split", 5, 3, "target", 7)
    assert got["placement"] == {"target": [0, 1, 2, 3, 4], "drafter": [5, 6, 7]} and got["fits_shared"] is False
