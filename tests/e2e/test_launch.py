"""Launching real tiny trainer runs: through jump -> container over real sshd, and
on the local host through the command line (a process); logs, stop, relaunch, an
exit read from its exit code file, a changed package set reported. (Launches with
the fake trainer or none: tests/integration/test_launch.py.)

Every tmux server here is on a socket private to this test process
(DFLASHCTL_TMUX_SOCKET), never a user's `dflash` one, and is killed by pid at the end."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from dflashctl.config import load_inventory, load_playbook
from dflashctl.core import contract
from dflashctl.hosts.bundle import build_bundle
from dflashctl.hosts.tmux import Tmux
from dflashctl.hosts.transport import connect
from dflashctl.launch import launch_run, start_supervisor
from dflashctl.runs.runhost import (
    logs,
    probe_run,
    stop,
)
from dflashctl.store import Store
from tests import harness
from tests.harness import cli
from tests.harness.launch import RUN_SOCKET, tiny_playbook, uses_tmux

pytestmark = pytest.mark.usefixtures("private_tmux_socket_and_home")

FIXTURES = harness.FIXTURES / "nvidia-smi"


@pytest.mark.slow
def test_launch_through_jump_into_container_then_logs_stop_and_relaunch(ssh_env, tmp_path):
    inventory = ssh_env.inventory
    uses_tmux("target", inventory)
    store = Store(str(tmp_path / "runs.db"))
    pb = tiny_playbook(tmp_path, inventory, "target")
    seen: list[tuple[str, str]] = []

    bundle = build_bundle()  # once: the checkout may change between the two launches
    result = launch_run(pb, inventory, store, progress=lambda step, msg: seen.append((step, msg)), bundle=bundle)
    assert result.state == "running", seen
    steps = [s for s, _ in seen]
    assert list(dict.fromkeys(steps)) == [
        "preflight", "inputs", "bundle", "connect", "gpus", "deploy", "record", "configure", "start", "wait"]
    assert any("jump -> target [pct exec 200 --]" in m for s, m in seen if s == "connect")

    run = store.get_run(result.run_id)
    workdir = ssh_env.workdir("target")
    assert run.run_dir == str(workdir / "runs" / run.id)
    assert run.tmux_session == run.id and run.tmux_socket == RUN_SOCKET
    # The session lives on the target's tmux server (inside the container), not here.
    assert _has_session_on_host_socket(ssh_env, "target", run.id)
    assert not Tmux(inventory.get("local"), inventory, RUN_SOCKET).has_session(run.id)

    # config.json and run.sh as the trainer sees them.
    config = json.loads((workdir / "runs" / run.id / "config.json").read_text())
    assert config["run_dir"] == run.run_dir and config["train"]["steps"] == 5000
    assert config["compile"]["cache_dir"] == "~/.cache/dflashctl-test/compile"
    script = (workdir / "runs" / run.id / "run.sh").read_text()
    assert f"export PYTHONPATH={workdir}/bundles/{run.bundle_hash}" in script
    assert 'export TORCHINDUCTOR_CACHE_DIR="$HOME"/.cache/dflashctl-test/compile' in script
    assert "CUDA_VISIBLE_DEVICES" not in script  # a CPU run owns no GPU
    assert (ssh_env.home("target") / ".cache" / "dflashctl-test" / "compile").is_dir()

    transport = connect("target", inventory)
    probe = _wait_metrics(transport, run)
    assert probe.status.phase in ("compiling", "training")
    assert contract.parse_metrics_line(probe.metrics_chunk.splitlines()[0]).total_steps == 5000

    text = "".join(logs(run.id, store, inventory, n=200))
    assert "step 2/5000" in text

    stopped = stop(run.id, store, inventory, timeout=90)
    assert (stopped.state, stopped.exit_code, stopped.exit_reason) == ("stopped", 4, "stopped on request")
    assert (workdir / "runs" / run.id / contract.EXIT_CODE_FILE).read_text().strip() == "4"
    assert [p.name for p in (workdir / "runs" / run.id / "checkpoints").iterdir() if p.name.startswith("step-")]
    assert not _has_session_on_host_socket(ssh_env, "target", run.id)
    kinds = [(e.kind, e.detail.get("to") if e.detail else None) for e in store.events(run.id)]
    assert kinds[0] == ("state", "launching") and ("stop_requested", None) in kinds and kinds[-1] == ("state", "stopped")
    assert "checkpoint saved" in "".join(logs(run.id, store, inventory, n=5))

    # The same bundle again: one check round trip, nothing sent.
    again = launch_run(pb, inventory, store, start_timeout=60, bundle=bundle)
    assert (again.deploy["status"], again.deploy["bytes_sent"]) == ("unchanged", 0)
    assert again.deploy["bundle_hash"] == run.bundle_hash
    assert stop(again.run_id, store, inventory, timeout=90).state == "stopped"
    assert [r.state for r in store.list_runs(playbook="tiny")] == ["stopped", "stopped"]


@pytest.mark.slow
def test_launch_demo_on_the_local_host_with_the_cli(tmp_path):
    """The embedded defaults: `dflashctl launch demo` from an empty directory."""
    os.environ["DFLASHCTL_STORE"] = str(tmp_path / "runs.db")
    inventory = load_inventory(None)
    uses_tmux("local", inventory)
    try:
        launched = _cli(["launch", "demo", "--no-watch"], cwd=tmp_path)
        assert launched.returncode == 0, launched.stderr
        run_id = launched.stdout.strip().splitlines()[-1]
        assert run_id.startswith("demo-") and "trainer running" in launched.stderr

        listed = _cli(["runs", "--json"], cwd=tmp_path)
        (row,) = json.loads(listed.stdout)
        assert (row["id"], row["state"], row["host"]) == (run_id, "running", "local")
        assert run_id[:20] in _cli(["runs"], cwd=tmp_path).stdout

        store = Store(os.environ["DFLASHCTL_STORE"])
        _wait_metrics(connect("local", inventory), store.get_run(run_id), lines=1)
        total = load_playbook("demo").trainer.train.steps
        assert f"step 10/{total}" in _cli(["logs", run_id, "-n", "50"], cwd=tmp_path).stdout

        stopped = _cli(["stop", run_id, "--timeout", "90"], cwd=tmp_path)
        assert stopped.returncode == 0 and stopped.stdout.split() == [run_id, "stopped"], stopped.stderr

        # Restart with serialized warm-up: same run directory, resumed from the checkpoint.
        restarted = _cli(["restart", run_id[:-2], "--serialized-warmup"], cwd=tmp_path)
        assert restarted.returncode == 0 and restarted.stdout.strip() == "running", restarted.stderr
        run = store.get_run(run_id)
        assert run.state == "running" and run.ended is None
        assert run.supervisor["kind"] == "tmux" and "supervisor running" in restarted.stderr  # watched again
        config = json.loads((Path(run.run_dir) / "config.json").read_text())
        assert config["compile"]["serialized_warmup"] is True
        deadline = time.monotonic() + 90
        while "resumed from" not in (Path(run.run_dir) / contract.LOG_FILE).read_text():
            assert time.monotonic() < deadline, "the restarted trainer did not resume"
            time.sleep(0.5)
        # The resumed demo has few steps left: on a slow machine it may finish them
        # before the stop comes, and a finished run is said to be done, not stopped.
        answer = _cli(["stop", run_id], cwd=tmp_path).stdout.split()
        assert answer in ([run_id, "stopped"], [run_id, "done"]), answer

        events = json.loads(_cli(["events", run_id, "--json"], cwd=tmp_path).stdout)
        states = [e["detail"]["to"] for e in events if e["kind"] == "state"]
        assert states == ["launching", "running", "stopped", "restarting", "running", answer[1]]
    finally:
        os.environ.pop("DFLASHCTL_STORE")


def _wait_metrics(transport, run, lines=2, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        probe = probe_run(transport, run)
        if probe.metrics_chunk.count("\n") >= lines:
            return probe
        assert probe.exit_code is None, f"trainer exited {probe.exit_code}:\n{probe.log_tail}"
        time.sleep(0.5)
    raise AssertionError(f"fewer than {lines} metrics lines after {timeout}s")


def _has_session_on_host_socket(ssh_env, host: str, session: str) -> bool:
    """Ask the host's own tmux socket directory (each test host has its own)."""
    env = {**os.environ, "TMUX_TMPDIR": str(ssh_env.host_dir(host) / "tmux"), "LANG": "C.UTF-8"}
    return subprocess.run(["tmux", "-L", RUN_SOCKET, "has-session", "-t", f"={session}"], env=env,
                          capture_output=True).returncode == 0


