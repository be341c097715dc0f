"""Parsers on real nvidia-smi captures (a test per fixture file), on pane text, and on
hostile host output: malformed rows and lines are refused with a reason, never
raised or glued, and whatever is accepted has the documented types."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflashctl.core import contract
from dflashctl.core.logtext import last_error_start, last_traceback, tail_lines
from dflashctl.hosts.parsers import (
    CLOCK_FIELDS,
    GPU_QUERY_FIELDS,
    ComputeApp,
    GpuReading,
    Rejected,
    parse_compute_apps,
    parse_gpu_query,
    parse_metrics_chunk,
    read_compute_apps,
    read_gpu_query,
    read_metrics_chunk,
    smi_number,
)
from tests.harness import FIXTURES

SMI = FIXTURES / "nvidia-smi"

SEED_FIELDS = ("index", "memory.used", "utilization.gpu")
NA_FIELDS = ("index", "ecc.errors.uncorrected.volatile.total", "fan.speed", "pstate", "clocks_throttle_reasons.active")
IDLE_UUID = "GPU-ee9be14c-3e1f-0e09-1585-ac6bd6c589c0"
LOAD_UUID = "GPU-8a7820b2-30e1-7367-326a-a5d3dfe3b0fd"
TRAINER_UUID = "GPU-b592ecf6-ee08-c729-81ce-cff86e0cf6e2"

# file -> (parser, fields queried, expected rows); the README there says which command made each.
EXPECTED = {
    "h200-idle-query.csv": (
        parse_gpu_query,
        None,
        [GpuReading(0, IDLE_UUID, "NVIDIA H200", 0.0, 143771.0, 0.0, 43.0, 136.29, 700.0, 1980.0)],
    ),
    "h200-load-query.csv": (
        parse_gpu_query,
        None,
        [GpuReading(0, LOAD_UUID, "NVIDIA H200", 1011.0, 143771.0, 100.0, 58.0, 693.45, 700.0, 1440.0)],
    ),
    "h200-idle-seed-query.csv": (parse_gpu_query, SEED_FIELDS, [GpuReading(0, memory_used_mib=0.0, utilization_pct=0.0)]),
    "h200-load-seed-query.csv": (
        parse_gpu_query,
        SEED_FIELDS,
        [GpuReading(0, memory_used_mib=1011.0, utilization_pct=100.0)],
    ),
    # The header names the fields: no field list needed.
    "h200-load-seed-query-header.csv": (
        parse_gpu_query,
        None,
        [GpuReading(0, memory_used_mib=1011.0, utilization_pct=100.0)],
    ),
    "h200-load-na-fields.csv": (
        parse_gpu_query,
        NA_FIELDS,
        [
            GpuReading(
                0,
                extra={
                    "ecc.errors.uncorrected.volatile.total": 0.0,
                    "fan.speed": None,
                    "pstate": "P0",
                    "clocks_throttle_reasons.active": "0x0000000000000004",
                },
            )
        ],
    ),
    "h200-idle-apps.csv": (parse_compute_apps, None, []),
    "h200-load-apps.csv": (parse_compute_apps, None, [ComputeApp(416, "python3", 1002.0, LOAD_UUID)]),
    "h200-trainer-query.csv": (
        parse_gpu_query,
        None,
        [GpuReading(0, TRAINER_UUID, "NVIDIA H200", 90223.0, 143771.0, 100.0, 54.0, 677.19, 700.0, 1965.0)],
    ),
    # Two GPUs under dflashctl's own run (bench/gpu_e2e.sh): target on 0, drafter on 1.
    "h200x2-trainer-query.csv": (
        parse_gpu_query,
        None,
        [GpuReading(0, "GPU-e7247aa6-6306-7c70-9f9d-7e26a3a729ec", "NVIDIA H200", 3217.0, 143771.0, 0.0, 40.0, 253.15,
                    700.0, 1980.0),
         GpuReading(1, "GPU-02d99c92-d576-2ccf-61fe-8d67e57e6956", "NVIDIA H200", 19863.0, 143771.0, 0.0, 41.0, 426.78,
                    700.0, 1980.0)],
    ),
    # The probe's clock query, under a bf16 matmul loop (throttled: SW power cap) and idle.
    "h200-clocks-load.csv": (
        parse_gpu_query,
        CLOCK_FIELDS,
        [GpuReading(0, extra={"clocks.max.sm": 1980.0, "clocks.mem": 3201.0,
                              "clocks_throttle_reasons.active": "0x0000000000000004"})],
    ),
    "h200-clocks-idle.csv": (
        parse_gpu_query,
        CLOCK_FIELDS,
        [GpuReading(0, extra={"clocks.max.sm": 1980.0, "clocks.mem": 3201.0,
                              "clocks_throttle_reasons.active": "0x0000000000000000"})],
    ),
    "h200-trainer-apps.csv": (
        parse_compute_apps,
        None,
        [ComputeApp(2546, "/opt/torch/.venv/bin/python3", 90214.0, TRAINER_UUID)],
    ),
}


@pytest.mark.parametrize("path", sorted(SMI.glob("*.csv")), ids=lambda p: p.name)
def test_capture(path: Path) -> None:
    assert path.name in EXPECTED, f"new capture {path.name}: add its expected rows to EXPECTED"
    parser, fields, expected = EXPECTED[path.name]
    text = path.read_text()
    rows = parser(text, fields) if fields else parser(text)
    assert rows == expected


def test_several_gpus_missing_values_and_units() -> None:
    text = (
        "index, name, memory.used [MiB], utilization.gpu [%], power.draw [W], clocks.current.sm [MHz]\n"
        "0, NVIDIA H200, 81000 MiB, 97 %, 650.12 W, 1980 MHz\n"
        "1, NVIDIA H200, [N/A], [Not Supported], [Unknown Error], 1410 MHz\n"
    )
    gpus = parse_gpu_query(text)
    assert [g.index for g in gpus] == [0, 1]
    assert (gpus[0].memory_used_mib, gpus[0].utilization_pct, gpus[0].power_draw_w, gpus[0].clocks_sm_mhz) == (
        81000.0,
        97.0,
        650.12,
        1980.0,
    )
    assert (gpus[1].memory_used_mib, gpus[1].utilization_pct, gpus[1].power_draw_w) == (None, None, None)
    assert gpus[1].clocks_sm_mhz == 1410.0


def test_error_text_is_not_a_gpu_and_short_rows_are_rejected() -> None:
    failed = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n"
    assert parse_gpu_query(failed) == []
    assert read_gpu_query(failed).rejected == [Rejected(1, "not a CSV row (a message from nvidia-smi?)", failed.strip())]
    assert parse_gpu_query("") == []
    # A row cut off after four fields: "5" may be the start of "5120"; no reading beats a wrong one.
    short = read_gpu_query("3, GPU-x, NVIDIA H100 80GB HBM3, 5\n")
    assert short.rows == [] and [str(r) for r in short.rejected] == ["line 1: 4 fields, expected 10"]


def test_comma_in_a_process_name_stays_in_that_field() -> None:
    apps = parse_compute_apps("77, python, worker, [N/A], GPU-abc\n")
    assert apps == [ComputeApp(77, "python, worker", None, "GPU-abc")]


def test_metrics_chunk_counts_malformed_lines() -> None:
    good = contract.Metrics(time=100.0, step=5, total_steps=10, tok_s=1234.5).to_line()
    future = '{"time": 101, "step": 6, "total_steps": 10, "new_field": 1}'
    chunk = "\n".join([good, "", "{not json", '{"step": 7}', future, "[1,2]"]) + "\n"
    metrics, malformed = parse_metrics_chunk(chunk)
    assert [m.step for m in metrics] == [5, 6]
    assert metrics[0].tok_s == 1234.5 and metrics[1].extra == {"new_field": 1}
    assert malformed == 3
    assert parse_metrics_chunk("") == ([], 0)


def test_metrics_chunk_names_each_rejected_line_and_why() -> None:
    good = contract.Metrics(time=100.0, step=5, total_steps=10).to_line()
    chunk = "\n".join([
        good,
        "[" * 50000,
        '{"time": 1, "step": 9223372036854775808, "total_steps": 10}',
        "",
        '{"time": 1, "step": 6, "total_steps": Infinity}',
        '{"time": 1, "step": 7, "total_steps": 10, "tok_s": "fast"}',
        good,
    ]) + "\n"
    parsed = read_metrics_chunk(chunk)
    assert [m.step for m in parsed.rows] == [5, 5]
    assert [str(r) for r in parsed.rejected] == [
        "line 2: line nests deeper than 32 levels",
        "line 3: step is out of range (9223372036854775808; expected 0..9223372036854775807)",
        "line 5: total_steps is not an integer (inf)",
        "line 6: tok_s is not a number ('fast')",
    ]
    assert parsed.rejected[0].text == "[" * 200  # the start of the line, for the operator
    assert parse_metrics_chunk(chunk) == (parsed.rows, 4)


H200_ROW = "0, GPU-x, NVIDIA H200, 1011, 143771, 100, 58, 693.45, 700.00, 1440"


def test_gpu_cell_of_hundreds_of_digits_is_refused_not_raised() -> None:
    for at in range(len(GPU_QUERY_FIELDS)):
        cells = H200_ROW.split(", ")
        cells[at] = "9" * 400
        query = read_gpu_query(", ".join(cells))
        if GPU_QUERY_FIELDS[at] in ("uuid", "name"):  # text: 400 characters is over the name limit
            assert query.rows == [] and "over the 256 limit" in query.rejected[0].reason
        else:
            assert query.rows == [] and query.rejected[0].reason.startswith(f"{GPU_QUERY_FIELDS[at]} is not a number")
    assert smi_number("9" * 400) is None and smi_number("1" * 309 + " MiB") is None
    apps = read_compute_apps("9" * 400 + ", python3, 1002, GPU-x")
    assert apps.rows == [] and apps.rejected[0].reason.startswith("pid is not a number")


def test_glued_rows_are_refused_not_glued_into_the_name() -> None:
    two_rows_on_one_line = H200_ROW + ", " + H200_ROW.replace("0, ", "1, ", 1)
    query = read_gpu_query(two_rows_on_one_line + "\n" + H200_ROW + "\n")
    assert [g.index for g in query.rows] == [0]
    assert [str(r) for r in query.rejected] == ["line 1: 20 fields, expected 10"]
    assert parse_gpu_query(H200_ROW + ", extra") == []


def test_memory_used_above_total_is_refused() -> None:
    bad = H200_ROW.replace("1011, 143771", "200000, 143771")
    query = read_gpu_query(bad)
    assert query.rows == [] and [str(r) for r in query.rejected] == [
        "line 1: memory.used 200000 MiB exceeds memory.total 143771 MiB"]
    assert parse_gpu_query(H200_ROW.replace("1011, 143771", "143771, 143771"))[0].memory_used_mib == 143771.0


def test_numbers_out_of_range_or_not_numbers_refuse_their_row() -> None:
    cases = {
        "index": ("1.5", "index is not a whole number in 0..65535 ('1.5')"),
        "utilization.gpu": ("101", "utilization.gpu is not a number in 0..100 ('101')"),
        "memory.total": ("-5", "memory.total is not a number in 0..1073741824 ('-5')"),
        "power.draw": ("lots", "power.draw is not a number ('lots')"),
    }
    for name, (cell, reason) in cases.items():
        cells = H200_ROW.split(", ")
        cells[GPU_QUERY_FIELDS.index(name)] = cell
        assert [r.reason for r in read_gpu_query(", ".join(cells)).rejected] == [reason]
    # nvidia-smi's own "no reading" markers stay None in an accepted row.
    na = parse_gpu_query("0, GPU-x, NVIDIA H200, [N/A], [Not Supported], N/A, [Unknown Error], , [N/A], [N/A]")
    assert na == [GpuReading(0, "GPU-x", "NVIDIA H200")]


def test_compute_apps_rows_are_checked() -> None:
    apps = read_compute_apps("416, python3, 1002, GPU-x\n417, python3\n-3, python3, 5, GPU-x\n418, p, 1.5e3, GPU-x\n")
    assert apps.rows == [ComputeApp(416, "python3", 1002.0, "GPU-x")]
    assert [str(r) for r in apps.rejected] == [
        "line 2: 2 fields, expected 4",
        "line 3: pid is not a whole number in 0..2147483647 ('-3')",
        "line 4: used_memory is not a number ('1.5e3')",
    ]


OOM_PANE = """\
step 1200 loss 2.31 12.8 Ktok/s
Traceback (most recent call last):
  File "/opt/trainer/__main__.py", line 40, in <module>
    main()
  File "/opt/trainer/loop.py", line 212, in step
    loss.backward()
    ^^^^^^^^^^^^^^^
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 139.72 GiB

