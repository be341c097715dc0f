"""The host-side scripts in dflashctl/hosts/remote/, run for real as a host runs them (this
python, and a Python 3.8 when the machine has one), against real run directories,
hostile ones included; and the controller's reading of the probe's answer, which
must take any text at all (hypothesis property tests)."""

from __future__ import annotations

import ast
import glob
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import dflashctl.hosts.remote
from dflashctl.core import contract
from dflashctl.hosts import facts, probe
from dflashctl.hosts.probe import parse_probe_output

REMOTE = Path(dflashctl.hosts.remote.__file__).parent
SCRIPTS = sorted(p for p in REMOTE.glob("*.py") if p.name != "__init__.py")


def _python38() -> str | None:
    """A Python 3.8 interpreter on this machine, if any: the oldest a host may have."""
    candidates = [shutil.which("python3.8"), *sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.8*/bin/python3.8")))]
    for candidate in candidates:
        if candidate and subprocess.run([candidate, "-c", "import sys; assert sys.version_info[:2] == (3, 8)"],
                                        capture_output=True, timeout=30).returncode == 0:  # fmt: skip
            return candidate
    return None


PY38 = _python38()
PYTHONS = [
    pytest.param(sys.executable, id="this-python"),
    pytest.param(PY38, id="python3.8", marks=pytest.mark.skipif(PY38 is None, reason="no Python 3.8 here")),
]


def run_script(name: str, argument, python: str = sys.executable, how: str = "file", path: str | None = None) -> dict:
    """Run dflashctl/hosts/remote/NAME.py with one JSON argument, as a file or as the
    controller ships it (``-I -S -c TEXT``); its one JSON line, parsed."""
    script = REMOTE / f"{name}.py"
    arg = argument if isinstance(argument, str) else json.dumps(argument)
    argv = [python, str(script), arg] if how == "file" else [python, "-I", "-S", "-c", script.read_text(), arg]
    env = dict(os.environ, PATH=path or os.path.dirname(shutil.which("tmux") or "/usr/bin/tmux"))
    p = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == 1, p.stdout
    return json.loads(lines[0])


def probe_run(spec: dict, **kwargs) -> dict:
    answer = run_script("probe", [{"nvidia_smi": False, **spec}], **kwargs)
    assert answer["probe"] == probe.PROBE_VERSION and answer["errors"] == []
    [run] = answer["runs"]
    return run


def make_run(run_dir: Path, *, exit_code: str | None = "137\n") -> list[str]:
    """A run directory as a trainer leaves it: status.json, 3 metrics lines, a 500-line log."""
    run_dir.mkdir(parents=True, exist_ok=True)
    contract.write_status(str(run_dir), contract.Status(phase=contract.PHASE_FAILED, pid=None, step=3))
    lines = [contract.Metrics(time=1000.0 + s, step=s, total_steps=100).to_line() + "\n" for s in (1, 2, 3)]
    (run_dir / contract.METRICS_FILE).write_text("".join(lines))
    (run_dir / contract.LOG_FILE).write_text("".join(f"log line {i}\n" for i in range(500)))
    if exit_code is not None:
        (run_dir / contract.EXIT_CODE_FILE).write_text(exit_code)
    return lines


# --------------------------------------------------------------------------- what the scripts are

# APIs newer than 3.8 that ast.parse(feature_version=(3, 8)) lets through.
_NEWER_THAN_38 = {"removeprefix", "removesuffix", "is_relative_to", "with_stem", "randbytes", "lcm", "cache",
                  "TopologicalSorter", "bit_count", "pairwise", "countof"}  # fmt: skip
_GENERIC_BUILTINS = {"list", "dict", "tuple", "set", "frozenset", "type"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_each_script_is_python38_stdlib_only_and_standalone(script: Path) -> None:
    tree = ast.parse(script.read_text(), feature_version=(3, 8))
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert {m.split(".")[0] for m in modules} <= set(sys.stdlib_module_names), modules
    assert not any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree)), "no relative imports"
    # Syntax that parses under 3.8 but fails there when it runs.
    for node in ast.walk(tree):
        assert not (isinstance(node, ast.Attribute) and node.attr in _NEWER_THAN_38), f"line {node.lineno}: {node.attr}"
        assert not (
            isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in _GENERIC_BUILTINS
        ), f"line {node.lineno}: {node.value.id}[...] needs Python 3.9"
        assert not isinstance(node, (ast.AnnAssign, ast.arg)) or getattr(node, "annotation", None) is None, (
            f"line {node.lineno}: annotations (3.8 evaluates them)"
        )
    assert "__main__" in script.read_text(), "runs only as a program, not on import"
    if PY38 is not None:  # the real thing, where there is one
        p = subprocess.run([PY38, "-c", "import sys; compile(open(sys.argv[1]).read(), sys.argv[1], 'exec')", str(script)],
                           capture_output=True, text=True, timeout=30)  # fmt: skip
        assert p.returncode == 0, p.stderr


