"""Launching real tiny trainer runs: through jump -> container over real sshd, and on
the local host through the CLI; stop, restart, logs, GPU refusals, dry run.

Every tmux server here is on a socket private to this test process
(DFLASHCTL_TMUX_SOCKET), never a user's `dflash` one, and is killed by pid at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dflashctl.config import load_inventory, load_playbook
from dflashctl.core import contract
from dflashctl.hosts.bundle import build_bundle
from dflashctl.hosts.parsers import parse_compute_apps, parse_gpu_query
from dflashctl.hosts.probe import HostProbe
from dflashctl.hosts.tmux import SOCKET_ENV, Tmux
from dflashctl.hosts.transport import connect
from dflashctl.launch import busy_gpus, launch_run, start_supervisor, wanted_gpus
from dflashctl.runs.runhost import (
    LaunchError,
    logs,
    probe_run,
    render_run_script,
    renumber_placement,
    restart_run,
    run_environment,
    stop,
)
from dflashctl.store import GpuConflict, Store
from tests.harness import environ
from tests.harness.fake_trainer import start_fake_run

FIXTURES = Path(__file__).parent / "fixtures" / "nvidia-smi"
SOCKET = f"dflash-test-{os.getpid()}"
_servers: list[tuple] = []  # (host, inventory) whose tmux server on SOCKET this module may have started


@pytest.fixture(scope="module", autouse=True)
def private_tmux_socket_and_home(tmp_path_factory):
    """A tmux socket of our own, and a $HOME of our own for the local host's runs (the
    trainer's compile cache under ~/.cache must not land in the user's home)."""
    with environ(**{SOCKET_ENV: SOCKET, "HOME": str(tmp_path_factory.mktemp("home"))}):
        yield
        for host, inventory in _servers:
            try:
                pid = Tmux(host, inventory, SOCKET).server_pid()
            except Exception:  # noqa: BLE001  (the host may already be gone)
                continue
            if pid:  # the test hosts are this machine: the pid is ours to end
                os.kill(pid, signal.SIGTERM)
        # A server ended by a signal leaves its socket file behind.
        local_socket = Path(os.environ.get("TMUX_TMPDIR") or "/tmp") / f"tmux-{os.getuid()}" / SOCKET
        local_socket.unlink(missing_ok=True)


def _uses_tmux(host_name: str, inventory) -> None:
    _servers.append((inventory.get(host_name), inventory))


def _playbook(tmp_path, inventory, host, name="tiny", **trainer):
    raw = {
        "host": host,
        "trainer": {
            "model": {"preset": "tiny"},
            "data": {"buckets": [256], "batch_size": 1, "max_anchors": 16},
            "train": {"steps": 5000, "log_every": 2, "checkpoint_every": 1000},
            "placement": {"device": "cpu", "target": [0], "drafter": [0]},
            **trainer,
        },
        "compile_cache": "~/.cache/dflashctl-test/compile",
    }
    path = tmp_path / "playbooks" / f"{name}.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(yaml.safe_dump(raw))
    return load_playbook(str(path), inventory=inventory)


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
    return subprocess.run(["tmux", "-L", SOCKET, "has-session", "-t", f"={session}"], env=env,
                          capture_output=True).returncode == 0


# --------------------------------------------------------------------------- end to end, through jump -> container


@pytest.mark.slow
def test_launch_through_jump_into_container_then_logs_stop_and_relaunch(ssh_env, tmp_path):
    inventory = ssh_env.inventory
    _uses_tmux("target", inventory)
    store = Store(str(tmp_path / "runs.db"))
    pb = _playbook(tmp_path, inventory, "target")
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
    assert run.tmux_session == run.id and run.tmux_socket == SOCKET
    # The session lives on the target's tmux server (inside the container), not here.
    assert _has_session_on_host_socket(ssh_env, "target", run.id)
    assert not Tmux(inventory.get("local"), inventory, SOCKET).has_session(run.id)

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


# --------------------------------------------------------------------------- GPU refusals


def test_busy_gpu_on_the_host_is_refused_unless_forced(ssh_env, tmp_path):
    inventory = ssh_env.inventory
    store = Store(str(tmp_path / "runs.db"))
    pb = _playbook(tmp_path, inventory, "target", placement={"device": "cuda", "target": [0], "drafter": [0]})
    ssh_env.set_smi_mode("target", "load")
    try:
        with pytest.raises(LaunchError, match="GPU 0: compute processes: pid 416 python3 1002 MiB") as e:
            launch_run(pb, inventory, store)
        assert "--force" in e.value.hint
    finally:
        ssh_env.set_smi_mode("target", "idle")
    assert store.list_runs() == []  # nothing recorded, nothing started


def test_gpu_held_by_an_active_run_is_refused(ssh_env, tmp_path):
    inventory = ssh_env.inventory
    store = Store(str(tmp_path / "runs.db"))
    holder = store.create_run("other", "target", {"gpus": [0]}, time.time())
    pb = _playbook(tmp_path, inventory, "target", placement={"device": "cuda", "target": [0], "drafter": [0]})
    with pytest.raises(GpuConflict, match=f"GPU 0 by run {holder.id}"):
        launch_run(pb, inventory, store)
    assert [r.id for r in store.list_runs()] == [holder.id]


def _probe_from_fixtures(mode: str) -> HostProbe:
    gpus = parse_gpu_query((FIXTURES / f"h200-{mode}-query.csv").read_text())
    apps = parse_compute_apps((FIXTURES / f"h200-{mode}-apps.csv").read_text())
    return HostProbe(host_time=0.0, hostname="h", python="3.12", elapsed=0.1, gpus=gpus, compute_apps=apps,
                     errors=[], runs=[])


@pytest.mark.parametrize(
    "mode, wanted, expected",
    [
        ("idle", [0], {}),
        ("load", [0], {0: "compute processes: pid 416 python3 1002 MiB"}),
        ("idle", [0, 3], {3: "not present (nvidia-smi shows 1 GPU(s))"}),
    ],
)
def test_busy_gpus_from_real_captures(mode, wanted, expected):
    assert busy_gpus(_probe_from_fixtures(mode), wanted) == expected


def test_memory_in_use_without_processes_is_busy():
    probe = _probe_from_fixtures("load")
    probe.compute_apps = []  # processes of another container are invisible here
    assert busy_gpus(probe, [0]) == {0: "1011 MiB in use"}


# --------------------------------------------------------------------------- run.sh and placement


def test_run_environment_and_script(tmp_path):
    inventory = load_inventory(None)
    host = inventory.get("local").model_copy(update={"env": {"HOST_VAR": "h", "OMP_NUM_THREADS": "8"}})
    env = run_environment(host, {"OMP_NUM_THREADS": "2", "PYTHONPATH": "/extra"}, "/w/bundles/abc", [4, 6])
    assert env["OMP_NUM_THREADS"] == "2" and env["HOST_VAR"] == "h"  # the playbook wins over the host
    assert env["PYTHONPATH"] == "/w/bundles/abc:/extra"
    assert env["CUDA_VISIBLE_DEVICES"] == "4,6" and env["LANG"] == "C.UTF-8" and env["PYTHONUNBUFFERED"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in run_environment(host, {}, "/b", [])
    assert run_environment(host, {"CUDA_VISIBLE_DEVICES": "1"}, "/b", [4])["CUDA_VISIBLE_DEVICES"] == "1"

    trainer = {"placement": {"device": "cuda", "target": [4, 6], "drafter": [6]}}
    assert wanted_gpus(trainer) == [4, 6]
    assert renumber_placement(trainer, [4, 6])["placement"] == {"device": "cuda", "target": [0, 1], "drafter": [1]}
    assert wanted_gpus({"placement": {"device": "cpu", "target": [0], "drafter": [1]}}) == []

    # The host's python is a command line (like the probe's): words, so options may follow.
    script = render_run_script("r1", "/runs/it's here", "/opt/venv/bin/python -X faulthandler", {"A": "x y"},
                               "~/cache dir", "r1", "dflash")
    assert "cd '/runs/it'\"'\"'s here' || exit 1" in script
    assert "export A='x y'" in script
    assert "export TORCHINDUCTOR_CACHE_DIR=\"$HOME\"/'cache dir'" in script
    assert "/opt/venv/bin/python -X faulthandler -m trainer" in script
    assert "-m trainer --config config.json --run-dir '/runs/it'\"'\"'s here' --resume auto" in script
    assert subprocess.run(["sh", "-n"], input=script, text=True).returncode == 0  # valid shell


# --------------------------------------------------------------------------- local host


def _cli(args, cwd, timeout=180):
    env = {k: v for k, v in os.environ.items() if k not in ("DFLASHCTL_INVENTORY", "DFLASHCTL_PLAYBOOKS")}
    return subprocess.run([sys.executable, "-m", "dflashctl", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_dry_run_prints_every_step_and_changes_nothing(tmp_path):
    env_store = tmp_path / "dry.db"
    os.environ["DFLASHCTL_STORE"] = str(env_store)
    try:
        out = _cli(["launch", "demo", "--dry-run"], cwd=tmp_path)
    finally:
        os.environ.pop("DFLASHCTL_STORE")
    assert out.returncode == 0, out.stderr
    text = out.stderr
    for needle in ("would record run demo-", "would run on local: sh -c", "dflashctl-check", "dflashctl-deploy",
                   "bytes on stdin", "run.sh:", "-m trainer --config config.json", "would start tmux session demo-"):
        assert needle in text
    assert not env_store.exists()
    assert not Tmux(load_inventory(None).get("local"), load_inventory(None), SOCKET).sessions()


@pytest.mark.slow
def test_launch_demo_on_the_local_host_with_the_cli(tmp_path):
    """The embedded defaults: `dflashctl launch demo` from an empty directory."""
    os.environ["DFLASHCTL_STORE"] = str(tmp_path / "runs.db")
    inventory = load_inventory(None)
    _uses_tmux("local", inventory)
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
        assert _cli(["stop", run_id], cwd=tmp_path).stdout.split() == [run_id, "stopped"]

        events = json.loads(_cli(["events", run_id, "--json"], cwd=tmp_path).stdout)
        states = [e["detail"]["to"] for e in events if e["kind"] == "state"]
        assert states == ["launching", "running", "stopped", "restarting", "running", "stopped"]
    finally:
        os.environ.pop("DFLASHCTL_STORE")


@pytest.mark.slow
def test_a_trainer_exit_is_read_from_its_exit_code_file(tmp_path):
    """run.sh writes the trainer's exit status even when it crashes; the foreground
    follower stores the metrics it saw and records how the run ended."""
    inventory = load_inventory(None)
    _uses_tmux("local", inventory)
    store = Store(str(tmp_path / "runs.db"))
    pb = _playbook(tmp_path, inventory, "local", name="faulty",
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
    assert run.exit_reason.startswith("data_error: not restarting")  # classified, and not restarted
    assert (Path(run.run_dir) / contract.EXIT_CODE_FILE).read_text().strip() == "3"
    assert "shard 7 is corrupt" in "".join(logs(run.id, store, inventory, n=20))
    # Every metrics line the trainer wrote before it failed was stored, whenever the follow began.
    assert [s.step for s in store.samples(run.id)] == [1, 2, 3]
    assert any("data_error" in line or "data error" in line for line in lines), lines


@pytest.mark.slow
def test_a_changed_package_set_since_the_last_good_run_is_reported(tmp_path):
    inventory = load_inventory(None)
    _uses_tmux("local", inventory)
    store = Store(str(tmp_path / "runs.db"))
    pb = _playbook(tmp_path, inventory, "local", name="drift", train={"steps": 5000, "log_every": 2})
    first = launch_run(pb, inventory, store)
    # A good run is one that trained for `healthy_after`: its samples say so.
    begin = time.time()
    store.add_samples(first.run_id, [{"time": begin, "step": 1, "phase": "training"},
                                     {"time": begin + pb.restart.healthy_after, "step": 2, "phase": "training"}])
    stop(first.run_id, store, inventory)
    # The package set the first launch recorded, as if the host had then had one more
    # package and an older torch (what an `apt`/`pip` "clean-up" between runs leaves).
    recorded = store.env_snapshots("local", limit=1)[0]
    then = dict(recorded["data"], **{"flashinfer-python": "0.2.5", "torch": "2.12.0"})
    store.db.execute("UPDATE env_snapshots SET data = ? WHERE id = ?", [json.dumps(then), recorded["id"]])
    store.db.conn.commit()

    said: list[str] = []
    second = launch_run(pb, inventory, store, progress=lambda step, message: said.append(message))
    try:
        (drift,) = [e for e in store.events(second.run_id) if e.kind == "drift"]
        assert drift.severity == "warning"
        assert "removed flashinfer-python 0.2.5" in drift.message and "torch 2.12.0 -> " in drift.message
        assert any("environment changed since the last good run" in m for m in said)
        assert not [e for e in store.events(first.run_id) if e.kind == "drift"]
    finally:
        stop(second.run_id, store, inventory)


def test_a_restart_the_store_cannot_record_still_counts_as_issued(tmp_path):
    """The new trainer is started; then the store refuses the restart's event (a full
    disk): restart_run still returns, saying so, so the supervisor never issues the
    same restart twice."""
    inventory = load_inventory(None)
    _uses_tmux("local", inventory)
    store = Store(str(tmp_path / "runs.db"))
    pb = _playbook(tmp_path, inventory, "local", name="unrecorded")
    run_id = start_fake_run(store, inventory, "local", pb.trainer.to_dict(), playbook=pb.name, socket=SOCKET)
    run = store.get_run(run_id)
    status_path = Path(run.run_dir) / contract.STATUS_FILE

    def trainer_pid(other_than=None):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status = contract.parse_status(status_path.read_text()) if status_path.exists() else None
            if status and status.pid and status.pid != other_than:
                return status.pid
            time.sleep(0.1)
        raise AssertionError("no trainer pid in status.json")

    first = trainer_pid()
    # A real SQLite error on exactly that write, as a full disk gives it.
    store.db.execute("CREATE TRIGGER refuse_restart_event BEFORE INSERT ON events WHEN NEW.kind = 'process' "
                     "BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END")
    store.db.conn.commit()
    said: list[str] = []
    try:
        result = restart_run(run_id, False, store, inventory, progress=lambda step, message: said.append(message))
        assert result.session == run_id and result.bundle_hash == run.bundle_hash
        assert any("not recorded in the run store: database or disk is full" in m for m in said), said
        assert trainer_pid(other_than=first) != first  # the new trainer runs
        assert Tmux(inventory.get("local"), inventory, SOCKET).has_session(run_id)
        assert not store.events(run_id, kind="process")
    finally:
        Tmux(inventory.get("local"), inventory, SOCKET).kill(run_id)
