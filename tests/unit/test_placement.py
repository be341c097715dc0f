"""The GPU split from measured capacities, as a table. (`dflashctl advise` on a real
run directory: tests/integration/test_placement.py.)"""

from __future__ import annotations

import pytest

from dflashctl.core import contract
from dflashctl.supervise.placement import PlacementError, advise
from tests.harness.placement import T0, line

SPLIT = {"target": ["cuda:0"], "drafter": ["cuda:1"]}


SHARED = {"target": ["cuda:0"], "drafter": ["cuda:0"]}


FIGURES = {
    # 1+1: the target makes 50K/s busy 100 %, the drafter waits half its step: it could take 100K/s.
    "drafter-waits": dict(target_tok_s=[50_000.0], target_busy=[1.0], seq_tok_s=50_000.0, step_ms=400.0,
                          wait_ms=200.0, drafters=1),
    # 1+1, the target idles 3/4 of the time: one drafter GPU takes 50K/s, one target GPU could make 200K/s.
    "target-idles": dict(target_tok_s=[50_000.0], target_busy=[0.25], seq_tok_s=50_000.0, step_ms=400.0,
                         wait_ms=0.0, drafters=1),
    "balanced": dict(target_tok_s=[50_000.0], target_busy=[1.0], seq_tok_s=50_000.0, step_ms=400.0,
                     wait_ms=0.0, drafters=1),
}


@pytest.mark.parametrize("case,total,gpus,peaks,expect", [
    # Sharing makes 2 x 50*100/150 = 66.7K against the 1+1's 50K; memory not reported.
    ("drafter-waits", None, None, None, ("shared", 2, 2, 50_000.0, 66_666.7, None, "target")),
    # 8 GPUs: shared 8 x 200*50/250 = 320K, best split 2+6 = min(400K, 300K) = 300K.
    ("target-idles", 8, SPLIT, {"cuda:0": 20.0, "cuda:1": 60.0}, ("shared", 8, 8, 300_000.0, 320_000.0, True,
                                                                  "drafter")),
    # The same, but a target (90 GiB) and a drafter (60 GiB) do not fit one 141 GiB GPU: split 2+6.
    ("target-idles", 8, SPLIT, {"cuda:0": 90.0, "cuda:1": 60.0}, ("split", 2, 6, 300_000.0, 320_000.0, False,
                                                                  "drafter")),
    ("balanced", 8, SPLIT, {"cuda:0": 20.0, "cuda:1": 60.0}, ("shared", 8, 8, 200_000.0, 200_000.0, True,
                                                              "balanced")),
])
def test_placement_from_measured_capacities(case, total, gpus, peaks, expect):
    lines = [line(s, **FIGURES[case], gpus=gpus, peaks=peaks) for s in range(1, 6)]
    a = advise(lines, total)
    assert (a.mode, a.targets, a.drafters, a.split_tok_s, a.shared_tok_s, a.fits_shared, a.bottleneck) == expect
    assert a.lines == 5 and a.current == (1, 1) and not a.current_shared
    n = a.total
    if a.mode == "shared":
        assert a.placement == {"target": list(range(n)), "drafter": list(range(n))}
        assert f"share all {n} GPUs" in a.reason
    else:
        assert a.placement == {"target": list(range(a.targets)), "drafter": list(range(a.targets, n))}
        assert f"split {a.targets} target + {a.drafters} drafter" in a.reason and "do not fit" in a.reason


def test_a_shared_run_gives_its_own_rate_and_lower_bounds_for_a_split():
    # One GPU running both: 50K seq tok/s. While sharing, the target was busy 40 % and the
    # drafter waited 60 % of its step: capacities of at least 125K each, so a 1+1 split of
    # 2 GPUs makes at least 125K against 2 x 50K shared.
    figures = dict(target_tok_s=[50_000.0], target_busy=[0.4], seq_tok_s=50_000.0, step_ms=400.0, wait_ms=240.0,
                   drafters=1)
    a = advise([line(s, **figures, gpus=SHARED) for s in range(1, 4)], 2)
    assert (a.mode, a.targets, a.drafters, a.current_shared, a.fits_shared) == ("split", 1, 1, True, True)
    assert (a.split_tok_s, a.shared_tok_s) == (125_000.0, 100_000.0)
    assert "lower bounds" in a.reason and "this run's rate per GPU" in a.reason
    busy = dict(figures, target_busy=[0.9], wait_ms=0.0)  # both kept busy while sharing: stay shared
    b = advise([line(s, **busy, gpus=SHARED) for s in range(1, 4)], 2)
    assert (b.mode, b.shared_tok_s) == ("shared", 100_000.0) and b.split_tok_s < b.shared_tok_s
    alone = advise([line(s, **busy, gpus=SHARED) for s in range(1, 4)])  # its own count: 1 GPU
    assert (alone.mode, alone.total, alone.placement) == ("shared", 1, {"target": [0], "drafter": [0]})


def test_a_line_naming_more_devices_than_threads_is_not_believed():
    lying = {"target": [f"cuda:{i}" for i in range(1000)], "drafter": [f"cuda:{i}" for i in range(1000)]}
    a = advise([line(s, **FIGURES["balanced"], gpus=lying) for s in range(1, 4)])
    assert a.total == 2 and a.current == (1, 1)  # one target thread and one drafter replica: 2 GPUs at most


def test_no_figures_no_advice():
    with pytest.raises(PlacementError, match="let the run train"):
        advise([contract.Metrics(time=T0, step=1, total_steps=10, tok_s=1.0, phase="training")])
    starting = line(1, target_tok_s=[1.0], target_busy=[1.0], seq_tok_s=1.0, step_ms=1.0, wait_ms=0.0,
                    drafters=1, phase="compiling")
    with pytest.raises(PlacementError):
        advise([starting])
