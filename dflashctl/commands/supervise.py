"""Commands: supervise."""

from dflashctl.cli import app  # noqa: F401
