"""A crash read from status.json opens with the trainer's own words, not its
signature's. (The console's attention over real stores:
tests/integration/test_tui_attention.py.)"""

from __future__ import annotations

from tests.harness.scenes import PROD

FAILED = "prod-20270115-060000-fa11"
LOOP = "prod-20270115-061000-100b"
SLOW = "prod-20270115-062000-5105"


def test_a_crash_read_from_status_json_opens_with_the_trainers_words_not_its_signature():
    """status.json's error is a signature with its numbers blanked ("allocate N.N
    GiB", for matching); the event's first error line is what the trainer said."""
    from dflashctl.core import contract
    from dflashctl.status.model import EventView
    from dflashctl.store import Event
    from dflashctl.supervise.detectors import detect
    from tests.harness.observations import EXPECT, HEALTHY, obs
    from tests.harness.observations import NOW as T

    said = "CUDA out of memory. Tried to allocate 2.50 GiB (GPU 3; 139.81 GiB total capacity)"
    signature = contract.error_signature("OutOfMemoryError", said)  # as trainer/train.py writes it
    assert "allocate N.N GiB" in signature
    seen = obs(contract.PHASE_FAILED, session_alive=False, alive=False, exit_code=1, error=signature)
    seen.status.detail = {"message": said, "exit_code": 1}
    [f] = detect(HEALTHY, seen, "running", EXPECT, T)
    assert f.detail["status_error"] == signature  # kept for matching
    event = EventView.from_event(Event(1, PROD, T, f.kind, f.severity, f.message, f.detail))
    assert event.first_error == f"OutOfMemoryError: {said}"
