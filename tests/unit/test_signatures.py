"""Crash classification: every shipped signature on a realistic error text."""

from __future__ import annotations

import pytest

from dflashctl.core import contract
from dflashctl.core.signatures import BUILTIN_SIGNATURES, Evidence, PlaybookSignature, classify, signature_names
from tests.harness import FIXTURES, REPO

FX_RACE = """\
  File "/usr/lib/python3/dist-packages/torch/_dynamo/eval_frame.py", line 838, in _fn
    return fn(*args, **kwargs)
RuntimeError: Detected that you are using FX to symbolically trace a dynamo-optimized function. This is not supported at the moment.
"""
CUDA_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of "
    "139.72 GiB of which 3.12 GiB is free. Including non-PyTorch memory, this process has 136.59 GiB memory in use."
)
NCCL = (
    "[rank1]:[E1129 10:21:33.123 ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective operation timeout: "
    "WorkNCCL(SeqNum=4821, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600039 milliseconds "
    "before timing out."
)
# The trainer's own report when a peer of a multi-host run died (tests/e2e/test_multihost.py).
RANK_FAILED = ("error: DistributedError: all_reduce failed on rank 0 after step 9: rank 1 on target failed first "
               "(its heartbeat stopped); torch: RuntimeError: [../gloo/transport/tcp/pair.cc:534] Read error")
MISSING_LIB = (
    "Traceback (most recent call last):\n"
    '  File "/opt/trainer/__main__.py", line 3, in <module>\n'
    "    import torch\n"
    "ImportError: libcudnn.so.9: cannot open shared object file: No such file or directory\n"
)
CUDNN = (
    "RuntimeError: cuDNN version incompatibility: PyTorch was compiled  against (9, 1, 0) but found runtime "
    "version (8, 9, 7). PyTorch already comes bundled with cuDNN."
)
CUDNN_SUB = "Could not load symbol cudnnGetVersion: cuDNN sublibrary version mismatch: libcudnn_ops.so.9 9.1.0 vs 8.9.7"
IMPORT = "ModuleNotFoundError: No module named 'transformers'"
DISK = "OSError: [Errno 28] No space left on device: '/root/dflash/runs/prod/checkpoints/step-00012000/model.pt'"
XID = "NVRM: Xid (PCI:0000:00:06): 79, pid=4183, GPU has fallen off the bus."
ECC = "RuntimeError: CUDA error: uncorrectable ECC error encountered"
SEGV = "Fatal Python error: Segmentation fault\n\nThread 0x00007f3a (most recent call first):\n  File \"x.py\", line 1"
KILLED = "step 400 loss 2.1\nKilled\n"
# Captured on an H200: the trainer with its compile discipline switched off (see the README there).
FX_RACE_H200 = (FIXTURES / "trainer-logs" / "h200-fx-race-tail.txt").read_text()
FX_RACE_H200_STATUS = ("RuntimeError: Detected that you are using FX to symbolically trace a dynamo-optimized function. "
                       "This is not supported at the moment.")
LOGS = FIXTURES / "trainer-logs"
# Captured (tests/fixtures/trainer-logs/README.md says how): real torch and trainer output.
RECOMPILE_CPU = (LOGS / "cpu-fail-on-recompile.txt").read_text()
RECOMPILE_H200 = (LOGS / "h200-soak-recompile.txt").read_text()
RECOMPILE_LIMIT = (LOGS / "cpu-recompile-limit.txt").read_text()
EAGER_FLEX = (LOGS / "cpu-eager-flex-fallback.txt").read_text()
NAN_LOSS = (LOGS / "cpu-nan-loss.txt").read_text()


def cuda_errors() -> list[tuple[str, str]]:
    """(signature, text) blocks of cuda-errors.txt."""
    blocks, name = [], None
    for line in (LOGS / "cuda-errors.txt").read_text().splitlines():
        if line.startswith("# name: "):
            name = line.removeprefix("# name: ").strip()
            blocks.append((name, ""))
        elif name:
            blocks[-1] = (name, blocks[-1][1] + line + "\n")
    return blocks


# What rank 0 prints when another process holds the rendezvous port (trainer/rendezvous.py), and
# torch's own line for it; what rank 1 prints when the process at the address is not this run's.
PORT_IN_USE = ("error: RendezvousError: rendezvous port 29500 on this host is in use by another process (EADDRINUSE): "
               "this run's rank 0 cannot listen on it.")
PORT_IN_USE_TORCH = ("torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
                     "address. port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use")
REFUSED = ("error: RendezvousError: rank 0 at the rendezvous 127.0.0.1:29500 did not prove this start's secret "
           "(rendezvous.key): it is not this run's process")