# --------------------------------------------------------------------------- the probe on real run directories


@pytest.mark.parametrize("how", ["file", "source"])
@pytest.mark.parametrize("python", PYTHONS)
def test_probe_reads_a_run_directory(tmp_path, python: str, how: str) -> None:
    run_dir = tmp_path / "run"
    lines = make_run(run_dir, exit_code="0\n")
    metrics = run_dir / contract.METRICS_FILE
    before = time.time()
    answer = run_script("probe", {"runs": [{"run_dir": str(run_dir), "metrics_offset": len(lines[0]),
                                            "metrics_inode": os.stat(metrics).st_ino, "pane_lines": 20,
                                            "pid_hint": os.getpid()}], "nvidia_smi": False},
                        python=python, how=how)  # fmt: skip
    assert answer["errors"] == [] and "smi" not in answer
    assert before - 1 <= answer["host_time"] <= time.time() + 1
    version = subprocess.run([python, "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"],
                             capture_output=True, text=True).stdout.strip()  # fmt: skip
    assert answer["python"] == version
    [run] = answer["runs"]
    assert run["errors"] == [] and run["run_dir"] == str(run_dir)
    assert contract.parse_status(run["status_text"]).step == 3
    assert run["metrics"]["chunk"] == lines[1] + lines[2]  # from the offset on
    assert run["metrics"]["offset"] == metrics.stat().st_size and run["metrics"]["reset"] is False
    assert run["log_tail"].splitlines() == [f"log line {i}" for i in range(480, 500)]
    assert run["exit_code"] == 0
    assert run["process"]["pid"] == os.getpid() and run["process"]["alive"] is True  # status.json has no pid

    [parsed] = parse_probe_output(json.dumps(answer))
    assert parsed.errors == [] and parsed.metrics_chunk == lines[1] + lines[2] and parsed.exit_code == 0


# One status.json each, none of them usable; what the probe says about it.
HOSTILE_STATUS = {
    "binary": (b"\x00\xff\xfe garbage \x80" * 10, "ValueError: not JSON"),
    "nested-array": (b"[" * 60000 + b"]" * 4000, "ValueError: nested deeper than 32 levels: not parsed"),
    "nested-detail": (b'{"phase": "training", "detail": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5001,
                      "ValueError: nested deeper than 32 levels: not parsed"),
    "quotes-and-escapes": (b'"\\"' * 20000, "ValueError: not JSON"),  # the depth guard stays linear on these
    "a-list": (b'[{"phase": "training", "pid": 1}]', "ValueError: not a JSON object (a list)"),
    "huge": (b'{"phase": "training", "pad": "' + b"x" * (8 * 1024 * 1024) + b'"}',
             "ValueError: larger than 65536 bytes: not read"),
}  # fmt: skip


@pytest.mark.parametrize("python", PYTHONS)
@pytest.mark.parametrize("case", sorted(HOSTILE_STATUS))
def test_a_hostile_status_json_spoils_no_other_step(tmp_path, case: str, python: str) -> None:
    data, error = HOSTILE_STATUS[case]
    run_dir = tmp_path / "run"
    lines = make_run(run_dir)
    (run_dir / contract.STATUS_FILE).write_bytes(data)
    answer = run_script("probe", [{"run_dir": str(run_dir), "pid_hint": os.getpid(), "nvidia_smi": False}], python=python)
    [run] = answer["runs"]
    assert len(run["errors"]) == 1 and run["errors"][0].startswith(f"status.json: {error}"), run["errors"]
    assert run["status_text"] is None
    assert run["exit_code"] == 137  # what the run's end says still arrives
    assert run["metrics"]["chunk"] == "".join(lines) and run["log_tail"].endswith("log line 499")
    assert run["process"]["pid"] == os.getpid()  # the launcher's pid hint, status.json having none

    [parsed] = parse_probe_output(json.dumps(answer))
    assert parsed.status is None and parsed.exit_code == 137 and parsed.errors == run["errors"]


@pytest.mark.parametrize(
    "content, error",
    [(b"\xff\xfe\x00", "ValueError: not an exit status"), (b"9" * 60, "ValueError: not an exit status"),
     (b"1\n" * 100, "ValueError: larger than 64 bytes"), (b"-15\n", None), (b"  \n", None)],
    ids=["binary", "huge-number", "too-long", "signal", "blank"],
)  # fmt: skip
def test_a_hostile_exit_code_file_is_an_error_of_its_step(tmp_path, content: bytes, error: str | None) -> None:
    run_dir = tmp_path / "run"
    make_run(run_dir, exit_code=None)
    (run_dir / contract.EXIT_CODE_FILE).write_bytes(content)
    run = probe_run({"run_dir": str(run_dir)})
    if error is None:
        assert run["errors"] == [] and run["exit_code"] == (-15 if content.strip() else None)
    else:
        assert [e[: len("exit_code: ") + len(error)] for e in run["errors"]] == [f"exit_code: {error}"]
        assert run["exit_code"] is None and contract.parse_status(run["status_text"]).step == 3