[dflash] trainer exited with status 1
"""

CHAINED = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "a.py", line 1, in <module>
[rank0]: KeyError: 'x'
[rank0]:
[rank0]: During handling of the above exception, another exception occurred:
[rank0]:
[rank0]: Traceback (most recent call last):
[rank0]:   File "a.py", line 3, in <module>
[rank0]: RuntimeError: CUDA error: an illegal memory access was encountered
[rank0]: CUDA kernel errors might be asynchronously reported at some other API call.
"""


def test_last_traceback() -> None:
    tb = last_traceback(OOM_PANE)
    assert tb.exception.startswith("torch.OutOfMemoryError: CUDA out of memory")
    assert tb.text.startswith("Traceback (most recent call last):") and "loss.backward()" in tb.text
    assert tb.lines_after == 1  # the wrapper's exit line

    chained = last_traceback(CHAINED)
    assert chained.exception == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert "asynchronously reported" in chained.text and "KeyError" not in chained.text
    assert chained.lines_after == 0

    cut = last_traceback('Traceback (most recent call last):\n  File "x.py", line 1\n')
    assert cut.exception == "" and cut.lines_after == 0
    assert last_traceback("all good\n") is None and last_traceback(None) is None


def test_last_error_start_includes_the_whole_chain() -> None:
    text = "warming up\n" + CHAINED
    assert text[last_error_start(text) :] == CHAINED  # from the chain's first traceback, its line prefix kept
    later = text + "\nok\n" + OOM_PANE
    assert later[last_error_start(later) :] == OOM_PANE[OOM_PANE.index("Traceback") :]
    assert last_error_start("no errors\n") is None and last_error_start(None) is None


