"""Parsers on real nvidia-smi captures (a test per fixture file) and on pane text."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflashctl import contract
from dflashctl.parsers import (
    ComputeApp,
    GpuReading,
    last_error_start,
    last_traceback,
    parse_compute_apps,
    parse_gpu_query,
    parse_metrics_chunk,
    tail_lines,
)

SMI = Path(__file__).parent / "fixtures" / "nvidia-smi"

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


def test_error_text_is_not_a_gpu_and_short_rows_are_padded() -> None:
    failed = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n"
    assert parse_gpu_query(failed) == []
    assert parse_gpu_query("") == []
    short = parse_gpu_query("3, GPU-x, NVIDIA H100 80GB HBM3, 5\n")
    assert short[0].index == 3 and short[0].name == "NVIDIA H100 80GB HBM3" and short[0].memory_used_mib == 5.0
    assert short[0].memory_total_mib is None and short[0].clocks_sm_mhz is None


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
