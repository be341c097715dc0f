"""A run that ends done is evaluated when its playbook asks (the supervisor core's
decision). (The evaluation for real: tests/e2e/test_eval_controller.py.)"""

from __future__ import annotations

from dflashctl.config import EvalSettings
from dflashctl.supervise import supervisor_core as core
from tests.harness.observations import T0, make_policy, make_state, probe


def test_a_run_that_ends_done_is_evaluated_when_the_playbook_asks():
    pol = make_policy()
    pol.run.eval = EvalSettings(after_done=True)
    done = core.Probed(probe(T0, "done", step=100, alive=False, session=False, exit_code=0))
    _, _, actions = core.step(make_state(), done, T0, pol)
    assert [type(a).__name__ for a in actions] == ["RunEval", "Alert"]
    pol.run.eval = EvalSettings(after_done=False)
    _, _, actions = core.step(make_state(), done, T0, pol)
    assert [type(a).__name__ for a in actions] == ["Alert"]
    failed = core.Probed(probe(T0, "failed", step=100, alive=False, session=False, exit_code=1))
    pol.run.eval = EvalSettings(after_done=True)
    _, _, actions = core.step(make_state(), failed, T0, pol)
    assert not any(isinstance(a, core.RunEval) for a in actions)
