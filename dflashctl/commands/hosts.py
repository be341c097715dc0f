"""Commands: hosts."""

from dflashctl.cli import app  # noqa: F401