def test_tail_lines_drops_empty_pane_rows() -> None:
    assert tail_lines("a\nb\nc\n\n\n   \n", 2) == "b\nc"
    assert tail_lines("a\nb", 10) == "a\nb"
    assert tail_lines(None, 3) == "" and tail_lines("a", 0) == ""


# --------------------------------------------------------------------------- properties

PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HUGE = st.sampled_from(["9" * 309, "9" * 400, "1" * 5000, "1e400", "-" + "9" * 400, "inf", "nan", "NaN MiB"])
CELLS = (
    st.sampled_from(["0", "1011", "143771", "100 %", "693.45 W", "[N/A]", "[Not Supported]", "N/A", "",
                     "NVIDIA H200", "GPU-x", "python3", "1980 MHz", "P0", "0x04", "-1", "1.5"])
    | HUGE
    | st.integers().map(str)
    | st.floats().map(str)
    | st.text(max_size=12)
)
ROWS = st.lists(st.lists(CELLS, min_size=0, max_size=14).map(", ".join), max_size=6).map("\n".join)
ANY_SMI_TEXT = ROWS | st.text()


def _check_rejected(parsed, text: str) -> None:
    lines = text.splitlines()
    for r in parsed.rejected:
        assert type(r.line) is int and 1 <= r.line <= len(lines) and type(r.reason) is str and r.reason
        assert len(r.text) <= 200
    assert len(parsed.rows) + len(parsed.rejected) <= sum(1 for l in lines if l.strip())


