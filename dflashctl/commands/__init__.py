"""Command modules; importing this package registers every command on the app."""

from dflashctl.commands import audit, hosts, runs, status, supervise  # noqa: F401
