"""The trainer <-> controller contract read as untrusted data: metrics lines and
status.json, hostile inputs seen in the field, and properties over any text, any
JSON shape and numbers of any size (nothing but ``ContractError`` escapes, and
whatever is accepted has the documented types)."""

from __future__ import annotations

import json
import math
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflashctl.core import contract
from dflashctl.core.contract import (
    ContractError,
    Metrics,
    Status,
    parse_metrics_line,
    parse_status,
    read_metrics_line,
    read_status,
)

PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
INT64_MAX = 2**63 - 1

GOOD = {"time": 1000.0, "step": 5, "total_steps": 10}


def line(**fields) -> str:
    return json.dumps({**GOOD, **fields})


def rejected(text: str) -> str:
    with pytest.raises(ContractError) as e:
        read_metrics_line(text)
    assert parse_metrics_line(text) is None
    return e.value.reason


# --------------------------------------------------------------------------- hostile metrics lines


def test_deep_nesting_is_refused_before_parsing() -> None:
    assert "deeper than" in rejected("[" * 50000)
    assert "deeper than" in rejected('{"a":' * 50000)
    nested = '{"time": 1, "step": 1, "total_steps": 2, "x": ' + "[" * 40 + "]" * 40 + "}"
    assert "deeper than" in rejected(nested)
    # Brackets inside a string are text, not nesting.
    assert read_metrics_line(line(note="[" * 4000)).extra == {"note": "[" * 4000}
    assert read_metrics_line(line(note='"[{' * 100)).extra == {"note": '"[{' * 100}


def test_int64_overflowing_step_is_refused() -> None:
    reason = rejected('{"time": 1, "step": 9223372036854775808, "total_steps": 10}')
    assert reason.startswith("step is out of range")
    largest = '{"time": 1, "step": 9223372036854775807, "total_steps": 9223372036854775807}'
    assert read_metrics_line(largest).step == INT64_MAX


def test_infinite_total_steps_is_refused() -> None:
    assert rejected('{"time": 1, "step": 5, "total_steps": Infinity}') == "total_steps is not an integer (inf)"
    assert rejected('{"time": NaN, "step": 5, "total_steps": 10}') == "time is not a finite number (nan)"
    assert rejected(line(loss=1e400)) == "loss is not a finite number (inf)"  # 1e400 reads as inf


def test_text_where_a_number_belongs_is_refused() -> None:
    assert rejected(line(tok_s="fast")) == "tok_s is not a number ('fast')"
    assert rejected(line(step="5")) == "step is not an integer ('5')"
    assert rejected(line(time="1000")) == "time is not a number ('1000')"


def test_booleans_and_floats_are_not_integers() -> None:
    assert rejected(line(step=True)) == "step is not an integer (true)"
    assert rejected(line(step=5.0)) == "step is not an integer (5.0)"
    assert rejected(line(tokens=[1])) == "tokens is not an integer (a JSON array)"
    assert rejected(line(loss=False)) == "loss is not a number (false)"


def test_numbers_out_of_range_are_refused() -> None:
    assert rejected(line(step=-1)).startswith("step is out of range")
    assert rejected(line(tok_s=-3.0)).startswith("tok_s is out of range")
    assert rejected(line(loss=10**400)).startswith("loss is out of range (an integer of 1329 bits")
    assert rejected(line(eta_s=1e300)).startswith("eta_s is out of range")


def test_missing_required_fields_and_non_objects() -> None:
    assert rejected('{"step": 7}') == "time, total_steps missing"
    assert rejected("[1, 2]") == "line is a JSON array, not an object"
    assert rejected("{not json").startswith("line is not JSON")
    assert rejected("   ") == "blank line"
    assert rejected('{"time": 1, "step": ' + "9" * 5000 + ', "total_steps": 1}').startswith("line is not JSON")


def test_oversized_line_is_refused_without_parsing() -> None:
    huge = '{"time": 1, "step": 1, "total_steps": 2, "pad": "' + "x" * contract.MAX_LINE_CHARS + '"}'
    assert "over the" in rejected(huge)