def _cli(args, cwd, timeout=180):
    """`dflashctl ARGS` as a process, as a user types it in ``cwd``."""
    return cli.run(*args, cwd=cwd, timeout=timeout, env={"DFLASHCTL_INVENTORY": None, "DFLASHCTL_PLAYBOOKS": None})


@pytest.mark.slow
def test_a_trainer_exit_is_read_from_its_exit_code_file(tmp_path):
    """run.sh writes the trainer's exit status even when it crashes; the foreground
    follower stores the metrics it saw and records how the run ended."""
    inventory = load_inventory(None)
    uses_tmux("local", inventory)
    store = Store(str(tmp_path / "runs.db"))
    pb = tiny_playbook(tmp_path, inventory, "local", name="faulty",
                   train={"steps": 100, "log_every": 1, "checkpoint_every": 1000},
                   fault={"kind": "exit", "after_steps": 3, "exit_code": 3, "message": "shard 7 is corrupt"})
    result = launch_run(pb, inventory, store)
    lines: list[str] = []
    final = result.state
    if final == "running":
        final = start_supervisor(result.run_id, True, store, inventory, emit=lines.append,
                                 playbooks_dir=str(tmp_path / "playbooks"))
    run = store.get_run(result.run_id)
    assert (final, run.state, run.exit_code) == ("failed", "failed", 3)
    # Classified, the trainer's own words (numbers kept), and not restarted.
    assert run.exit_reason.startswith("data_error: ") and "shard 7 is corrupt" in run.exit_reason
    assert "; not restarting: " in run.exit_reason
    assert (Path(run.run_dir) / contract.EXIT_CODE_FILE).read_text().strip() == "3"
    assert "shard 7 is corrupt" in "".join(logs(run.id, store, inventory, n=20))
    # Every metrics line the trainer wrote before it failed was stored, whenever the follow began.
    assert [s.step for s in store.samples(run.id)] == [1, 2, 3]
    assert any("data_error" in line or "data error" in line for line in lines), lines
