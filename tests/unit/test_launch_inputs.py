"""The free disk a launch needs for its checkpoints. (A launch's inputs read on the
run host: tests/integration/test_launch_inputs.py.)"""

from __future__ import annotations

import json

from dflashctl.hosts.facts import InputsCheck, input_problems
from tests import harness

REPO = harness.REPO
GOOD_LINE = json.dumps({"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]})


def test_too_little_disk_for_the_checkpoints_is_an_error():
    trainer = {"model": {"drafter_layers": 5, "num_target_layers": 5}, "train": {"keep_checkpoints": 3}}
    found = InputsCheck(model={"path": "/m", "exists": True, "config": True, "config_error": None,
                               "hidden_size": 4096, "intermediate_size": 12288}, disk_free=20 << 30)
    (problem,) = input_problems(found, trainer, "gpu1", "prod.yaml")
    assert problem.code == "disk-full" and "20 GiB free" in problem.message and "3 + 1 checkpoints" in problem.message
    assert "keep_checkpoints" in problem.fix and "then launch again" in problem.fix
    assert "restart" not in problem.fix  # freeing space needs no new config: nothing to say of restarts
    assert input_problems(InputsCheck(disk_free=200 << 30, model=found.model), trainer, "gpu1", "prod.yaml") == []
    assert [p.code for p in input_problems(InputsCheck(disk_free=1 << 20), {}, "h", "p.yaml")] == ["disk-full"]
