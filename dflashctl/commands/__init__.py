"""Command modules; importing this package registers every command on the app."""

from dflashctl.commands import hosts, runs, supervise  # noqa: F401
