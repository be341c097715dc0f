"""Problems in the user's terms: each names its YAML path and the closest valid name.

pydantic's validation errors become one line each here (``_translate``, then
``_lines``), never pydantic's own text. Validators raise ``_Problems`` to name
fields below the value they check, so a model-level check still names the field.
"""

from __future__ import annotations

import re
import typing
from typing import Annotated, Any, Union

from pydantic import BaseModel, ValidationError

from dflashctl.core.contract import did_you_mean
from dflashctl.core.units import describe, number_text


class _Problems(ValueError):
    """Raised by validators to report problems at paths *below* the value being validated.

    Each item is (relative path, message); the path is joined to the location pydantic
    reports, so a model-level check can still name the exact field.
    """

    def __init__(self, items: list[tuple[str, str]]):
        self.items = items
        super().__init__("; ".join(f"{p}: {m}" if p else m for p, m in items))


def _join(base: str, rel: str) -> str:
    if not rel:
        return base
    if not base or rel.startswith("["):
        return base + rel
    return f"{base}.{rel}"


def _loc_path(loc: tuple) -> str:
    path = ""
    for part in loc:
        path = _join(path, f"[{part}]" if isinstance(part, int) else str(part))
    return path


def _unwrap(tp: Any) -> Any:
    """Strip Annotated[...] and Optional[...] down to the type that holds the value."""
    while True:
        origin = typing.get_origin(tp)
        if origin is Annotated:
            tp = typing.get_args(tp)[0]
            continue
        if origin is Union or type(tp).__name__ == "UnionType":
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) == 1:
                tp = args[0]
                continue
        return tp


def _type_at(root: Any, loc: tuple) -> Any:
    """The declared type at a pydantic error location (for key and choice suggestions)."""
    tp = root
    for part in loc:
        tp = _unwrap(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            field = tp.model_fields.get(str(part))
            if field is None:
                return None
            tp = field.annotation
        elif typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
        elif typing.get_origin(tp) is list:
            tp = typing.get_args(tp)[0]
        else:
            return None
    return _unwrap(tp)


# Filled in by the loader, not written in YAML: Host.name (its key), Playbook.name/source.
_DERIVED_KEYS = {"Host": ("name", "ssh_config"), "Playbook": ("name", "source")}


def _user_keys(model: type[BaseModel]) -> list[str]:
    """Keys a YAML file may set (suggestions never propose the derived ones)."""
    derived = _DERIVED_KEYS.get(model.__name__, ())
    return [k for k in model.model_fields if k not in derived]


_EXPECTED = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "a whole number",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "list_type": "a list",
}

_BOUNDS = {
    "greater_than": ("gt", "must be greater than"),
    "greater_than_equal": ("ge", "must be at least"),
    "less_than": ("lt", "must be less than"),
    "less_than_equal": ("le", "must be at most"),
}


def _translate(error: ValidationError, root: type[BaseModel], prefix: tuple = ()) -> list[tuple[str, str, str]]:
    """pydantic errors -> (path, kind, message) in the user's terms, never pydantic's text."""
    out = []
    for e in error.errors():
        loc, kind, value, ctx = tuple(e["loc"]), e["type"], e.get("input"), e.get("ctx") or {}
        path = _loc_path(prefix + loc)
        if kind == "extra_forbidden":
            parent = _type_at(root, loc[:-1])
            keys = _user_keys(parent) if isinstance(parent, type) and issubclass(parent, BaseModel) else []
            out.append((path, kind, f"unknown key{did_you_mean(loc[-1], keys)}"))
        elif kind == "missing":
            out.append((path, kind, "required"))
        elif kind == "literal_error":
            choices = typing.get_args(_type_at(root, loc))
            listed = ", ".join(repr(c) for c in choices) or ctx.get("expected", "")
            out.append((path, kind, f"{describe(value)} is not one of {listed}{did_you_mean(value, choices)}"))
        elif kind in _BOUNDS:
            key, words = _BOUNDS[kind]
            out.append((path, kind, f"{words} {number_text(ctx.get(key))}, got {describe(value)}"))
        elif kind in _EXPECTED:
            out.append((path, kind, f"expected {_EXPECTED[kind]}, got {describe(value)}"))
        elif kind in ("value_error", "assertion_error"):
            exc = ctx.get("error")
            if isinstance(exc, _Problems):
                out.extend((_join(path, rel), kind, msg) for rel, msg in exc.items)
            else:
                out.append((path, kind, str(exc) if exc is not None else e["msg"]))
        else:  # a rare pydantic check with no wording of ours: its short message is still clear
            out.append((path, kind, e["msg"]))
    return out


def _lines(found: list[tuple[str, str, str]]) -> list[str]:
    """Problem lines, dropping "X: required" when a misspelt key already points at X."""
    suggested = set()
    for path, kind, msg in found:
        m = re.search(r"did you mean '([^']+)'\?", msg)
        if kind == "extra_forbidden" and m:
            suggested.add(_join(path.rsplit(".", 1)[0] if "." in path else "", m.group(1)))
    lines = []
    for path, kind, msg in found:
        if kind in ("missing", "required") and path in suggested:
            continue
        line = f"{path}: {msg}" if path else msg
        if line not in lines:
            lines.append(line)
    return lines

