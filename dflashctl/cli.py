"""The `dflashctl` command line: thin commands over library functions.

Each command module under ``dflashctl/commands/`` registers its commands on the
shared ``app`` (``dflashctl/commands/_app.py``); this module imports them all and
holds ``main``, the console-script entry point. A command parses options, calls
one library function, and turns a ``DflashError`` into a clean message
(tracebacks only with DFLASHCTL_DEBUG=1).

Nothing may import this module but the entry points (``dflashctl.__main__``, the
console script): a command importing it would close an import circle.
"""

from __future__ import annotations

import os
import sys

from dflashctl.commands._app import app, err, fail
from dflashctl.errors import DflashError


def _load_commands() -> None:
    """Register every command on ``app`` (each module's decorators do it on import)."""
    from dflashctl.commands import audit, hosts, runs, status, supervise  # noqa: F401


def main() -> None:
    _load_commands()
    try:
        app()
    except DflashError as e:
        if os.environ.get("DFLASHCTL_DEBUG"):
            raise
        raise SystemExit(fail(e).exit_code) from None
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