def test_tails_and_reads_are_bounded(tmp_path) -> None:
    run_dir = tmp_path / "run"
    make_run(run_dir)
    (run_dir / contract.LOG_FILE).write_bytes(b"y" * (3 * 1024 * 1024))  # one line, no newline: a progress bar
    with open(run_dir / contract.METRICS_FILE, "ab") as f:
        f.write(b"z" * 5000)  # a line with no end, longer than the whole budget
    run = probe_run({"run_dir": str(run_dir), "pane_lines": 10**12, "metrics_max_bytes": 10**15})
    assert run["errors"] == []
    assert len(run["log_tail"]) == 65536
    small = probe_run({"run_dir": str(run_dir), "metrics_offset": os.path.getsize(run_dir / contract.METRICS_FILE) - 5000,
                       "metrics_max_bytes": 1000})  # fmt: skip
    assert small["metrics"]["chunk"] == "" and small["metrics"]["skipped"] == 1000 and small["metrics"]["more"] is True


def test_bad_arguments_are_errors_of_their_own_run(tmp_path) -> None:
    make_run(tmp_path / "a")
    make_run(tmp_path / "b")
    answer = run_script("probe", {"nvidia_smi": False, "runs": [
        {"run_dir": str(tmp_path / "a"), "pane_lines": "many", "pid_hint": [1], "metrics_offset": 1e400},
        {"no_run_dir": True},
        {"run_dir": str(tmp_path / "b")},
    ]})  # fmt: skip
    a, missing, b = answer["runs"]
    assert sorted(e.split(":")[0] for e in a["errors"]) == ["argument metrics_offset", "argument pane_lines", "argument pid_hint"]
    assert a["exit_code"] == 137 and a["log_tail"].endswith("log line 499") and "process" not in a
    assert missing["errors"] == ["probe: KeyError: 'run_dir'"]
    assert b["errors"] == [] and b["exit_code"] == 137

    # Still one JSON answer when the argument itself is wrong.
    for argument, error in (("not json", "probe: JSONDecodeError: "), ("7", "probe: AttributeError: ")):
        broken = run_script("probe", argument)
        assert broken["runs"] == [] and broken["errors"][0].startswith(error)
    not_specs = run_script("probe", "[1, 2]")["runs"]
    assert [r["errors"][0].split(":")[:2] for r in not_specs] == [["probe", " TypeError"]] * 2


# --------------------------------------------------------------------------- facts


@pytest.mark.parametrize("how", ["file", "source"])
@pytest.mark.parametrize("python", PYTHONS)
def test_facts_script(tmp_path, python: str, how: str) -> None:
    """With a stand-in nvidia-smi that logs its query and answers one H200."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "tmux").symlink_to(shutil.which("tmux"))
    smi = bindir / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\necho "$*" > {tmp_path / "smi-args"}\necho "0, NVIDIA H200, 143771, 1011"\n')
    smi.chmod(0o755)
    workdir = tmp_path / "a" / "work"
    answer = run_script("facts", {"workdir": str(workdir), "gpu_fields": list(facts.GPU_FIELDS)},
                        python=python, how=how, path=str(bindir))  # fmt: skip
    found = facts.parse_facts(json.dumps(answer))
    assert found.workdir == str(workdir) and workdir.is_dir() and found.disk_free > 0
    assert found.tmux.startswith("tmux ") and found.nvidia_smi == str(smi)
    assert [(g.index, g.name, g.memory_used_mib) for g in found.gpus] == [(0, "NVIDIA H200", 1011.0)]
    assert (tmp_path / "smi-args").read_text().split() == [
        "--query-gpu=index,name,memory.total,memory.used", "--format=csv,noheader,nounits"]  # fmt: skip


# --------------------------------------------------------------------------- the controller reading any answer

GOOD_RUN = {"run_dir": "/r", "session": "s", "errors": [], "session_alive": True,
            "pane": {"tail": "step 1", "dead": False, "dead_status": None, "pid": 7},
            "status_text": '{"phase": "training", "pid": 42, "step": 3, "started": 1.0, "updated": 2.0}',
            "metrics": {"chunk": "", "offset": 10, "inode": 5, "size": 10, "reset": False, "more": False, "skipped": 0},
            "log_tail": "log", "exit_code": None,
            "process": {"pid": 42, "alive": True, "state": "S", "cmdline": "python -m trainer"}}  # fmt: skip
GOOD_ANSWER = {"probe": 1, "hostname": "h", "python": "3.8.18", "host_time": 1.8e9, "elapsed": 0.01, "errors": [],
               "smi": {"gpus": "0, GPU-1, NVIDIA H200, 1011, 143771, 100, 40, 120.5, 700, 1980\n", "apps": ""},
               "runs": [GOOD_RUN]}  # fmt: skip


