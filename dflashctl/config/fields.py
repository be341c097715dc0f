"""Value types the inventory and playbook models share: durations, environment maps, empty sections.

YAML says ``45s`` or ``OMP_NUM_THREADS: 4``, or leaves a section empty; these
turn such values into what the models hold, and name what is wrong otherwise.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator

from dflashctl.config.problems import _Problems
from dflashctl.core.units import describe, number_text, parse_duration

Duration = Annotated[float, BeforeValidator(parse_duration)]
"""Seconds, as a float; YAML may say 600, '45s', '30m', '36h', '7d'."""

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ENV_NAME_PROBLEM = "not a valid environment variable name (letters, digits and '_', not starting with a digit)"


def _none_is_empty(factory):
    """An empty YAML section (``env:`` with nothing under it) means the defaults."""

    def convert(value: Any) -> Any:
        return factory() if value is None else value

    return BeforeValidator(convert)


def _env_values(value: Any) -> Any:
    """Environment values are text; YAML turns `OMP_NUM_THREADS: 4` into a number."""
    if not isinstance(value, dict):
        return value
    out, bad = {}, []
    for k, v in value.items():
        if not _ENV_NAME.fullmatch(str(k)):
            # Names go into `export NAME=...` lines in run.sh and on each command's stdin to the host.
            bad.append((str(k), ENV_NAME_PROBLEM))
            continue
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            v = number_text(v)
        elif not isinstance(v, str):
            bad.append((str(k), f"expected a string, got {describe(v)} (quote the value)"))
        out[str(k)] = v
    if bad:
        raise _Problems(bad)
    return out


EnvMap = Annotated[dict[str, str], BeforeValidator(_env_values), _none_is_empty(dict)]