# (text, status error, exit code) -> expected signature name; one or more per shipped entry.
CASES = [
    (FX_RACE, None, 1, "fx_race"),
    (FX_RACE_H200, FX_RACE_H200_STATUS, 1, "fx_race"),
    (FX_RACE_H200, None, 1, "fx_race"),
    (CUDA_OOM, None, 1, "cuda_oom"),
    ("", "OutOfMemoryError: CUDA out of memory. Tried to allocate N.N GiB", None, "cuda_oom"),
    (NCCL, None, -6, "nccl_timeout"),
    (RANK_FAILED, None, 1, "rank_failed"),
    (PORT_IN_USE, None, 1, "rendezvous_port_in_use"),
    (PORT_IN_USE_TORCH, None, 1, "rendezvous_port_in_use"),
    (REFUSED, None, 1, "rendezvous_refused"),
    (MISSING_LIB, None, 1, "missing_shared_library"),
    (CUDNN, None, 1, "cudnn_version_mismatch"),
    (CUDNN_SUB, None, 1, "cudnn_version_mismatch"),
    (IMPORT, None, 1, "import_error"),
    (DISK, None, 1, "disk_full"),
    (XID, None, None, "xid"),
    (ECC, None, 1, "xid"),
    (SEGV, None, 139, "segfault"),
    ("", None, 139, "segfault"),
    (KILLED, None, None, "killed_by_signal"),
    ("", None, 137, "killed_by_signal"),
    ("error: RunDirBusy: run directory /w/r is owned by another trainer (pid 7, lock trainer.lock)", None,
     contract.EXIT_RUN_DIR_BUSY, "run_dir_busy"),
    ("", None, contract.EXIT_RUN_DIR_BUSY, "run_dir_busy"),
    ("ValueError: shard 3 is truncated", None, contract.EXIT_DATA_ERROR, "data_error"),
    ("trainer.model.preset: unknown", None, contract.EXIT_CONFIG_ERROR, "config_error"),
    (RECOMPILE_CPU, None, 1, "recompile_after_warmup"),
    (RECOMPILE_H200, None, 1, "recompile_after_warmup"),
    ("", RECOMPILE_H200.strip(), 1, "recompile_after_warmup"),
    (RECOMPILE_LIMIT, None, 1, "recompile_limit"),
    (EAGER_FLEX, None, 1, "eager_flex_fallback"),
    (NAN_LOSS, "FloatingPointError: loss is nan at step 2 (replica 0, batch 1)", 1, "nan_loss"),
    ("torch._dynamo.exc.GuardOnDataDependentSymNode: Could not guard on data-dependent expression u0 > 3",
     None, 1, "compile_guard"),
    *[(text, None, 1, name) for name, text in cuda_errors()],
    ("RuntimeError: something new", None, 1, "unknown"),
    ("", None, None, "unknown"),
]


@pytest.mark.parametrize("text,status_error,exit_code,expected", CASES, ids=[c[3] + f"-{i}" for i, c in enumerate(CASES)])
def test_shipped_signatures(text, status_error, exit_code, expected) -> None:
    assert classify(text, status_error, exit_code).name == expected


def test_every_shipped_signature_has_a_case() -> None:
    assert {s.name for s in BUILTIN_SIGNATURES} | {"unknown"} == {c[3] for c in CASES}


def test_classification_carries_action_severity_hint_and_line() -> None:
    c = classify("step 10\n" + MISSING_LIB + "[dflash] exit 1\n", None, 1)
    assert (c.action, c.severity) == ("stop", "critical")
    assert c.matched_line == "ImportError: libcudnn.so.9: cannot open shared object file: No such file or directory"
    assert "libcudnn" in c.hint
    fx = classify(FX_RACE, None, 1)
    assert fx.action == "restart_serialized" and fx.matched_line.startswith("RuntimeError: Detected that you are using FX")
    assert classify("", None, 137).matched_line == "exit code 137 (killed by signal 9)"
    unknown = classify("x", None, 1)
    assert (unknown.action, unknown.matched_line) == ("restart", None)


def test_order_matters() -> None:
    # An OOM inside an NCCL error report is an OOM (stop), not a timeout (restart).
    assert classify(NCCL + "\n" + CUDA_OOM).name == "cuda_oom"
    # A missing library surfaces as an ImportError: the library is the cause.
    assert classify(MISSING_LIB).name == "missing_shared_library"
    # Text evidence beats the bare exit code: a segfault's text with exit 137 is a segfault.
    assert classify(SEGV, None, 137).name == "segfault"
    # The last occurrence is reported (nearest the crash).
    c = classify("ModuleNotFoundError: No module named 'a'\nok\nModuleNotFoundError: No module named 'b'\n")
    assert c.matched_line.endswith("'b'")


