"""Commands: runs."""

from dflashctl.cli import app  # noqa: F401
