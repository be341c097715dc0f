"""Events as the console lists them: their class, the trainer's first error, the word filter.

``matching`` is the console's one filter (runs, events, log lines).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from dflashctl.core.units import fmt_clock
from dflashctl.store import Event
from dflashctl.supervise.detectors import said_error


@dataclass
class EventView:
    time: float
    run_id: str | None
    kind: str
    severity: str
    message: str
    classification: str = ""
    id: int = 0
    detail: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_event(cls, e: Event) -> "EventView":
        return cls(e.time, e.run_id, e.kind, e.severity, e.message, classify(e), e.id,
                   e.detail if isinstance(e.detail, dict) else {})

    @property
    def first_error(self) -> str | None:
        """The trainer's own first error line behind the event, as it printed it (the
        line its crash signature matched, else the exception of its traceback, else
        the error its status.json named), never the signature's numberless pattern."""
        d = self.detail
        finding = d.get("finding") if isinstance(d.get("finding"), dict) else {}
        for value in (d.get("matched_line"), d.get("exception"), finding.get("matched_line"),
                      finding.get("exception")):
            if isinstance(value, str) and value.strip():
                return value.strip()
        return said_error(d.get("status_error"), d.get("status_message"))

    def cells(self) -> tuple[str, ...]:
        return (fmt_clock(self.time), self.severity, self.classification or self.kind, self.message)


def classify(e: Event) -> str:
    """An event's class for the timeline: its kind, made precise by its detail
    (a state change's target, a crash signature)."""
    detail = e.detail if isinstance(e.detail, dict) else {}
    if e.kind == "state" and detail.get("to"):
        return f"state→{detail['to']}"
    signature = detail.get("signature")
    if signature is None and isinstance(detail.get("finding"), dict):
        signature = detail["finding"].get("signature")
    return f"{e.kind}:{signature}" if signature else e.kind


def matching(items: Sequence[Any], text: str, words_of: Callable[[Any], str]) -> list[Any]:
    """The items whose ``words_of(item)`` contains every word of ``text`` (any case);
    all of them for an empty ``text``. The one filter of the console (runs, events,
    log lines)."""
    words = text.lower().split()
    if not words:
        return list(items)
    return [item for item in items if all(w in words_of(item).lower() for w in words)]


def filter_events(events: Sequence[EventView], text: str) -> list[EventView]:
    """Events whose time, severity, class or message contains every word of ``text``."""
    return matching(events, text, lambda e: " ".join(e.cells()))


FEED = 500  # the newest events of every run the feed across runs lists


def feed(store: Any, limit: int = FEED) -> list[EventView]:
    """The newest ``limit`` events of every run (and of no run: a supervisor's, the
    store's), oldest first, as the console's feed across runs lists them."""
    return [EventView.from_event(e) for e in store.events(limit=limit)]

