"""Run ids: sortable by creation time, and valid as tmux session names."""

from __future__ import annotations

import re
import secrets
import time

_SLUG = re.compile(r"[^A-Za-z0-9_-]+")


def new_run_id(playbook: str, now: float) -> str:
    """``<playbook>-YYYYMMDD-HHMMSS-xxxx`` (UTC): sortable, and a valid tmux session name."""
    slug = _SLUG.sub("-", playbook).strip("-") or "run"
    return f"{slug}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(now))}-{secrets.token_hex(2)}"
