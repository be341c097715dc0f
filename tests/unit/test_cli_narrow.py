"""Every command's exit codes are in the reference (docs/commands.md). (The commands
in a narrow terminal: tests/integration/test_cli_narrow.py.)"""

from __future__ import annotations

from tests.harness.local import REPO

LONG_REASON = ("crash: CUDA out of memory while allocating 2.00 GiB on GPU 0 (139.8 GiB total, 137.9 GiB in use); "
               "lower data.batch_size or the largest bucket, then launch again")
MULTILINE = "Traceback (most recent call last):\n  File \"trainer/run.py\", line 9\nRuntimeError: shard 7 is corrupt"


def test_the_docs_give_every_commands_exit_codes():
    """Scripts gate on exit codes: each command has its row in the table of docs/commands.md."""
    import re

    from dflashctl.cli import _load_commands
    from dflashctl.commands._app import app

    _load_commands()
    text = (REPO / "docs" / "commands.md").read_text()
    table = text[text.index("## Exit codes"):]
    table = table[: table.index("\n\n", table.index("| command | 0 |"))]
    named = set(re.findall(r"`([a-z-]+)`", "\n".join(line.split("|")[1] for line in table.splitlines()
                                                    if line.startswith("| `"))))
    commands = {c.name for c in app.registered_commands} | {g.name for g in app.registered_groups}
    assert commands <= named, commands - named


def test_at_80_columns_the_stream_keeps_each_lines_key_figures_and_its_result_whole():
    """Defect: at 80 columns the README's first command (`launch demo --foreground`)
    cut every metrics line before τ est, and cut its final result line (the eval's
    measured tau). A narrow metrics line now gives up the phase when it is plain
    training, the run id's head, the accuracy, the ETA, the throughput, in that
    order; an event gives up its run id's head; a result is never cut."""
    from dflashctl.core import contract
    from dflashctl.store import Event
    from dflashctl.supervise.console import format_line

    run_id = "demo-20261203-175522-d036"
    m = contract.Metrics(time=1_796_319_000.0, step=300, total_steps=300, tok_s=1234.5, loss=0.04321, acc=0.912,
                         accept_len=6.69, eta_s=0.0)
    whole = format_line("metrics", (run_id, m))
    assert len(whole) > 80 and "training" in whole and run_id in whole  # piped: everything
    for width in (80, 72, 60):
        line = format_line("metrics", (run_id, m), width)
        assert len(line) <= width and "…" not in line.replace("…d036", ""), line  # figures dropped, never cut
        assert "step 300/300" in line and "τ est 7.69" in line and "loss 0.0432" in line and "d036" in line
    assert "ETA 0 s" in format_line("metrics", (run_id, m), 80)  # at 80 only the phase and the accuracy go
    said = ("measured tau 7.94 (τ est 7.71, accept_len + 1) at step 300, 4.13x greedy decoding, output identical "
            "to greedy")
    result = format_line("event", Event(1, run_id, m.time, "eval", "info", said, {}), 80)
    assert said in result  # folded by the terminal, never cut
    crash = format_line("event", Event(2, run_id, m.time, "crash", "error", LONG_REASON, {}), 80)
    assert len(crash) == 80 and "…d036" in crash and crash.endswith("…")
