"""What `restart --reload` takes from a changed playbook: the launch's own values
left out, other model shapes or GPU placement refused. (The restart for real:
tests/integration/test_restart_reload.py.)"""

from __future__ import annotations

import pytest

from dflashctl.core.errors import ConfigError
from dflashctl.runs.recorded import reloaded, trainer_changes


def test_changes_leave_out_what_the_launch_set_and_reload_refuses_shapes_and_placement():
    recorded = {"run_dir": "/w/runs/r", "model": {"preset": "tiny", "dtype": "auto"},
                "train": {"steps": 100, "lr": 1e-3}, "compile": {"cache_dir": "~/.cache/c"},
                "placement": {"device": "cpu", "target": [0], "drafter": [0]}}
    playbook = {"model": {"preset": "tiny", "dtype": "float32"}, "train": {"steps": 400, "lr": 1e-3},
                "compile": {}, "placement": {"device": "cpu", "target": [0], "drafter": [0]}}
    assert trainer_changes(recorded, playbook) == [("model.dtype", "auto", "float32"), ("train.steps", 100, 400)]
    config, changes = reloaded({"trainer": recorded, "gpus": []}, playbook)
    assert config["trainer"]["train"]["steps"] == 400 and config["trainer"]["run_dir"] == "/w/runs/r"
    assert config["trainer"]["compile"]["cache_dir"] == "~/.cache/c" and len(changes) == 2
    with pytest.raises(ConfigError) as caught:
        reloaded({"trainer": recorded}, {**playbook, "model": {"preset": "small"},
                                         "placement": {"device": "cuda", "target": [0], "drafter": [1]}})
    text = str(caught.value)
    assert "trainer.model.preset: 'tiny' -> 'small'" in text and "checkpoint" in text
    assert "trainer.placement.device" in text and "claimed at launch" in text and "dflashctl launch" in caught.value.hint
