"""The controller's reading of the host-side scripts' answers, which must take any
text at all (hypothesis property tests), and the scripts as shipped (their text,
the contract's names). (The scripts run for real by a host's Python:
tests/integration/test_remote_scripts.py.)"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import dflashctl.hosts.remote
from dflashctl.core import contract
from dflashctl.hosts import facts, probe
from dflashctl.hosts.probe import HostProbe, ProbeError, ProbeResult, parse_probe_host, parse_probe_output

REMOTE = Path(dflashctl.hosts.remote.__file__).parent


SCRIPTS = sorted(p for p in REMOTE.glob("*.py") if p.name != "__init__.py")


def assert_well_typed(result) -> None:
    """Everything handed on has the type it is declared with, and can be stored as JSON."""
    assert isinstance(result, (HostProbe, ProbeError)), type(result)
    if isinstance(result, ProbeError):
        assert isinstance(result.message, str) and result.message and isinstance(result.output_tail, str)
        return
    assert type(result.host_time) is float and math.isfinite(result.host_time)
    assert all(isinstance(e, str) for e in result.errors)
    for r in result.runs:
        assert isinstance(r, ProbeResult) and isinstance(r.run_dir, str)
        for name in ("session", "pane_tail", "log_tail", "hostname"):
            assert getattr(r, name) is None or isinstance(getattr(r, name), str), name
        for name in ("session_alive", "pane_dead"):
            assert getattr(r, name) in (None, True, False), name
        assert _int_or_none(r.pane_dead_status) and _int_or_none(r.exit_code) and _int_or_none(r.metrics_inode)
        assert isinstance(r.metrics_chunk, str) and (r.metrics_offset is None or (type(r.metrics_offset) is int
                                                                                   and r.metrics_offset >= 0))  # fmt: skip
        assert r.metrics_reset in (True, False) and r.metrics_more in (True, False)
        if r.status is not None:
            s = r.status
            assert s.phase in contract.PHASES + (None,) and _int_or_none(s.pid) and _int_or_none(s.step)
            assert _int_or_none(s.v)
            assert _float_or_none(s.started) and _float_or_none(s.updated) and isinstance(s.detail, dict)
            assert s.error is None or isinstance(s.error, str)
        if r.process is not None:
            p = r.process
            assert type(p.pid) is int and p.alive in (True, False)
            assert (p.state is None or isinstance(p.state, str)) and (p.cmdline is None or isinstance(p.cmdline, str))
        for g in r.gpus or []:
            assert _int_or_none(g.index) and all(_float_or_none(getattr(g, a)) for a in (
                "memory_used_mib", "memory_total_mib", "utilization_pct", "power_draw_w"))  # fmt: skip
        for a in r.compute_apps or []:
            assert _int_or_none(a.pid) and _float_or_none(a.used_memory_mib)
        assert all(isinstance(e, str) for e in r.errors)
        json.dumps(dataclasses.asdict(r))  # what the store does with it


PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def hostile_answers(draw):
    """The probe's answer, well formed but for some fields replaced by any JSON value."""
    answer = json.loads(json.dumps(GOOD_ANSWER))
    run = answer["runs"][0]
    for field in draw(st.lists(st.sampled_from(HOST_FIELDS), max_size=3)):
        answer[field] = draw(JSON_VALUES)
    for field in draw(st.lists(st.sampled_from(RUN_FIELDS), max_size=4)):
        run[field] = draw(JSON_VALUES)
    for outer, inner in NESTED.items():
        holder = answer if outer == "smi" else run
        if isinstance(holder.get(outer), dict):
            for field in draw(st.lists(st.sampled_from(inner), max_size=2)):
                holder[outer][field] = draw(JSON_VALUES)
    if draw(st.booleans()):
        status = json.loads(GOOD_RUN["status_text"])
        for field in draw(st.lists(st.sampled_from(STATUS_FIELDS), min_size=1, max_size=3)):
            status[field] = draw(JSON_VALUES)
        run["status_text"] = json.dumps(status)
    return answer


GOOD_RUN = {"run_dir": "/r", "session": "s", "errors": [], "session_alive": True,
            "pane": {"tail": "step 1", "dead": False, "dead_status": None, "pid": 7},
            "status_text": '{"phase": "training", "pid": 42, "step": 3, "started": 1.0, "updated": 2.0}',
            "metrics": {"chunk": "", "offset": 10, "inode": 5, "size": 10, "reset": False, "more": False, "skipped": 0},
            "log_tail": "log", "exit_code": None,
            "process": {"pid": 42, "alive": True, "state": "S", "cmdline": "python -m trainer"}}  # fmt: skip


GOOD_ANSWER = {"probe": 1, "hostname": "h", "python": "3.8.18", "host_time": 1.8e9, "elapsed": 0.01, "errors": [],
               "smi": {"gpus": "0, GPU-1, NVIDIA H200, 1011, 143771, 100, 40, 120.5, 700, 1980\n", "apps": ""},
               "runs": [GOOD_RUN]}  # fmt: skip


