"""Branches (actors/machines/branches.py): a chain that lost a one-slot conflict is carried
on as its plan unit's branch; of a conflict group the Merger gates the chain with the
best train evidence. Driven by messages alone (no bus, no threads), then one run end
to end: the same run whatever the thread timing, and a cut run resumes to it."""

from __future__ import annotations

import pytest

from actors import DataParallel, SingleSlot, evolve
from actors.addresses import MERGER, SCHEDULER
from actors.machines.branches import BRANCH_ROUNDS, DUEL, DUEL_TASKS, Branches
from actors.machines.merger import Merger
from actors.machines.scheduler import Scheduler
from actors.machines.planner import Planner
from actors.replay.resume import ResumePoint, resume
from actors.workers.core import WorkerCore
from bus.log import read_log
from protocol import (Barrier, Baseline, Branched, Commit, Diff, Hello, Lease,
                      LeaseBatch, LeaseDone, Open, RolloutResult, RoundClosed, Start, Task, decode)
from tests.merger_drive import answer_evals

HELD = [f"h{i}" for i in range(10)]


def held_out_score(state: dict[str, str], task: str) -> float:
    """A held-out task passes when the text names its number's parity word (a train
    task, screened on, when it names "even")."""
    if task.startswith("t"):
        return 1.0 if "even" in state.get("value", "") else 0.0
    word = "even" if int(task[1:]) % 2 == 0 else "odd"
    return 1.0 if word in state.get("value", "") else 0.0


def answer(m: Merger, out: list, log: list | None = None) -> list:
    return answer_evals(m, out, held_out_score, log)


def opened() -> Merger:
    m = Merger(conflicts="first", branches=True)
    answer(m, m.handle(Open(heldout_ids=HELD)))
    return m


def rewrite(text: str, author: str, version: int = 0) -> Diff:
    return Diff(f"{author}:{text}", author, version, {"value": text})


def lease_done(r: int, unit: int, scores: list[float], diffs: dict[int, Diff],
               version: int = 0) -> LeaseDone:
    """Unit ``unit``'s lease of round ``r``: its rollouts' scores, the folded diff at
    the position that began the chain."""
    return LeaseDone(lease_id=f"r{r}.u{unit}", worker=f"w{unit}", round=r, unit=unit,
                     version=version, results=[
                         RolloutResult(task_id=f"t{unit}.{i}", score=s, diff=diffs.get(i))
                         for i, s in enumerate(scores)])


def close(m: Merger, r: int, log: list | None = None) -> tuple[list, RoundClosed]:
    out = answer(m, m.handle(Barrier(round=r)), log)
    closed = [msg for _, msg in out if isinstance(msg, RoundClosed)]
    return out, closed[-1]


# -- the Merger: which chain is gated, which are carried on ----------------------------


def test_of_a_conflict_group_the_chain_with_the_best_train_evidence_is_gated():
    m = opened()
    # Unit 0 proposed first, but its rewrite failed the rollouts after it; unit 1's
    # passed all three: unit 1's is gated, unit 0's is the conflict.
    m.handle(lease_done(0, 0, [0.0, 0.0, 0.0, 0.0], {0: rewrite("odd", "w0")}))
    m.handle(lease_done(0, 1, [0.0, 1.0, 1.0, 1.0], {0: rewrite("even", "w1")}))
    log: list = []
    out, closed = close(m, 0, log)
    assert [r.state for r in log] == [{"value": "even"}]    # one gate, unit 1's chain
    assert closed.committed and closed.outcomes == {"conflict": 1, "committed": 1}
    # The loser is carried on as unit 0's branch (a single slot's text is its own,
    # whatever the head).
    assert closed.bases == {0: {"value": "odd"}}


def test_on_equal_evidence_the_first_proposer_is_gated():
    m = opened()
    m.handle(lease_done(0, 0, [0.0, 1.0], {0: rewrite("odd", "w0")}))
    m.handle(lease_done(0, 1, [0.0, 1.0], {0: rewrite("even", "w1")}))
    log: list = []
    _, closed = close(m, 0, log)
    assert [r.state for r in log] == [{"value": "odd"}]
    assert closed.bases == {1: {"value": "even"}}


def test_a_lease_on_a_branch_reports_the_branch_with_its_edits_as_one_diff_on_the_head():
    m = opened()
    m.handle(lease_done(0, 0, [0.0, 1.0], {0: rewrite("odd", "w0")}))
    m.handle(lease_done(0, 1, [0.0, 0.0], {0: rewrite("even", "w1")}))
    _, closed = close(m, 0)
    assert closed.committed and closed.bases == {1: {"value": "even"}}
    m.handle(Branched(round=1, merge=0))
    # Unit 1 rolled out on its branch ("even") and chained "even odd" on top; unit 0
    # rolled out on the head and proposed nothing.
    m.handle(lease_done(1, 0, [1.0, 1.0], {}, version=1))
    m.handle(lease_done(1, 1, [1.0, 0.0, 1.0], {1: rewrite("even odd", "w1", 1)},
                        version=1))
    log: list = []
    out, closed = close(m, 1, log)
    assert [r.state for r in log] == [{"value": "even odd"}]
    assert closed.committed and closed.bases == {}
    assert [c.state for _, c in out if isinstance(c, Commit)] == [{"value": "even odd"}]


