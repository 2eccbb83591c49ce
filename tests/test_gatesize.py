"""The held-out evidence sized to the budget (actors/machines/gatesize.py): how many
held-out tasks a gate scores, which ones, and that the Merger and evolve() use it."""

from __future__ import annotations

import random

import msgspec
import pytest

from actors import evolve
from actors.errors import ConfigError
from actors.machines.gatesize import GATE_MIN, GATE_SHARE, gate_size, gate_tasks
from actors.machines.merger import Merger
from bus.log import read_log
from protocol import Barrier, Diff, EvalDone, EvalRequest, LeaseDone, Open, RolloutResult
from scenarios import router

HELD = [f"h{i:03d}" for i in range(200)]


def test_without_a_call_budget_or_with_a_large_one_a_gate_scores_the_whole_split():
    assert gate_size(200, None) is None
    assert gate_size(200, GATE_SHARE * 200) is None
    assert gate_size(40, 100) is None           # GATE_MIN is more than the split


def test_a_small_budget_scores_a_tenth_of_it_and_never_fewer_than_the_minimum():
    assert gate_size(200, 1_000) == 1_000 // GATE_SHARE
    assert gate_size(200, 100) == GATE_MIN
    assert gate_size(200, 1_999) == 199


def test_the_sample_is_part_of_the_split_in_its_order_and_independent_of_that_order():
    chosen = gate_tasks(HELD, 50)
    assert len(chosen) == 50 and set(chosen) <= set(HELD)
    assert chosen == [t for t in HELD if t in set(chosen)]      # the split's order
    shuffled = list(HELD)
    random.Random(3).shuffle(shuffled)
    assert set(gate_tasks(shuffled, 50)) == set(chosen)        # not the first 50 given
    assert chosen != HELD[:50]
    assert gate_tasks(HELD, None) == HELD and gate_tasks(HELD, 500) == HELD


@pytest.mark.parametrize("bad", [0, -3, True, 2.5])
def test_a_size_that_is_not_a_positive_count_is_refused(bad):
    with pytest.raises(ValueError, match="gate_tasks"):
        gate_tasks(HELD, bad)
    with pytest.raises(ValueError, match="gate_tasks"):
        gate_tasks(HELD[:1], bad)   # refused even where any size takes the whole split


def test_the_merger_scores_its_gates_on_the_sample_only():
    m = Merger(gate_tasks=3)
    out = m.handle(Open(heldout_ids=HELD[:10]))
    (_, baseline), = out
    sample = gate_tasks(HELD[:10], 3)
    assert isinstance(baseline, EvalRequest) and baseline.task_ids == sample
    m.handle(EvalDone(eval_id=baseline.eval_id, score=0.0,
                      scores=dict.fromkeys(sample, 0.0)))
    m.handle(LeaseDone(lease_id="r0.u0", worker="w", round=0, results=[
        RolloutResult(task_id="t", score=0.0, diff=Diff("w:a", "w", 0, {"a": "on"}))]))
    (_, gate), = m.handle(Barrier(round=0))
    assert isinstance(gate, EvalRequest) and gate.task_ids == sample


def test_evolve_records_the_gate_it_sized_and_refuses_a_bad_one(tmp_path):
    tasks = router.tasks()
    log = tmp_path / "run.evolog"
    evolve(tasks, router.reward, run=router.run, propose=router.propose, seed=0,
           bus="memory", log=str(log), max_calls=400, held_out_frac=0.9)
    merger = msgspec.json.decode(read_log(log).header.meta["machine_args"])["merger"]
    n_heldout = round(len(tasks) * 0.9)
    assert merger["gate_tasks"] == gate_size(n_heldout, 400) == GATE_MIN < n_heldout
    with pytest.raises(ConfigError, match="gate_tasks"):
        evolve(tasks, router.reward, run=router.run, propose=router.propose,
               gate_tasks=0, bus="memory")
