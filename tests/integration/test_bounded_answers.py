"""A host that floods every kind of answer costs the controller a bounded read.

The attacker controls one run host: what its commands print (the probe, `check`'s
facts, any command's stderr) and the files its runs write (trainer.log,
metrics.jsonl, eval.json). Each answer is read up to its kind's limit
(dflashctl/hosts/transport/limits.py); past it the command is ended and the error
says which host sent how much of what. The files are sparse (a line of 256 MiB
without a newline costs no disk), read through the local transport and the loopback
sshd harness; the memory a read costs is measured in a child process (VmHWM).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dflashctl.config import Host, Inventory
from dflashctl.core import contract
from dflashctl.core.errors import DflashError
from dflashctl.hosts.transport import LocalTransport, SSHTransport
from dflashctl.store import Store

REPO = Path(__file__).resolve().parents[2]
FLOOD = 256 << 20  # past every limit; finite, so code without the bound reads it whole and fails the checks
BIG_LINE = 256 << 20  # a sparse file of one line this long (no newline)
MEMORY_MIB = 48  # what one bounded read may add to a process's peak


def flooding_python(tmp_path: Path, stream: int = 1) -> str:
    """A host 'python' that answers every script with FLOOD bytes on ``stream``."""
    script = tmp_path / f"flood{stream}"
    script.write_text(f"#!/bin/sh\nhead -c {FLOOD} /dev/zero >&{stream}\n")
    script.chmod(0o755)
    return str(script)


def sparse(path: Path, size: int) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
    return path


@pytest.fixture
def ssh_direct(ssh_env):
    transports = []

    def make(**update) -> SSHTransport:
        t = SSHTransport(ssh_env.inventory.get("direct").model_copy(update=update), ssh_env.inventory)
        transports.append(t)
        return t

    yield make
    for t in transports:
        t.close()


def transports(tmp_path: Path, ssh_direct, **update):
    yield LocalTransport(Host(name="h1", transport="local", **update))
    yield ssh_direct(**update)


# --------------------------------------------------------------------------- commands


def test_a_flooded_probe_answer_is_refused_at_its_limit_naming_host_kind_and_size(tmp_path, ssh_direct):
    from dflashctl.runs.access import probe_run
    from dflashctl.store import Run

    run = Run(id="r1", playbook="pb", host="h1", state="running", created=0.0, run_dir=str(tmp_path))
    for t in transports(tmp_path, ssh_direct, python=flooding_python(tmp_path)):
        started = time.monotonic()
        with pytest.raises(DflashError) as caught:
            probe_run(t, run, timeout=60)
        said = str(caught.value)
        assert said.startswith(f"host {t.name} answered more than ") and "to the probe; at most" in said, said
        assert time.monotonic() - started < 30  # ended at the limit, not read to the end


def test_the_supervisor_says_a_flooded_probe_for_what_it_is_and_does_nothing_to_the_run(tmp_path, monkeypatch):
    from dflashctl.supervise.supervisor import Supervisor

    monkeypatch.setenv("DFLASHCTL_HOME", str(tmp_path / "home"))
    inventory = Inventory(hosts={"h1": Host(name="h1", transport="local", python=flooding_python(tmp_path))},
                          source="test")
    store = Store(str(tmp_path / "runs.db"))
    (tmp_path / "run").mkdir()
    store.create_run("pb", "h1", {}, time.time(), run_id="r1", run_dir=str(tmp_path / "run"), tmux_session="r1")
    store.transition("r1", "running", "started", time.time())
    restarts: list = []
    sup = Supervisor(store, inventory, interval=1.0, probe_timeout=30,
                     restart_fn=lambda *args, **kw: restarts.append(args))  # records: a restart is the finding here
    sup.attach("r1")
    try:
        for _ in range(3):
            report = sup.tick()
    finally:
        sup.close()
    assert report.hosts["h1"].startswith("host h1 answered more than 10 MiB to the probe; at most 10 MiB is read")
    [event] = [e for e in store.events("r1") if e.kind == "unreachable"]
    assert "answered more than 10 MiB to the probe" in event.message, event.message
    # As a host that does not answer: watched, lost after its polls, never restarted or stopped for it.
    assert restarts == [] and store.get_run("r1").state in ("running", "lost")


def test_check_facts_flooded_are_refused(tmp_path, ssh_direct):
    from dflashctl.hosts.facts import gather_facts

    for t in transports(tmp_path, ssh_direct, python=flooding_python(tmp_path)):
        with pytest.raises(DflashError, match=r"answered more than 4 MiB to `check` \(host facts\); at most 4 MiB"):
            gather_facts(t, timeout=60)


def test_stderr_of_any_command_is_bounded_too(tmp_path, ssh_direct):
    """A copy-back's stdout goes to the store's receiver; its stderr (and any other
    command's) is read up to its limit, then the command is ended."""
    for t in transports(tmp_path, ssh_direct):
        got: list[int] = []
        started = time.monotonic()
        with pytest.raises(DflashError) as caught:
            t.run(["sh", "-c", f"head -c {FLOOD} /dev/zero >&2; echo artifact"], timeout=60,
                  stdout_sink=lambda chunk: got.append(len(chunk)) is None)
        said = str(caught.value)
        assert f"host {t.name} wrote to stderr more than 1 MiB to a command; at most 1 MiB is read" in said, said
        assert time.monotonic() - started < 30


# --------------------------------------------------------------------------- files a run wrote


def _peak_of(code: str, tmp_path: Path) -> dict:
    """Run ``code`` (with ``store``, ``inventory``, ``run_id`` given) in a child
    process; its answer (the JSON it prints) and the peak RSS it added."""
    prelude = textwrap.dedent(f"""
        import json, sys
        def hwm():
            for line in open("/proc/self/status"):
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) // 1024
        from dflashctl.config import Host, Inventory
        from dflashctl.store import Store
        from dflashctl.runs import logs, evaluate
        inventory = Inventory(hosts={{"h1": Host(name="h1", transport="local")}}, source="test")
        store = Store({str(tmp_path / 'runs.db')!r})
        run_id = "r1"
        before = hwm()
    """)
    done = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def run_dir(tmp_path):
    directory = tmp_path / "run"
    directory.mkdir()
    Store(str(tmp_path / "runs.db")).create_run("pb", "h1", {}, time.time(), run_id="r1", run_dir=str(directory))
    return directory


def test_logs_n_1_reads_a_huge_last_line_from_its_end_only(tmp_path, run_dir):
    sparse(run_dir / contract.LOG_FILE, BIG_LINE)
    answer = _peak_of("""
        text = "".join(logs.logs(run_id, store, inventory, n=1))
        print(json.dumps({"chars": len(text), "head": text[:60], "added": hwm() - before}))
    """, tmp_path)
    assert answer["chars"] <= (4 << 20) + 100 and answer["head"].startswith("[cut: a line longer than 4 MiB"), answer
    assert answer["added"] < MEMORY_MIB, answer


def test_advise_reads_the_metrics_tail_from_the_end_only(tmp_path, run_dir):
    line = contract.Metrics(time=time.time(), step=7, total_steps=100, tok_s=10.0).to_line()
    path = sparse(run_dir / contract.METRICS_FILE, BIG_LINE)
    with open(path, "a") as f:
        f.write("\n" + line + "\n")
    answer = _peak_of("""
        rows = logs.metrics_tail(run_id, store, inventory, n=5)
        print(json.dumps({"steps": [r.step for r in rows], "added": hwm() - before}))
    """, tmp_path)
    assert answer["steps"] == [7] and answer["added"] < MEMORY_MIB, answer


def test_a_huge_eval_report_is_refused_by_its_size_without_reading_it(tmp_path, run_dir):
    sparse(run_dir / "eval-20270101-000000-abcdef.json", BIG_LINE)
    answer = _peak_of("""
        from dflashctl.hosts.transport import connect
        run = store.get_run(run_id)
        try:
            evaluate._read_eval(connect("h1", inventory), run, "20270101-000000-abcdef")
            said = None
        except Exception as e:
            said = str(e)
        print(json.dumps({"said": said, "added": hwm() - before}))
    """, tmp_path)
    assert answer["said"] and "eval-20270101-000000-abcdef.json on h1 is 256 MiB; at most 4 MiB of an evaluation " \
        "report is read" in \
        answer["said"], answer
    assert answer["added"] < MEMORY_MIB, answer


def test_following_a_log_reads_a_bounded_window_per_look(tmp_path, run_dir):
    """What follows an offset is read a window at a time: a log that grew by a huge
    line arrives in pieces, never at once."""
    from dflashctl.runs.logs import LOG_WINDOW_BYTES, logs

    log = run_dir / contract.LOG_FILE
    log.write_text("first\n")
    inventory = Inventory(hosts={"h1": Host(name="h1", transport="local")}, source="test")
    store = Store(str(tmp_path / "runs.db"))
    with open(log, "ab") as f:
        f.write(b"x" * (LOG_WINDOW_BYTES + 10) + b"\nlast\n")
    (run_dir / contract.EXIT_CODE_FILE).write_text("0\n")
    pieces = list(logs("r1", store, inventory, follow=True, since=6, poll=0.01))
    assert len(pieces) == 2 and all(len(p) <= LOG_WINDOW_BYTES for p in pieces)
    assert "".join(pieces).endswith("\nlast\n") and os.path.getsize(log) == 6 + sum(map(len, pieces))