def test_a_branch_whose_lease_proposed_nothing_is_held_again_unscreened():
    m = Merger(conflicts="first", branches=True, screen=True)
    answer(m, m.handle(Open(heldout_ids=HELD)))
    m.handle(lease_done(0, 0, [0.0, 0.0, 1.0], {0: rewrite("even", "w0")}))
    m.handle(lease_done(0, 1, [0.0, 1.0, 1.0], {0: rewrite("even odd", "w1")}))
    log: list = []
    _, closed = close(m, 0, log)
    # The screen scored each diff on its own evidence task (t0.0, t1.0), then the
    # gate took unit 1's chain.
    assert closed.bases == {0: {"value": "even"}} and closed.committed
    m.handle(Branched(round=1, merge=0))
    m.handle(lease_done(1, 0, [1.0, 1.0], {}, version=1))   # on "even": no proposal
    m.handle(lease_done(1, 1, [1.0, 1.0], {}, version=1))   # on the head
    log = []
    _, closed = close(m, 1, log)
    # Held again as a rewrite of the head ("even odd" -> "even"), with no evidence task
    # of its own: not screened, gated (and worse than the head).
    assert [r.state for r in log] == [{"value": "even"}]
    assert closed.outcomes == {"below-threshold": 1} and closed.bases == {}


def test_a_commit_rebases_the_carried_branches_by_their_keys():
    b = Branches()
    head = {"a": "1", "b": "1"}
    lease = LeaseDone(lease_id="r0.u3", worker="w3", round=0, unit=3, results=[
        RolloutResult(task_id="t", score=0.0, diff=Diff("d", "w3", 0, {"b": "2"})),
        RolloutResult(task_id="u", score=1.0)])
    b.lease(lease, head)
    (lost,) = [r.diff for r in lease.results if r.diff is not None]
    # The merge committed a change of "a": the branch keeps its "b" on the new head.
    bases = b.settle(0, [lost], {"a": "9", "b": "1"})
    assert bases == {3: {"a": "9", "b": "2"}}


def test_a_branch_is_carried_a_bounded_number_of_rounds():
    m = opened()
    text = "odd"
    for r in range(BRANCH_ROUNDS):
        if r:
            m.handle(Branched(round=r, merge=r - 1))
        m.handle(lease_done(r, 0, [0.0, 1.0, 1.0], {0: rewrite(f"even {r}", "w0")}))
        text += " x"
        m.handle(lease_done(r, 1, [0.0], {0: rewrite(text, "w1")}))
        _, closed = close(m, r)
        if r < BRANCH_ROUNDS - 1:
            assert closed.bases == {1: {"value": text}}, r
    assert closed.bases == {}   # grown BRANCH_ROUNDS rounds: unit 1 starts afresh


def test_without_branches_the_first_proposer_is_gated_and_nothing_is_carried():
    m = Merger(conflicts="first")
    answer(m, m.handle(Open(heldout_ids=HELD)))
    m.handle(lease_done(0, 0, [0.0, 0.0, 0.0], {0: rewrite("odd", "w0")}))
    m.handle(lease_done(0, 1, [0.0, 1.0, 1.0], {0: rewrite("even", "w1")}))
    log: list = []
    _, closed = close(m, 0, log)
    assert [r.state for r in log] == [{"value": "odd"}] and closed.bases == {}


def test_of_more_than_duel_chains_the_best_by_evidence_duel_on_held_out_tasks():
    assert DUEL == 4 and DUEL_TASKS == 8
    m = opened()
    # Five chains conflict. By train evidence: units 0 and 1 (three passes after their
    # rewrite), then 2, 3, and 4 last. Unit 2's "even odd" passes every held-out task
    # but only the four best by evidence duel: 4 is not scored, 2 wins the duel.
    chains = [("even", [0.0, 1.0, 1.0, 1.0]), ("odd", [0.0, 1.0, 1.0, 1.0]),
              ("even odd", [0.0, 0.0, 1.0, 1.0]), ("x", [0.0, 0.0, 0.0, 1.0]),
              ("even odd y", [0.0, 0.0, 0.0, 0.0])]
    for unit, (text, scores) in enumerate(chains):
        m.handle(lease_done(0, unit, scores, {0: rewrite(text, f"w{unit}")}))
    log: list = []
    _, closed = close(m, 0, log)
    duel = [r for r in log if len(r.task_ids) == DUEL_TASKS]
    assert [r.state["value"] for r in duel] == ["even", "odd", "even odd", "x"]
    assert len({tuple(r.task_ids) for r in duel}) == 1       # the same tasks for each
    gate = [r for r in log if r not in duel]
    assert [r.state for r in gate] == [{"value": "even odd"}] and gate[0].task_ids == HELD
    assert closed.committed and closed.outcomes == {"conflict": 4, "committed": 1}
    # The four that lost are carried on, the undueled one too.
    assert sorted(closed.bases) == [0, 1, 3, 4]


