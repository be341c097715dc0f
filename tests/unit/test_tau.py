"""One meaning of tau: τ est is accept_len + 1, and the gap to the measured τ is
named past contract.TAU_GAP_MARGIN only. (In the views and commands:
tests/integration/test_tau.py.)"""

from __future__ import annotations

import pytest

from dflashctl.core import contract

RUN = "demo-20261201-101500-ab12"


@pytest.mark.parametrize("tau_est, tau, gap", [
    (7.7, 7.5, False),   # within the margin
    (7.7, 7.7 * (1 - contract.TAU_GAP_MARGIN), False),  # at the margin
    (7.7, 1.0, True),    # the demo's old random target: the data was not written by it
    (7.7, None, False),  # no eval yet
    (None, 3.0, False),  # no training figure
])
def test_the_gap_is_named_past_the_margin_only(tau_est, tau, gap):
    note = contract.tau_gap(tau_est, tau)
    assert (note is not None) == gap
    if gap:
        assert "not written by this target" in note and "regenerate" in note


def test_tau_estimate_is_accept_len_plus_one():
    assert contract.tau_estimate(6.69) == pytest.approx(7.69) and contract.tau_estimate(None) is None