def _number_or_none(value, low=-math.inf, high=math.inf) -> bool:
    return value is None or (type(value) is float and math.isfinite(value) and low <= value <= high)


@PROPERTY
@given(ANY_SMI_TEXT)
def test_any_gpu_query_text(text: str) -> None:
    parsed = read_gpu_query(text)
    _check_rejected(parsed, text)
    for g in parsed.rows:
        assert g.index is None or (type(g.index) is int and 0 <= g.index <= 65535)
        assert all(v is None or (type(v) is str and len(v) <= 256) for v in (g.uuid, g.name))
        assert _number_or_none(g.memory_used_mib, 0) and _number_or_none(g.memory_total_mib, 0)
        assert _number_or_none(g.utilization_pct, 0, 100) and _number_or_none(g.temperature_c)
        assert all(_number_or_none(v, 0) for v in (g.power_draw_w, g.power_limit_w, g.clocks_sm_mhz))
        if g.memory_used_mib is not None and g.memory_total_mib is not None:
            assert g.memory_used_mib <= g.memory_total_mib
        assert all(v is None or type(v) is str or _number_or_none(v) for v in g.extra.values())
    assert parse_gpu_query(text) == parsed.rows


@PROPERTY
@given(ANY_SMI_TEXT)
def test_any_compute_apps_text(text: str) -> None:
    parsed = read_compute_apps(text)
    _check_rejected(parsed, text)
    for a in parsed.rows:
        assert a.pid is None or (type(a.pid) is int and 0 <= a.pid < 2**31)
        assert _number_or_none(a.used_memory_mib, 0)
        assert all(v is None or type(v) is str for v in (a.process_name, a.gpu_uuid))
    assert parse_compute_apps(text) == parsed.rows


