"""A launch checks its inputs on the run host before anything is deployed: the
data shards (present, readable, a valid first line), the model directory (with a
config.json) and the free disk, in one read-only round trip of the host-side facts
script (dflashctl/hosts/remote/facts.py) through the real local transport. A playbook
that cannot launch is refused with nothing on the host or in the store, and its
dry run exits non-zero."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dflashctl.config import load_inventory, load_playbook
from dflashctl.hosts.facts import check_inputs, input_problems
from dflashctl.hosts.transport import connect
from dflashctl.launch import launch_run
from dflashctl.runs.runhost import LaunchError
from dflashctl.store import Store
from tests import harness
from tests.harness import cli

REPO = harness.REPO
GOOD_LINE = json.dumps({"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]})


@pytest.fixture
def env(tmp_path):
    workdir = tmp_path / "work"
    inventory_path = tmp_path / "inventory.yaml"
    inventory_path.write_text(yaml.safe_dump({"hosts": {"local": {"transport": "local", "workdir": str(workdir)}}}))
    return tmp_path, workdir, inventory_path


def _playbook(tmp_path: Path, inventory_path: Path, **data) -> Path:
    raw = {"host": "local", "trainer": {
        "model": {"preset": "tiny"},
        "data": {"buckets": [256], "batch_size": 1, "max_anchors": 16, **data},
        "train": {"steps": 10, "log_every": 2, "checkpoint_every": 1000},
        "placement": {"device": "cpu", "target": [0], "drafter": [0]}}}
    path = tmp_path / "playbooks" / "inputs.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(yaml.safe_dump(raw))
    return path


def _cli(args, tmp_path, inventory_path):
    """The command in this process (tests/harness/cli.py)."""
    return cli.invoke("-i", str(inventory_path), *args, cwd=REPO, env={"DFLASHCTL_STORE": str(tmp_path / "runs.db")},
                      columns=200)


def test_a_missing_shard_directory_is_refused_before_any_upload(env):
    """Defect: a missing `data.shards` directory was found by the trainer 40 s after
    the start (after torch's import), and the printed fix was a restart, which
    reuses the recorded config."""
    tmp_path, workdir, inventory_path = env
    missing = tmp_path / "no-such-shards"
    path = _playbook(tmp_path, inventory_path, shards=str(missing))
    inventory = load_inventory(str(inventory_path))
    store = Store(str(tmp_path / "runs.db"))
    said: list[str] = []
    with pytest.raises(LaunchError) as caught:
        launch_run(load_playbook(str(path), inventory=inventory), inventory, store,
                   progress=lambda step, text: said.append(f"{step} {text}"))
    assert f"data.shards '{missing}' on local does not exist" in str(caught.value)
    assert "nothing was deployed" in str(caught.value)
    assert "then launch again" in caught.value.hint and "restart` would reuse the config" in caught.value.hint
    assert str(path) in caught.value.hint  # the file to change
    # Nothing deployed, recorded or started: no bundle, no run directory, no run.
    assert not (workdir / "bundles").exists() and not (workdir / "runs").exists()
    assert store.list_runs() == [] and not any(s.startswith("deploy") for s in said)

    dry = _cli(["launch", str(path), "--dry-run"], tmp_path, inventory_path)
    assert dry.returncode == 1, dry.stderr
    assert "a launch would stop here: 1 error(s)" in dry.stderr and "exit 1" in dry.stderr
    assert not (workdir / "bundles").exists() and store.list_runs() == []


def test_shards_model_and_disk_are_read_where_the_trainer_reads_them(env):
    tmp_path, workdir, inventory_path = env
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "shard-00000.jsonl").write_text("\n" + GOOD_LINE + "\n")
    (shards / "shard-00001.jsonl").write_text(GOOD_LINE + "\n")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 1024, "intermediate_size": 3072,
                                                    "vocab_size": 151936}))
    inventory = load_inventory(str(inventory_path))
    transport = connect("local", inventory)
    trainer = {"data": {"shards": str(shards)}, "model": {"path": str(model), "drafter_layers": 5},
               "train": {"keep_checkpoints": 3}}
    found = check_inputs(transport, trainer, str(workdir))
    assert found.shards["count"] == 2 and found.shards["first_error"] is None  # a blank first line is skipped
    assert found.model["config"] and found.model["hidden_size"] == 1024 and found.disk_free > 0
    assert not workdir.exists()  # read only: the workdir is not created by the check
    # 4 checkpoints of a 5-layer drafter on a 1024-wide target: ~4.6 GB
    expected = [] if found.disk_free > 5 << 30 else ["disk-full"]
    assert [p.code for p in input_problems(found, trainer, "local", "p.yaml")] == expected

    (shards / "shard-00000.jsonl").write_text('{"input_ids": [1, 2], "loss_mask": [1]}\n')
    (model / "config.json").unlink()
    found = check_inputs(transport, {**trainer, "data": {"shards": str(shards / "shard-*.jsonl")}}, str(workdir))
    codes = {p.code: p for p in input_problems(found, trainer, "local", "p.yaml")}
    assert "'input_ids' has 2 tokens but 'loss_mask' has 1" in codes["shard-unreadable"].message
    assert "shard-00000.jsonl" in codes["shard-unreadable"].message and "model-config" in codes

    empty = tmp_path / "empty"
    empty.mkdir()
    found = check_inputs(transport, {"data": {"shards": str(empty)}, "model": {"path": str(tmp_path / "gone")}},
                         str(workdir))
    codes = [p.code for p in input_problems(found, {}, "local", "p.yaml")]
    assert codes[:2] == ["shards-empty", "model-missing"]




@pytest.mark.parametrize("field,value,said", [
    ("model", {"preset": "tiny-cycel"}, "model.preset: unknown preset 'tiny-cycel' (did you mean 'tiny-cycle'?)"),
    ("model", {"preset": "tiny", "num_target_layers": 7}, "model.num_target_layers: 7 distinct layers do not fit"),
    ("compile", {"enabled": "on"}, "compile.enabled: 'on' needs a GPU"),
])
def test_a_value_typo_in_the_trainer_section_is_refused_before_deploy(env, field, value, said):
    """Defect: `model.preset: tiny-cycel` was deployed, recorded and started; the
    trainer failed 35 s later (on a GPU host, after its import and maybe a model
    load). The trainer's own schema, values included, now checks the playbook where
    it is loaded: the launch exits 2 (bad input) naming the key and its fix, with
    nothing recorded and nothing on the host."""
    tmp_path, workdir, inventory_path = env
    path = _playbook(tmp_path, inventory_path)
    raw = yaml.safe_load(path.read_text())
    raw["trainer"][field] = value
    path.write_text(yaml.safe_dump(raw))
    out = _cli(["launch", str(path)], tmp_path, inventory_path)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert said in " ".join(out.stderr.split()) and str(path) in out.stderr
    assert not workdir.exists()  # nothing on the host: no bundle, no run directory
    assert Store(str(tmp_path / "runs.db")).list_runs() == []  # nothing recorded
