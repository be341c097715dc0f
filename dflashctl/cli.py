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
from dflashctl.core.errors import DflashError

# Shown at the end of each command's --help (RUN: a run id or its first characters).
EXAMPLES = {
    "launch": ["dflashctl launch demo --foreground", "dflashctl launch prod --dry-run", "dflashctl launch prod"],
    "watch": ["dflashctl watch prod", "dflashctl watch RUN --interval 30s", "dflashctl watch RUN --once --json"],
    "status": ["dflashctl status", "dflashctl status --once", "dflashctl status RUN --json"],
    "env-audit": ["dflashctl env-audit prod", "dflashctl env-audit gpu1 --json --deep"],
    "runs": ["dflashctl runs", "dflashctl runs --playbook prod --all --json"],
    "events": ["dflashctl events RUN", "dflashctl events RUN --json"],
    "logs": ["dflashctl logs RUN -n 200", "dflashctl logs RUN -f"],
    "stop": ["dflashctl stop RUN", "dflashctl stop RUN --timeout 300"],
    "restart": ["dflashctl restart RUN", "dflashctl restart RUN --serialized-warmup"],
    "hosts": ["dflashctl hosts", "dflashctl --inventory other.yaml hosts"],
    "check": ["dflashctl check", "dflashctl check gpu1 --json"],
    "trust": ["dflashctl trust gpu1", "dflashctl trust gpu1 --yes"],
    "eval": ["dflashctl eval RUN", "dflashctl eval RUN --prompts 4 --json", "dflashctl eval RUN --timeout 2m --threads 1"],
    "advise": ["dflashctl advise RUN", "dflashctl advise RUN --gpus 8 --json"],
}


def _load_commands() -> None:
    """Register every command on ``app`` (each module's decorators do it on import),
    each with its examples."""
    from dflashctl.commands import advise, audit, cache, hosts, runs, status, store, supervise  # noqa: F401

    for command in app.registered_commands:
        name = command.name or command.callback.__name__.replace("_", "-")
        if name in EXAMPLES and not command.epilog:
            command.epilog = "\b\nExamples:\n" + "\n".join(f"  {line}" for line in EXAMPLES[name])


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