def test_only_the_last_error_report_decides() -> None:
    warning = "ImportError: flash_attn is not installed; using the reference attention\n"
    crash = 'Traceback (most recent call last):\n  File "loop.py", line 9\nRuntimeError: CUDA error: an illegal memory access\n'
    # A stale warning above the fatal traceback must not turn a restart into a stop.
    assert classify(warning + "step 10 ok\n" + crash, None, 1).name == "unknown"
    assert classify(warning + "step 10 ok\n", None, 1).name == "import_error"  # no traceback: everything counts
    # The whole chain counts: the cause is in the first traceback of it.
    chained = (
        'Traceback (most recent call last):\n  File "step.py", line 3\n'
        f"{CUDA_OOM}\n\nThe above exception was the direct cause of the following exception:\n\n"
        + crash.replace("CUDA error: an illegal memory access", "drafter step failed")
    )
    c = classify(warning + chained, None, 1)
    assert (c.name, c.matched_line) == ("cuda_oom", CUDA_OOM)
    # The status error line (the trainer's own account) is always searched.
    assert classify(warning + crash, "OutOfMemoryError: CUDA out of memory. Tried to allocate N GiB", 1).name == "cuda_oom"


def test_playbook_signatures_come_first() -> None:
    extra = [
        PlaybookSignature(name="flaky_fs", pattern=r"Stale file handle", action="restart", severity="warning", hint="NFS"),
        PlaybookSignature(name="our_oom", pattern=r"CUDA out of memory", action="restart_serialized"),
    ]
    c = classify(CUDA_OOM, None, 1, extra)
    assert (c.name, c.action, c.severity) == ("our_oom", "restart_serialized", "error")
    c = classify("OSError: [Errno 116] Stale file handle", None, 1, extra)
    assert (c.name, c.action, c.severity, c.hint) == ("flaky_fs", "restart", "warning", "NFS")
    assert classify(DISK, None, 1, extra).name == "disk_full"  # the table still applies
    assert signature_names(extra)[:3] == ["flaky_fs", "our_oom", "fx_race"]
    assert signature_names()[-1] == "unknown"


def test_the_readme_lists_every_shipped_signature() -> None:
    """The signature table of the reference the README links (docs/playbooks.md)."""
    table = (REPO / "docs" / "playbooks.md").read_text()
    missing = [name for name in signature_names() if f"`{name}`" not in table]
    assert not missing, f"docs/playbooks.md's signature table lacks {missing}"


# --------------------------------------------------------------------------- the host's word besides the output

FULL = Evidence(run_dir="/w/runs/r1", disk_free=0, disk_total=1 << 20)


@pytest.mark.parametrize("text,exit_code,evidence,expected", [
    ("step 3\nOSError: [Errno 28] No sp", None, FULL, "disk_full"),  # the log cut by the full disk
    ("", None, FULL, "disk_full"),  # nothing in the log at all
    (CUDA_OOM, 1, FULL, "disk_full"),  # a restart would fail the same way, whatever the output says
    ("step 3\n", contract.EXIT_DISK_FULL, None, "disk_full"),  # the trainer's exit code says it
    ("step 3\n", None, Evidence(disk_free=200 << 20, disk_total=100 << 30), "unknown"),  # room left
    ("step 3\n", None, Evidence(disk_free=10 << 20, disk_total=100 << 30), "disk_full"),  # under 64 MiB
    ("step 3\n", None, Evidence(disk_free=20 << 20, disk_total=1 << 30), "unknown"),  # above 1% of a small disk
    ("", 137, Evidence(oom_kills=1), "host_oom"),
    ("step 3\nKilled\n", None, Evidence(oom_kills=2), "host_oom"),
    ("", 137, Evidence(oom_kills=0), "killed_by_signal"),  # SIGKILL, but not the kernel's
    ("", 137, Evidence(oom_kills=None), "killed_by_signal"),  # the kernel's count unreadable
    (CUDA_OOM, 1, Evidence(oom_kills=1), "cuda_oom"),  # the output names another cause
    ("step 3\n", None, Evidence(tmux_server_gone=True), "tmux_server_gone"),
    ("step 3\n", 1, Evidence(tmux_server_gone=True), "unknown"),  # it wrote an exit code: not the server's end
    ("step 3\n", None, Evidence(tmux_server_gone=False), "unknown"),
])
def test_the_hosts_word_names_what_the_output_cannot(text, exit_code, evidence, expected) -> None:
    assert classify(text, None, exit_code, evidence=evidence).name == expected


def test_a_full_disk_names_the_directory_its_free_space_and_the_fix() -> None:
    c = classify("step 3\nNo sp", None, None, evidence=FULL)
    assert (c.action, c.severity) == ("stop", "critical")
    assert "/w/runs/r1 has 0 B free of 1 MiB" in c.hint and "then `dflashctl restart RUN`" in c.hint
    assert c.matched_line == "free disk: /w/runs/r1 has 0 B free of 1 MiB"
    later = classify(DISK, None, 1, evidence=Evidence(run_dir="/w", disk_free=5 << 30, disk_total=100 << 30))
    assert later.name == "disk_full" and "ran out of space; /w has 5 GiB free of 100 GiB now" in later.hint


def test_a_playbook_signature_still_comes_before_the_hosts_word() -> None:
    extra = [PlaybookSignature(name="ours", pattern=r"No sp", action="restart")]
    assert classify("No sp", None, None, extra, evidence=FULL).name == "ours"