def test_pathological_text_is_linear() -> None:
    n = contract.MAX_LINE_CHARS
    cases = ['"' + '\\"' * (n // 2 - 1), "[]" * (n // 2), "[" * 40 + '"' + "a" * (n - 100)]
    started = time.perf_counter()
    for text in cases:
        rejected(text)
    assert time.perf_counter() - started < 5.0  # quadratic scanning would take minutes


def test_unknown_phase_reads_as_none_and_missing_phase_as_training() -> None:
    assert read_metrics_line(line(phase="warming")).phase is None
    assert read_metrics_line(line(phase=3)).phase is None
    assert read_metrics_line(line(phase="compiling")).phase == "compiling"
    assert read_metrics_line(line()).phase == contract.PHASE_TRAINING


def test_extra_keeps_plain_json_and_drops_the_rest() -> None:
    m = read_metrics_line(
        line(mfu=0.36, queue_depth=[1, 2], dynamo={"graphs": 3, "ok": True, "note": None}, big=2**64,
             text="y" * (contract.MAX_TEXT_CHARS + 1), deep_ok=[[[[1]]]])
    )
    assert m.extra == {"mfu": 0.36, "queue_depth": [1, 2], "dynamo": {"graphs": 3, "ok": True, "note": None},
                       "deep_ok": [[[[1]]]]}
    assert read_metrics_line(line(odd=float("inf"))).extra == {}  # json.dumps writes Infinity
    lone_surrogate = '{"time": 1, "step": 1, "total_steps": 2, "s": "\\ud800", "t": "ok"}'
    assert read_metrics_line(lone_surrogate).extra == {"t": "ok"}


def test_null_optional_numbers_read_as_none() -> None:
    m = read_metrics_line(line(tok_s=None, loss=None, acc=None, accept_len=None, eta_s=None))
    assert (m.tok_s, m.loss, m.acc, m.accept_len, m.eta_s) == (None, None, None, None, None)
    assert rejected(line(tokens=None)) == "tokens is not an integer (null)"


def test_the_writer_and_the_reader_agree() -> None:
    m = Metrics(time=1.5, step=3, total_steps=9, phase="compiling", tokens=77, tok_s=12.5, loss=2.0, acc=0.5,
                accept_len=3.25, eta_s=60.0, extra={"mfu": 0.4, "queue_depth": [0, 1], "dynamo": {"graphs": 2}})
    assert read_metrics_line(m.to_line()) == m
    nan = Metrics(time=1.0, step=1, total_steps=2, loss=float("nan"))
    assert read_metrics_line(nan.to_line()).loss is None  # written as null


# --------------------------------------------------------------------------- hostile status.json


def test_a_wrongly_typed_status_field_is_none_and_the_rest_stays_usable() -> None:
    status = parse_status('{"phase": "training", "pid": 4242, "step": "x", "started": 1700000000}')
    assert status is not None
    assert (status.phase, status.pid, status.started, status.step) == ("training", 4242, 1700000000.0, None)
    assert status.problems == ["step is not an integer ('x')"]


def test_every_status_field_is_checked() -> None:
    status = read_status(json.dumps({
        "phase": "exploding", "pid": True, "started": float("inf"), "updated": "now", "step": 2**63,
        "error": "e" * (contract.MAX_TEXT_CHARS + 1), "detail": {"ok": 1, "bad": 10**30}, "v": 1.5, "future": [1],
    }))
    assert (status.phase, status.pid, status.started, status.updated, status.step, status.error, status.v) == (
        None, None, None, None, None, None, None)
    assert status.detail == {"ok": 1}
    assert status.problems == [
        "phase 'exploding' is not a known phase",
        "pid is not an integer (true)",
        "started is not a finite number (inf)",
        "updated is not a number ('now')",
        "step is out of range (9223372036854775808; expected 0..9223372036854775807)",
        f"error is {contract.MAX_TEXT_CHARS + 1} characters long, over the {contract.MAX_TEXT_CHARS} limit",
        "v is not an integer (1.5)",
        "detail.bad dropped: not plain JSON",
    ]
    assert read_status('{"phase": "done", "detail": [1]}').problems == ["detail is not an object (a JSON array)"]
    assert read_status('{"pid": 5}').problems == ["phase missing"]
    assert read_status('{"phase": "done", "pid": null, "step": null}').step is None


def test_unusable_status_text_is_refused_as_a_whole() -> None:
    for text, words in [("[" * 50000, "deeper than"), ("[1]", "not an object"), ("{", "not JSON"),
                        ("x" * (contract.MAX_LINE_CHARS + 1), "over the")]:
        with pytest.raises(ContractError, match=words):
            read_status(text)
        assert parse_status(text) is None


def test_status_round_trips_and_problems_are_never_written(tmp_path) -> None:
    status = Status(phase=contract.PHASE_COMPILING, pid=7, started=1.0, step=3, error="E: x",
                    detail={"exit_code": 1, "message": "m"})
    contract.write_status(str(tmp_path), status)
    text = (tmp_path / contract.STATUS_FILE).read_text()
    assert "problems" not in json.loads(text)
    assert read_status(text) == status  # updated was set by write_status, on both sides


# --------------------------------------------------------------------------- properties

BIG_INTS = st.sampled_from([2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**308, 10**309, 10**400, -(10**400)])
NUMBERS = st.integers() | BIG_INTS | st.floats(allow_nan=True, allow_infinity=True)
SCALARS = st.none() | st.booleans() | NUMBERS | st.text(max_size=30)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
METRIC_KEYS = sorted({f for f in Metrics.__dataclass_fields__} - {"extra"}) + ["mfu", "x"]
STATUS_KEYS = sorted(Status.__dataclass_fields__)
PHASE_OR_JSON = st.sampled_from(contract.PHASES) | JSON


def _objects(keys: list[str]):
    return st.dictionaries(st.sampled_from(keys), PHASE_OR_JSON, max_size=len(keys)) | st.dictionaries(
        st.text(max_size=8), JSON, max_size=6)


def _dumps(value) -> str:
    return json.dumps(value)  # NaN and Infinity are written as JSON's non-standard literals


NESTED = st.builds(lambda n, o, c: o * n + "1" + c * n, st.integers(0, 3000), st.sampled_from(["[", '{"a":']),
                   st.sampled_from(["]", "}"]))


def _is_int64(value, low=0) -> bool:
    return type(value) is int and low <= value <= INT64_MAX


def _is_finite_or_none(value) -> bool:
    return value is None or (type(value) is float and math.isfinite(value))


def _plain(value, depth=contract.MAX_DEPTH) -> bool:
    """Independent of the code under test: what may sit in extra/detail."""
    if value is None or type(value) in (bool, str):
        return True
    if type(value) is int:
        return -(2**63) <= value <= INT64_MAX
    if type(value) is float:
        return math.isfinite(value)
    if isinstance(value, list):
        return depth > 0 and all(_plain(v, depth - 1) for v in value)
    if isinstance(value, dict):
        return depth > 0 and all(type(k) is str and _plain(v, depth - 1) for k, v in value.items())
    return False


def assert_typed_metrics(m: Metrics) -> None:
    assert type(m.time) is float and math.isfinite(m.time) and m.time >= 0
    assert _is_int64(m.step) and _is_int64(m.total_steps) and _is_int64(m.tokens) and _is_int64(m.v)
    for value in (m.tok_s, m.loss, m.acc, m.accept_len, m.eta_s):
        assert _is_finite_or_none(value)
    assert m.phase is None or m.phase in contract.PHASES
    assert all(type(k) is str and _plain(v) for k, v in m.extra.items())
    assert not set(m.extra) & set(Metrics.__dataclass_fields__)


def assert_typed_status(s: Status) -> None:
    assert s.phase is None or s.phase in contract.PHASES
    assert s.pid is None or _is_int64(s.pid, low=1)
    assert s.step is None or _is_int64(s.step)
    assert s.v is None or _is_int64(s.v)
    assert _is_finite_or_none(s.started) and _is_finite_or_none(s.updated)
    assert s.error is None or (type(s.error) is str and len(s.error) <= contract.MAX_TEXT_CHARS)
    assert type(s.detail) is dict and all(type(k) is str and _plain(v) for k, v in s.detail.items())
    assert all(type(p) is str for p in s.problems)


def check_metrics_line(text: str) -> None:
    try:
        m = read_metrics_line(text)
    except ContractError as e:
        assert isinstance(e.reason, str) and e.reason
        assert parse_metrics_line(text) is None
        return
    assert_typed_metrics(m)
    assert parse_metrics_line(text) == m


def check_status(text: str) -> None:
    try:
        s = read_status(text)
    except ContractError as e:
        assert isinstance(e.reason, str) and e.reason
        assert parse_status(text) is None
        return
    assert_typed_status(s)
    assert parse_status(text) == s


@PROPERTY
@given(st.text())
def test_any_text_as_a_metrics_line(text: str) -> None:
    check_metrics_line(text)


@PROPERTY
@given(_objects(METRIC_KEYS) | JSON)
def test_any_json_as_a_metrics_line(value) -> None:
    check_metrics_line(_dumps(value))


@PROPERTY
@given(st.dictionaries(st.sampled_from(METRIC_KEYS), NUMBERS | st.sampled_from(contract.PHASES), max_size=12))
def test_numbers_of_any_size_in_every_metrics_field(value) -> None:
    check_metrics_line(_dumps({**GOOD, **value}))


@PROPERTY
@given(NESTED)
def test_any_nesting_as_a_metrics_line_or_status(text: str) -> None:
    check_metrics_line(text)
    check_status(text)


@PROPERTY
@given(st.text())
def test_any_text_as_status(text: str) -> None:
    check_status(text)


@PROPERTY
@given(_objects(STATUS_KEYS) | JSON)
def test_any_json_as_status(value) -> None:
    check_status(_dumps(value))


FINITE = st.floats(min_value=0, max_value=1e15, allow_nan=False)
OPTIONAL = st.none() | FINITE
WRITABLE_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), INT64_MAX) | FINITE | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
EXTRA_KEYS = st.text(max_size=8).filter(lambda k: k not in Metrics.__dataclass_fields__)
COUNTS = st.integers(0, INT64_MAX)


@PROPERTY
@given(st.builds(
    Metrics, time=FINITE, step=COUNTS, total_steps=COUNTS, phase=st.sampled_from(contract.PHASES), tokens=COUNTS,
    tok_s=OPTIONAL, loss=st.none() | st.floats(-1e15, 1e15), acc=OPTIONAL, accept_len=OPTIONAL, eta_s=OPTIONAL,
    extra=st.dictionaries(EXTRA_KEYS, WRITABLE_JSON, max_size=4),
))
def test_every_line_the_writer_writes_reads_back_equal(m: Metrics) -> None:
    assert read_metrics_line(m.to_line()) == m
