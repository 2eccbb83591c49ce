"""Chained edits inside one lease (actors/workers/chain.py, ``Lease.chain``): a worker
applies each proposal to its own copy and rolls the lease's next tasks out on the edited
state, so one candidate can hold edits that need each other."""

from __future__ import annotations

import pytest

from actors import AppendRules, DataParallel, KeyedRules, SingleSlot, evolve
from actors.artifacts import round_tasks
from actors.machines.planner import Planner
from actors.policies.parallelism import DataParallel as DP
from actors.workers.chain import Chain
from actors.workers.core import WorkerCore
from bus.log import read_log
from protocol import REMOVE, Baseline, Diff, Lease, LeaseBatch, Start, Task, decode


def _diff(ops: dict[str, str], author: str = "w0") -> Diff:
    return Diff(f"{author}:{sorted(ops)}", author, 3, ops)


# -- folding a chain -------------------------------------------------------------------


def test_a_single_slot_chain_folds_into_one_rewrite_holding_every_link():
    base = {"value": "A"}
    chain = Chain(SingleSlot(), base, "A")
    chain.add(0, _diff({"value": "A B"}))
    assert chain.rendered == "A B"
    chain.add(2, _diff({"value": "B C"}))
    folded = chain.fold()
    assert folded[2] is None
    assert folded[0].ops == {"value": "B C"}
    assert (folded[0].author, folded[0].base_version) == ("w0", 3)
    assert chain.base == {"value": "A"}   # the lease's base is never edited in place


def test_links_on_keys_of_their_own_stay_diffs_of_their_own():
    first, second = _diff({"r1": "rule one"}), _diff({"r2": "rule two"})
    chain = Chain(AppendRules(), {}, "")
    chain.add(0, first)
    chain.add(1, second)
    assert chain.fold() == {0: first, 1: second}
    assert "rule one" in chain.rendered and "rule two" in chain.rendered


def test_links_that_share_a_key_fold_together_and_the_others_stay_apart():
    chain = Chain(KeyedRules(["tone", "format", "units"]), {"units": "metric"}, "")
    chain.add(0, _diff({"tone": "formal"}))
    chain.add(1, _diff({"format": "bullets"}))
    chain.add(2, _diff({"tone": "casual", "units": REMOVE}))
    folded = chain.fold()
    assert folded[0].ops == {"tone": "casual", "units": REMOVE}
    assert folded[1].ops == {"format": "bullets"}
    assert folded[2] is None


def test_a_chain_whose_edits_cancel_out_reports_no_diff():
    chain = Chain(KeyedRules(["tone"]), {}, "")
    chain.add(0, _diff({"tone": "formal"}))
    chain.add(1, _diff({"tone": REMOVE}))
    assert chain.fold() == {0: None, 1: None}
    assert chain.state == {}


# -- the worker's propose path ---------------------------------------------------------


def _topics_worker(seen: list[tuple[str, str, str]]) -> WorkerCore:
    """A worker over tasks whose topic must be named in the text to pass; its proposer
    appends the failed task's topic and records what it was shown."""
    tasks = {f"t{i}": Task(f"t{i}", topic, {"topic": topic})
             for i, topic in enumerate(["a", "b", "a", "c"])}

    def run(rendered: str, task: Task) -> str:
        seen.append(("run", task.id, rendered))
        return "good" if task.meta["topic"] in rendered.split() else "bad"

    def propose(rendered: str, task: Task, output: str, score: float) -> str:
        seen.append(("propose", task.id, rendered))
        text = "" if rendered == SingleSlot().empty_render else rendered
        return (text + " " + task.meta["topic"]).strip()

    return WorkerCore("w0", tasks, lambda task, out: float(out == "good"), run, propose,
                      SingleSlot())


def test_a_chained_lease_rolls_its_next_task_out_on_the_edited_state_and_proposes_on_top():
    seen: list[tuple[str, str, str]] = []
    worker = _topics_worker(seen)
    done = worker.run_lease(Lease(lease_id="r1.u0", round=1, task_ids=["t0", "t1", "t2", "t3"],
                                  chain=True))
    empty = SingleSlot().empty_render
    assert seen == [("run", "t0", empty), ("propose", "t0", empty),
                    ("run", "t1", "a"), ("propose", "t1", "a"),
                    ("run", "t2", "a b"),                       # solved by the first link
                    ("run", "t3", "a b"), ("propose", "t3", "a b")]
    assert [r.score for r in done.results] == [0.0, 0.0, 1.0, 0.0]
    assert [r.calls for r in done.results] == [2, 2, 1, 2]
    diffs = [r.diff for r in done.results]
    assert diffs[0].ops == {"value": "a b c"} and diffs[1:] == [None, None, None]
    assert diffs[0].base_version == done.version == 0
    assert worker.state == {} and worker.rendered == empty   # the head is untouched


def test_an_unchained_lease_proposes_every_edit_on_the_head():
    seen: list[tuple[str, str, str]] = []
    worker = _topics_worker(seen)
    done = worker.run_lease(Lease(lease_id="r1.u0", round=1, task_ids=["t0", "t1", "t2"]))
    empty = SingleSlot().empty_render
    assert {rendered for _, _, rendered in seen} == {empty}
    assert [r.diff.ops for r in done.results] == [{"value": "a"}, {"value": "b"},
                                                 {"value": "a"}]