def test_a_group_of_duel_chains_or_fewer_is_picked_by_train_evidence_alone():
    m = opened()
    for unit in range(DUEL):
        m.handle(lease_done(0, unit, [0.0] + [1.0] * unit, {0: rewrite(f"odd {unit}",
                                                                       f"w{unit}")}))
    log: list = []
    close(m, 0, log)
    assert [r.state for r in log] == [{"value": f"odd {DUEL - 1}"}]   # one gate, no duel


def carrying(gate_rollouts: int) -> Merger:
    m = Merger(conflicts="first", branches=True, gate_rollouts=gate_rollouts)
    answer(m, m.handle(Open(heldout_ids=HELD)))
    return m


def test_before_gate_rollouts_since_the_last_gate_every_chain_is_carried_at_no_call():
    m = carrying(12)
    m.handle(lease_done(0, 0, [0.0, 1.0, 1.0], {0: rewrite("even", "w0")}))
    m.handle(lease_done(0, 1, [0.0, 0.0, 1.0], {0: rewrite("odd", "w1")}))
    log: list = []
    out, closed = close(m, 0, log)
    assert log == [] and not closed.committed      # 6 rollouts of 12: no gate
    assert closed.outcomes == {"ungated": 2}
    assert closed.bases == {0: {"value": "even"}, 1: {"value": "odd"}}
    # The next round grows both chains on their branches: 12 rollouts, one gate.
    m.handle(Branched(round=1, merge=0))
    m.handle(lease_done(1, 0, [1.0, 1.0, 1.0], {}))
    m.handle(lease_done(1, 1, [0.0, 1.0, 1.0], {0: rewrite("odd even", "w1")}))
    log = []
    out, closed = close(m, 1, log)
    assert [r.state for r in log] == [{"value": "even"}]   # best evidence: unit 0's
    assert closed.committed and closed.outcomes == {"conflict": 1, "committed": 1}
    assert closed.bases == {1: {"value": "odd even"}}
    # The count starts again after a gate.
    m.handle(Branched(round=2, merge=1))
    m.handle(lease_done(2, 1, [1.0], {}, version=1))
    log = []
    _, closed = close(m, 2, log)
    assert log == [] and closed.outcomes == {"ungated": 1}


def test_a_merge_that_carries_its_chains_does_not_age_them():
    m = carrying(10**6)
    for r in range(BRANCH_ROUNDS + 2):
        if r:
            m.handle(Branched(round=r, merge=r - 1))
        m.handle(lease_done(r, 0, [0.0, 1.0], {0: rewrite(f"even {r}", "w0")}))
        _, closed = close(m, r)
        assert closed.bases == {0: {"value": f"even {r}"}}, r


def test_the_scheduler_hands_the_merger_a_branch_lease_that_proposed_nothing():
    s = Scheduler(max_concurrency=2)
    s.handle(Hello(worker="w0"))
    s.handle(Hello(worker="w1"))
    s.handle(LeaseBatch(round=1, leases=[
        Lease(lease_id="r1.u0", round=1, unit=0, task_ids=["t0"], state={"value": "b"}),
        Lease(lease_id="r1.u1", round=1, unit=1, task_ids=["t1"])]))
    out = s.handle(LeaseDone(lease_id="r1.u0", worker="w0", round=1, unit=0,
                             results=[RolloutResult("t0", 1.0)]))
    out += s.handle(LeaseDone(lease_id="r1.u1", worker="w1", round=1, unit=1,
                              results=[RolloutResult("t1", 1.0)]))
    # The branch's lease reaches the Merger (it holds the branch again); the lease on
    # the head that proposed nothing does not.
    assert [msg.lease_id for to, msg in out if to == MERGER and isinstance(msg, LeaseDone)] \
        == ["r1.u0"]


# -- the Planner and the worker ----------------------------------------------------------


