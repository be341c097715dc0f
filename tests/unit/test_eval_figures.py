"""Which eval a run's τ comes from, and its size and spread (``store.preferred_eval``,
``store.eval_figures``): pure functions of the stored eval rows."""

from __future__ import annotations

import pytest

from dflashctl.store import eval_figures, preferred_eval


def row(i, prompts, tokens, tau, speedup, complete=True, error=None, per_prompt=None):
    per = per_prompt or [{"tau": tau, "seconds": 1.0, "greedy_seconds": speedup}] * prompts
    report = None if error else {"prompts": prompts, "new_tokens": tokens, "complete": complete,
                                 "tau_per_prompt": [p["tau"] for p in per], "per_prompt": per}
    return {"id": i, "attempt": f"a{i}", "time": 1000.0 + i, "step": 300, "tau": None if error else tau,
            "speedup": None if error else speedup, "report": report, "error": error}


def test_the_largest_complete_eval_is_shown_and_newer_smaller_ones_are_counted():
    big = row(1, 4, 256, 7.97, 5.45)
    small = row(2, 1, 8, 7.00, 2.11)  # later and much smaller: the 7.97 -> 7.00
    failed = row(3, 0, 0, None, None, error="the evaluation ended before its first prompt")
    chosen = preferred_eval([big, small, failed])
    assert (chosen["attempt"], chosen["tau"], chosen["newer"], chosen["evals"]) == ("a1", 7.97, 1, 2)
    # A partial eval, however large, gives way to a complete one; alone, it is shown (marked).
    partial = row(4, 20, 1280, 6.5, 4.0, complete=False)
    assert preferred_eval([big, partial])["attempt"] == "a1"
    assert preferred_eval([partial])["complete"] is False
    # Equal size: the newest.
    assert preferred_eval([big, row(5, 4, 256, 7.90, 5.40)])["attempt"] == "a5"
    assert preferred_eval([failed]) is None and preferred_eval([]) is None


def test_an_evals_spread_over_its_prompts():
    per = [{"tau": 7.0, "seconds": 1.0, "greedy_seconds": 4.0}, {"tau": 8.0, "seconds": 1.0, "greedy_seconds": 6.0}]
    figures = eval_figures(row(1, 2, 128, 7.5, 5.0, per_prompt=per))
    assert figures["tau_sd"] == pytest.approx(0.7071, abs=1e-4) and figures["speedup_range"] == [4.0, 6.0]
    one = eval_figures(row(2, 1, 8, 7.0, 2.11))
    assert one["tau_sd"] is None and one["speedup_range"] is None  # one prompt: no spread to say
    hostile = eval_figures({"id": 3, "tau": 7.0, "report": {"tau_per_prompt": ["x", float("nan")],
                                                           "per_prompt": [{"seconds": 0}, "junk"], "prompts": "4"}})
    assert hostile["tau_sd"] is None and hostile["speedup_range"] is None and hostile["prompts"] is None