BIG_INTS = st.sampled_from([2**63 - 1, 2**63, -(2**63) - 1, 10**308, 10**400])
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | BIG_INTS | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
METRIC_LINES = (
    st.dictionaries(st.sampled_from(["time", "step", "total_steps", "tok_s", "phase", "loss", "v", "x"]),
                    JSON_VALUES | st.sampled_from(contract.PHASES), max_size=8).map(json.dumps)
    | JSON_VALUES.map(json.dumps)
    | st.text()
    | st.integers(0, 3000).map(lambda n: "[" * n)
)


@PROPERTY
@given(st.lists(METRIC_LINES, max_size=6).map("\n".join) | st.text())
def test_any_metrics_chunk(text: str) -> None:
    parsed = read_metrics_chunk(text)
    lines = text.split("\n")
    for m in parsed.rows:
        assert isinstance(m, contract.Metrics) and type(m.step) is int and type(m.total_steps) is int
        assert type(m.time) is float and math.isfinite(m.time)
        assert all(_number_or_none(v) for v in (m.tok_s, m.loss, m.acc, m.accept_len, m.eta_s))
    for r in parsed.rejected:
        assert 1 <= r.line <= len(lines) and lines[r.line - 1].strip() and r.reason
    assert len(parsed.rows) + len(parsed.rejected) == sum(1 for l in lines if l.strip())
    assert parse_metrics_chunk(text) == (parsed.rows, len(parsed.rejected))


@PROPERTY
@given(st.none() | st.text() | st.lists(st.sampled_from([OOM_PANE, CHAINED, "Traceback (most recent call last):",
                                                          "  File", "x", "", "[rank0]: ", "\r"])).map("\n".join),
       st.integers(-5, 10**6) | BIG_INTS)
def test_any_pane_text(text, n) -> None:
    tail = tail_lines(text, n)
    assert type(tail) is str and (n <= 0 or not text or tail.splitlines() == text.rstrip().splitlines()[-n:])
    tb = last_traceback(text)
    assert tb is None or (type(tb.text) is str and type(tb.exception) is str and type(tb.lines_after) is int)
    start = last_error_start(text)
    assert start is None or (type(start) is int and 0 <= start <= len(text))