def test_the_planner_leases_each_unit_its_base_and_tells_the_merger_first():
    planner = Planner(DataParallel(per_worker=2))
    planner.handle(Start(run_id="x", seed=0, task_ids=[f"t{i}" for i in range(10)],
                         n_workers=2, rounds=3, held_out_frac=0.4, max_concurrency=2,
                         chain=True))
    (_, first), = planner.handle(Baseline(version=0, heldout_reward=0.0))
    assert all(lease.state is None for lease in first.leases)
    out = planner.handle(RoundClosed(round=0, version=0, committed=False,
                                     heldout_reward=0.0, bases={1: {"value": "b"}}))
    sent = [(to, type(msg)) for to, msg in out]
    assert sent.index((MERGER, Branched)) < sent.index((SCHEDULER, LeaseBatch))
    assert [msg for to, msg in out if to == MERGER] == [Branched(round=1, merge=0)]
    (batch,) = [msg for _, msg in out if isinstance(msg, LeaseBatch)]
    assert {lease.unit: lease.state for lease in batch.leases} == {0: None, 1: {"value": "b"}}


def test_a_rollout_lease_given_a_state_rolls_out_on_it_and_chains_on_top():
    seen: list[str] = []
    tasks = {"t0": Task("t0", "q", {"topic": "a"}), "t1": Task("t1", "q", {"topic": "b"})}

    def run(rendered: str, task: Task) -> str:
        seen.append(rendered)
        return "good" if task.meta["topic"] in rendered.split() else "bad"

    def propose(rendered: str, task: Task, output: str, score: float) -> str:
        return f"{rendered} {task.meta['topic']}"

    worker = WorkerCore("w0", tasks, lambda task, out: float(out == "good"), run, propose,
                        SingleSlot())
    done = worker.run_lease(Lease(lease_id="r1.u0", round=1, task_ids=["t0", "t1"],
                                  chain=True, state={"value": "x"}))
    assert seen == ["x", "x a"]
    assert [r.diff.ops if r.diff else None for r in done.results] == \
        [{"value": "x a b"}, None]
    assert worker.state == {}   # its own head is untouched


# -- end to end: the same run whatever the thread timing; a cut run resumes to it -------

TOPICS = ["a", "b", "c", "d", "e", "f"]


def _run(rendered: str, task: Task) -> str:
    return "good" if f"[{task.meta['topic']}]" in rendered else "bad"


def _propose(rendered: str, task: Task, output: str, score: float) -> str:
    text = "" if rendered == SingleSlot().empty_render else rendered
    return (text + f" [{task.meta['topic']}]").strip()


def _kwargs(**extra):
    kw = dict(tasks=[Task(f"q{i}", f"q{i}", {"topic": TOPICS[i % 6]}) for i in range(60)],
              reward=lambda task, out: float(out == "good"), run=_run, propose=_propose,
              strategy=SingleSlot(), n_workers=6, rounds=5, seed=1, bus="memory",
              parallel=DataParallel(per_worker=1))
    kw.update(extra)
    return kw


def _history(result):
    return [(h.round, h.version, h.committed, h.heldout_reward, h.rollouts, h.reasons)
            for h in result.history]


@pytest.fixture(scope="module")
def branched_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("branches") / "full.evolog"
    return path, evolve(**_kwargs(), log=str(path))


def test_a_run_with_branches_is_the_same_run_whatever_the_thread_timing(branched_run):
    path, full = branched_run
    leases = [m for m in (decode(r.body) for r in read_log(path).records)
              if isinstance(m, Lease) and m.kind == "rollout"]
    assert any(lease.state is not None for lease in leases)   # branches were leased
    for bus in ("memory", "zmq"):
        again = evolve(**_kwargs(bus=bus))
        assert (again.state, _history(again)) == (full.state, _history(full)), bus


@pytest.mark.parametrize("fraction", [0.2, 0.5, 0.8])
def test_a_cut_run_with_branches_resumes_to_the_uninterrupted_result(branched_run, tmp_path,
                                                                     fraction):
    from tests.test_resume import before_the_result, cut, same_run
    path, full = branched_run
    killed = cut(path, tmp_path / "run.evolog", max(1, int(before_the_result(path) * fraction)))
    same_run(resume(ResumePoint(killed), **_kwargs()), full)



def test_branches_are_on_by_default_for_a_single_slot_only_and_only_with_first_and_chains():
    from actors import AppendRules, KeyedRules
    from actors.policies.parallelism import uses_branches
    first = dict(chain=True, conflicts="first")
    assert uses_branches(None, SingleSlot(), **first)
    assert not uses_branches(None, KeyedRules(["a", "b"]), **first)
    assert not uses_branches(None, AppendRules(), **first)
    assert uses_branches(True, AppendRules(), **first)
    assert not uses_branches(False, SingleSlot(), **first)
    assert not uses_branches(True, SingleSlot(), chain=False, conflicts="first")
    assert not uses_branches(True, SingleSlot(), chain=True, conflicts="score")
