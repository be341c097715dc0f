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
