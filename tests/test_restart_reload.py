"""`restart` after the playbook changed: it says that it reuses the config recorded
at launch, and `--reload` takes the playbook's trainer section again (validated,
refused when the model shapes or the GPU placement differ). Real fake-trainer runs
on the local host in real tmux, the real CLI, a real SQLite store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dflashctl import contract
from dflashctl.errors import ConfigError
from dflashctl.recorded import reloaded, trainer_changes
from tests.test_small_cli import _cli, local_env  # noqa: F401  (the fixture)
from tests.test_supervisor import metrics_lines, wait_for


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


def _rewrite(path: Path, change) -> None:
    raw = yaml.safe_load(path.read_text())
    change(raw)
    path.write_text(yaml.safe_dump(raw))


def test_a_restart_after_a_playbook_change_says_so_and_reload_takes_it(local_env):
    """Defect: a restart after a playbook change silently reused the recorded config
    (a fix made in the playbook never reached the run), and nothing took it again."""
    env = local_env
    pb = env.playbook("edited", {"train": {"steps": 100000, "log_every": 2, "checkpoint_every": 4}})
    run_id = env.start(pb)
    source = Path(pb.source)
    try:
        wait_for(lambda: metrics_lines(env.run_dir(run_id)), 30, "metrics")
        _rewrite(source, lambda raw: raw["trainer"]["train"].update(steps=200000))
        again = _cli(env, "restart", run_id, "--no-watch")
        assert again.returncode == 0, again.stderr
        assert "changed since the launch (trainer.train.steps: 100000 -> 200000)" in again.stderr
        assert "reuses the config recorded at launch" in again.stderr and f"restart {run_id} --reload" in again.stderr
        on_host = json.loads(Path(env.run_dir(run_id), contract.CONFIG_FILE).read_text())
        assert on_host["train"]["steps"] == 100000

        _rewrite(source, lambda raw: raw["trainer"].setdefault("model", {}).update(drafter_layers=7))
        refused = _cli(env, "restart", run_id, "--no-watch", "--reload")
        assert refused.returncode == 2 and "trainer.model.drafter_layers" in refused.stderr, refused.stderr
        assert env.store.get_run(run_id).config["trainer"]["train"]["steps"] == 100000  # nothing taken
        assert env.store.get_run(run_id).state == "running"  # and nothing stopped

        _rewrite(source, lambda raw: raw["trainer"]["model"].pop("drafter_layers"))
        taken = _cli(env, "restart", run_id, "--no-watch", "--reload")
        assert taken.returncode == 0, taken.stderr
        assert "trainer.train.steps: 100000 -> 200000" in taken.stderr and "took" in taken.stderr
        assert env.store.get_run(run_id).config["trainer"]["train"]["steps"] == 200000
        on_host = json.loads(Path(env.run_dir(run_id), contract.CONFIG_FILE).read_text())
        assert on_host["train"]["steps"] == 200000  # the new process reads it
        [event] = env.store.events(run_id, kind="config")
        assert event.detail["changes"] == [{"key": "train.steps", "from": 100000, "to": 200000}]
    finally:
        env.tmux.kill(run_id)