# Any JSON value: numbers of any size (10**600 included), NaN and inf, nesting.
JSON_SCALARS = (
    st.none() | st.booleans() | st.text(max_size=30)
    | st.integers() | st.integers(min_value=-(10**600), max_value=10**600) | st.floats()
)  # fmt: skip


JSON_VALUES = st.recursive(
    JSON_SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


def _int_or_none(value) -> bool:
    return value is None or (type(value) is int)


def _float_or_none(value) -> bool:
    return value is None or (type(value) is float and math.isfinite(value))


# The answer's fields, each of which a hostile host may send as any JSON value.
HOST_FIELDS = ["hostname", "python", "elapsed", "errors", "smi"]


RUN_FIELDS = ["session", "errors", "session_alive", "pane", "status_text", "metrics", "log_tail", "exit_code", "process"]


NESTED = {"pane": ["tail", "dead", "dead_status"], "metrics": ["chunk", "offset", "inode", "reset", "more", "skipped"],
          "process": ["pid", "alive", "state", "cmdline"], "smi": ["gpus", "apps"]}  # fmt: skip


STATUS_FIELDS = ["phase", "pid", "started", "updated", "step", "error", "detail", "v"]


def test_the_scripts_ship_as_their_files_text_and_agree_with_the_contract() -> None:
    from dflashctl.hosts.remote import facts as remote_facts
    from dflashctl.hosts.remote import probe as remote_probe

    assert {p.stem for p in SCRIPTS} >= {"probe", "facts"}
    assert probe.PROBE_SOURCE == (REMOTE / "probe.py").read_text()
    assert facts.FACTS_SCRIPT == (REMOTE / "facts.py").read_text()
    assert probe.probe_command("python3", [])[4] == probe.PROBE_SOURCE
    assert remote_facts.main is not None  # importing a script runs nothing

    assert remote_probe.PROBE_VERSION == probe.PROBE_VERSION
    assert remote_probe.STATUS_FILE == contract.STATUS_FILE
    assert remote_probe.METRICS_FILE == contract.METRICS_FILE
    assert remote_probe.LOG_FILE == contract.LOG_FILE
    assert remote_probe.EXIT_CODE_FILE == contract.EXIT_CODE_FILE
    assert remote_probe.TMUX_SOCKET == probe.TMUX_SOCKET
    assert remote_probe.STATUS_MAX_DEPTH == contract.MAX_DEPTH  # what the probe sends, the contract reads
    assert remote_probe.STATUS_MAX_BYTES <= contract.MAX_LINE_CHARS
    args = dataclasses.fields(probe.ProbeArgs)
    assert remote_probe.METRICS_DEFAULT_BYTES == next(f.default for f in args if f.name == "metrics_max_bytes")


@pytest.mark.parametrize(
    "change",
    [{"hostname": 5}, {"os": None}, {"disk_free": "lots"}, {"disk_free": 10**400}, {"gpu_query": [1]},
     {"gpu_query": {"exit_code": "0", "stdout": ""}}, {"tmux": ["x"]}],
)  # fmt: skip
def test_facts_of_the_wrong_type_are_a_value_error(change: dict) -> None:
    raw = {"hostname": "h", "os": "Debian", "kernel": "6", "python": "3.8.18", "python_path": "/usr/bin/python3",
           "workdir": "/w", "disk_free": 1, **change}  # fmt: skip
    with pytest.raises(ValueError, match=f"'{next(iter(change))}'"):
        facts.parse_facts(json.dumps(raw))
    with pytest.raises(ValueError):
        facts.parse_facts("[" * 100000)


@PROPERTY
@given(st.text() | st.binary().map(lambda b: b.decode("utf-8", "surrogateescape")) | st.binary().map(
    lambda b: b.decode("latin-1")))  # fmt: skip
@example("[" * 100000)
@example('{"probe": 1, "runs": ' + "[" * 100000)
@example('{"probe": 1, "runs": [], "host_time": 1' + "0" * 400 + "}")
@example('{"probe": 1, "runs": [], "host_time": 1e400}')
@example('{"probe": 1, "runs": [], "host_time": NaN}')
@example('{"probe": 1, "runs": [], "host_time": ' + "9" * 5000 + "}")
def test_any_text_is_a_result_or_a_probe_error(text: str) -> None:
    assert_well_typed(parse_probe_host(text))
    assert isinstance(parse_probe_output(text), (list, ProbeError))


@PROPERTY
@given(JSON_VALUES, st.sampled_from(["", "Welcome to gpu1!\n", "{\n"]))
def test_any_json_document_is_a_result_or_a_probe_error(document, banner: str) -> None:
    assert_well_typed(parse_probe_host(banner + json.dumps(document) + "\n"))


@PROPERTY
@given(hostile_answers())
def test_a_field_of_the_wrong_type_is_none_and_noted_not_passed_on(answer: dict) -> None:
    result = parse_probe_host(json.dumps(answer))
    assert isinstance(result, HostProbe), result  # one bad field never costs the whole answer
    assert_well_typed(result)
    [r] = result.runs
    sent = answer["runs"][0]
    if sent["exit_code"] is not None and r.exit_code is None:
        assert any("exit_code" in e for e in r.errors), r.errors
    if sent["exit_code"] is not None and r.exit_code is not None:
        assert r.exit_code == sent["exit_code"] and type(sent["exit_code"]) is int
    if isinstance(sent["process"], dict) and r.process is None:
        assert any("process." in e for e in r.errors), r.errors


@pytest.mark.parametrize(
    "run_change, field, expected_error",
    [({"process": {"pid": "x", "alive": True}}, "process", "probe answer: process.pid is not an integer ('x')"),
     ({"exit_code": 10**400}, "exit_code", "probe answer: exit_code is out of range (an integer of 1329 bits"),
     ({"exit_code": True}, "exit_code", "probe answer: exit_code is not an integer (true)"),
     ({"session_alive": "yes"}, "session_alive", "probe answer: session_alive is not true or false ('yes')"),
     ({"metrics": {"chunk": "x\n", "offset": "2"}}, "metrics_offset", "probe answer: metrics.offset is not an integer"),
     ({"metrics": {"chunk": 5, "offset": 2}}, "metrics_offset", "probe answer: metrics.chunk is not a string (5)"),
     ({"pane": {"tail": ["a"]}}, "pane_tail", "probe answer: pane.tail is not a string"),
     ({"log_tail": "\ud800 lone surrogate"}, "log_tail", "probe answer: log_tail is not valid UTF-8 text"),
     ({"status_text": '{"phase": "training", "step": "3"}'}, "status.step", "status.json: step is not an integer ('3')"),
     ({"status_text": '{"phase": "training", "pid": "x"}'}, "status.pid", "status.json: pid is not an integer ('x')"),
     ({"status_text": '{"phase": "training", "updated": 1e400}'}, "status.updated", "status.json: updated is not a finite"),
     ({"status_text": '{"phase": 3}'}, "status.phase", "status.json: phase 3 is not a known phase"),
     ({"status_text": '{"phase": "x", "detail": ' + '{"a": ' * 500 + "1" + "}" * 501}, "status",
      "status.json: status nests deeper than 32 levels"),
     ({"status_text": "[" * 100000}, "status", "status.json: status nests deeper than 32 levels"),
     ({"status_text": "[1]"}, "status", "status.json: status is a JSON array, not an object")],
    ids=["pid-text", "exit-10**400", "exit-bool", "alive-text", "offset-text", "chunk-number", "tail-list",
         "tail-surrogate", "step-text", "status-pid-text", "updated-inf", "phase-number", "detail-deep", "status-deep",
         "status-list"],
)  # fmt: skip
def test_wrongly_typed_values_are_rejected_and_noted(run_change: dict, field: str, expected_error: str) -> None:
    answer = json.loads(json.dumps(GOOD_ANSWER))
    answer["runs"][0].update(run_change)
    [r] = parse_probe_output(json.dumps(answer))
    value = r
    for part in field.split("."):
        value = getattr(value, part)
    assert value in (None, {}), value
    assert [e for e in r.errors if e.startswith(expected_error)], r.errors
    assert r.run_dir == "/r" and r.host_time == 1.8e9  # the rest of the answer stands


@pytest.mark.parametrize("host_time", ['"soon"', "1e400", "NaN", "-5", "true", "1" + "0" * 400, "null"])
def test_an_unusable_host_clock_is_a_probe_error(host_time: str) -> None:
    text = json.dumps(GOOD_ANSWER).replace('"host_time": 1800000000.0', f'"host_time": {host_time}')
    assert host_time in text
    result = parse_probe_host(text)
    assert isinstance(result, ProbeError) and "host_time" in result.message


def test_the_good_answer_reads_whole() -> None:
    """The baseline the tests above spoil one field at a time."""
    host = parse_probe_host(json.dumps(GOOD_ANSWER))
    assert isinstance(host, HostProbe) and host.errors == []
    [r] = host.runs
    assert r.errors == [] and r.status.step == 3 and r.process.pid == 42 and r.metrics_offset == 10
    assert r.gpus[0].memory_used_mib == 1011.0 and r.compute_apps == []


def test_a_flood_of_errors_is_cut_and_says_so() -> None:
    answer = json.loads(json.dumps(GOOD_ANSWER))
    answer["errors"] = ["nvidia-smi: x" * 1000] * 5000
    answer["runs"][0]["errors"] = [{"not": "text"}] * 3 + ["tmux: y"] * 5000
    detail = {f"k{i}": [1.5e300 * 1e10] for i in range(3000)}  # inf: not plain JSON
    answer["runs"][0]["status_text"] = json.dumps({"phase": "training", "detail": detail})
    host = parse_probe_host(json.dumps(answer))
    assert len(host.errors) == 101 and host.errors[-1] == "... and 4900 more"
    assert all(len(e) <= 1000 for e in host.errors)
    [r] = host.runs
    own, status, shared = r.errors[:101], r.errors[101:202], r.errors[202:]
    assert own[:3] == ["probe answer: an error that is not text (a dict)"] * 3 and own[-1] == "... and 4903 more"
    assert status[0] == "status.json: detail.k0 dropped: not plain JSON" and status[-1] == "status.json: ... and 2900 more"
    assert shared == host.errors