def test_an_eval_lease_never_chains():
    seen: list[tuple[str, str, str]] = []
    worker = _topics_worker(seen)
    done = worker.run_lease(Lease(lease_id="e1.0", round=-1, kind="eval",
                                  task_ids=["t0", "t1"], state={"value": "a"}, chain=True))
    assert [kind for kind, _, _ in seen] == ["run", "run"]
    assert [r.diff for r in done.results] == [None, None]


def test_the_planner_marks_its_rollout_leases_chained_as_the_start_says():
    for chain in (True, False):
        planner = Planner(DP(per_worker=2))
        planner.handle(Start(run_id="x", seed=0, task_ids=[f"t{i}" for i in range(10)],
                             n_workers=2, rounds=1, held_out_frac=0.4, max_concurrency=2,
                             chain=chain))
        (_, batch), = planner.handle(Baseline(version=0, heldout_reward=0.0))
        assert isinstance(batch, LeaseBatch)
        assert batch.leases and all(lease.chain is chain for lease in batch.leases)


# -- escaping a trap one edit deep -----------------------------------------------------

#: The head's shortcut fixes topics a and b and breaks c and d; dropping it alone loses
#: a and b and fixes nothing, and the tasks of a and b pass, so nothing proposes their
#: own phrases: no single edit beats the head.
SHORTCUT = "Be brief."
TOPICS = ["a", "b", "c", "d"]


def _trap_run(rendered: str, task: Task) -> str:
    topic = task.meta["topic"]
    if SHORTCUT in rendered:
        return "bad" if topic in ("c", "d") else "good"
    return "good" if f"[{topic}]" in rendered else "bad"


def _trap_propose(rendered: str, task: Task, output: str, score: float) -> str:
    """The right edit: drop the shortcut that breaks the task, else add its phrase."""
    text = "" if rendered == SingleSlot().empty_render else rendered
    if SHORTCUT in text:
        return " ".join(text.replace(SHORTCUT, "").split())
    return (text + f" [{task.meta['topic']}]").strip()


def _trap_tasks() -> list[Task]:
    return [Task(f"q{i}", f"question {i}", {"topic": TOPICS[i % 4]}) for i in range(40)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_evolve_escapes_a_trap_one_edit_deep_by_chaining_and_stays_in_it_without(seed):
    def go(chain: bool):
        return evolve(_trap_tasks(), lambda task, out: float(out == "good"), run=_trap_run,
                      propose=_trap_propose, strategy=SingleSlot(),
                      initial_state={"value": f"Answer well. {SHORTCUT}"}, n_workers=2,
                      rounds=6, seed=seed, parallel=DataParallel(per_worker=6), bus="memory", chain=chain)

    stuck = go(False)
    assert stuck.version == 0, stuck.rendered
    assert stuck.final_reward == stuck.initial_reward < 1.0
    escaped = go(True)
    assert escaped.final_reward == 1.0, (seed, escaped.rendered)
    assert SHORTCUT not in escaped.rendered


def test_a_single_slot_run_that_names_no_parallelism_plans_its_own_round(tmp_path):
    assert round_tasks(SingleSlot()) == 64 and round_tasks(AppendRules()) is None
    tasks = [Task(f"q{i}", f"question {i}", {"topic": TOPICS[i % 4]}) for i in range(240)]
    # Beyond four workers the round is planned on four of them (the others share gates).
    for n_workers, per_worker, busy in ((4, 16, 4), (16, 16, 4), (3, 22, 3)):
        log = tmp_path / f"slot{n_workers}.evolog"
        evolve(tasks, lambda task, out: float(out == "good"), run=_trap_run,
               propose=_trap_propose, strategy=SingleSlot(), n_workers=n_workers, rounds=1,
               seed=0, bus="memory", log=str(log))
        leases = [m for m in (decode(r.body) for r in read_log(log).records)
                  if isinstance(m, Lease) and m.kind == "rollout"]
        assert len(leases) == busy
        assert all(len(m.task_ids) == per_worker and m.chain for m in leases)


@pytest.mark.parametrize("parallel", ["", '[parallel]\nkind = "DataParallel"\n'])
def test_a_single_slot_scenario_without_per_worker_plans_the_same_round_as_evolve(parallel):
    # A scenario file's run is evolve()'s: no [parallel], or a DataParallel without
    # per_worker, gets the strategy's own round (16 a worker at 4 workers), not 4.
    from actors.runtime.launch import evolve_kwargs
    from protocol.scenario import parse_scenario
    text = f"""
name = "slot"
[domain]
tasks = "scenarios.router:tasks"
reward = "scenarios.router:reward"
agent = "scenarios.router:RouterAgent"
[strategy]
kind = "SingleSlot"
{parallel}
[workers]
local = 4
"""
    kwargs = evolve_kwargs(parse_scenario(text, "slot.toml"))
    assert kwargs["parallel"].per_worker == 16
