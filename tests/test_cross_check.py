"""The cross-check (actors/machines/interference.py), driven by messages alone: a diff
broad enough to fix its own task breaks the evidence of the diffs fused with it, and is
left out before the held-out gate; on a weak head the gate alone cannot see it."""

from __future__ import annotations

from actors.machines.merger import Merger
from protocol import Barrier, Commit, Diff, LeaseDone, Open, RolloutResult, RoundClosed
from tests.merger_drive import answer_evals

HELD = [f"h{i}" for i in range(8)]
#: Held-out tasks: h0, h3 need g0; h1, h4 need g1; h2, h5 need g2; h6, h7 are solved by
#: "broad" alone, which also breaks h0 and h1. The train tasks: e0 needs g0, e1 needs
#: g1, e2 needs g2, ef is solved by "broad"; "broad" breaks e0 and e1 (the tasks g0 and
#: g1 were proposed for).
NEEDS = {"h0": "g0", "h3": "g0", "h1": "g1", "h4": "g1", "h2": "g2", "h5": "g2",
         "e0": "g0", "e1": "g1", "e2": "g2", "h6": "broad", "h7": "broad", "ef": "broad"}
BROKEN_BY_BROAD = {"h0", "h1", "e0", "e1"}


def solves(state: dict[str, str], task: str) -> float:
    if task in BROKEN_BY_BROAD and "broad" in state:
        return 0.0
    return 1.0 if NEEDS.get(task) in state else 0.0


def d(key: str) -> Diff:
    return Diff(f"w:{key}", "w", 0, {key: "on"})


def opened(**rules) -> Merger:
    m = Merger(screen=True, **rules)
    answer_evals(m, m.handle(Open(heldout_ids=HELD)), solves)
    return m


def merge(m: Merger, r: int, proposed: list[tuple[str, Diff]], log: list | None = None,
          solve=solves) -> tuple[list, RoundClosed]:
    """One round: each (evidence task, diff) a failed rollout's proposal."""
    m.handle(LeaseDone(lease_id=f"r{r}.u0", worker="w", round=r, version=m.version,
                       results=[RolloutResult(task_id=t, score=0.0, diff=x)
                                for t, x in proposed]))
    out = answer_evals(m, m.handle(Barrier(round=r)), solve, log)
    return out, [msg for _, msg in out if isinstance(msg, RoundClosed)][-1]


ROUND = [("e0", d("g0")), ("ef", d("broad")), ("e1", d("g1"))]


def test_on_an_empty_head_a_broad_diff_rides_in_without_the_cross_check():
    m = opened(attribute=True)
    out, closed = merge(m, 0, ROUND)
    # 4/8 against 0/8: nothing regressed against a head that solves nothing.
    assert closed.committed and m.state.keys() == {"g0", "g1", "broad"}
    assert closed.outcomes == {"committed": 3}


def test_a_diff_that_breaks_the_evidence_of_the_diffs_fused_with_it_is_left_out():
    m = opened(attribute=True, cross=True)
    log: list = []
    out, closed = merge(m, 0, ROUND, log=log)
    assert m.state == {"g0": "on", "g1": "on"} and m.score == 4 / 8
    assert closed.outcomes == {"committed": 2, "harmful": 1}
    assert [msg.state for _, msg in out if isinstance(msg, Commit)] == [m.state]
    # The screen (one call a diff), the candidate on the three evidence tasks and again
    # on the two it breaks (a control), each diff taken back out alone there, then one
    # gate of the candidate left.
    assert [r.task_ids for r in log] == [["e0"], ["ef"], ["e1"], ["e0", "e1", "ef"],
                                         ["e0", "e1"], ["e0", "e1"], ["e0", "e1"],
                                         ["e0", "e1"], HELD]
    assert m.stats["cross-checked"] == 1 and m.stats["cross-flagged"] == 1


def test_a_broad_diff_that_breaks_the_evidence_of_committed_diffs_is_left_out():
    """g0 and g1 are committed in round 0; in round 1 "broad" comes with g2. Fused, they
    fail e0 and e1, the evidence of the committed diffs (the suite), and taking "broad"
    back out repairs both: it is left out before the gate, which scores g2 alone."""
    m = opened(cross=True)
    merge(m, 0, [("e0", d("g0")), ("e1", d("g1"))])
    log: list = []
    out, closed = merge(m, 1, [("ef", d("broad")), ("e2", d("g2"))], log=log)
    assert m.state.keys() == {"g0", "g1", "g2"} and m.score == 6 / 8
    assert closed.outcomes == {"committed": 1, "harmful": 1}
    assert log[2].task_ids == ["e0", "e1", "e2", "ef"]   # own evidence and the suite's
    assert [r.task_ids for r in log][-1] == HELD and sum(r.task_ids == HELD
                                                         for r in log) == 1


def test_evidence_every_diff_fuses_without_breaking_costs_one_call_each_and_no_loo():
    m = opened(cross=True)
    log: list = []
    merge(m, 0, [("e0", d("g0")), ("e1", d("g1"))], log=log)
    assert m.state == {"g0": "on", "g1": "on"}
    assert [r.task_ids for r in log] == [["e0"], ["e1"], ["e0", "e1"], HELD]


def test_a_broken_evidence_task_that_most_removals_repair_was_the_noise():
    """The fused candidate fails e0 once (the model's noise); taken back out one at a
    time, every diff but its owner "repairs" it: nothing is flagged."""
    noise = {"e0": 1}

    def noisy(state, task):
        if task == "e0" and noise["e0"] and len(state) == 3:
            noise["e0"] = 0
            return 0.0
        return 1.0 if NEEDS.get(task) in state else 0.0

    m = Merger(screen=True, cross=True)
    answer_evals(m, m.handle(Open(heldout_ids=HELD)), noisy)
    out, closed = merge(m, 0, [("e0", d("g0")), ("e1", d("g1")), ("ef", d("broad"))],
                        solve=noisy)
    assert m.state.keys() == {"g0", "g1", "broad"} and "harmful" not in closed.outcomes


def test_a_single_diff_is_not_cross_checked():
    m = opened(cross=True, hold=False)
    log: list = []
    merge(m, 0, [("e0", d("g0"))], log=log)
    assert [r.task_ids for r in log] == [["e0"], HELD] and "cross-checked" not in m.stats


def test_a_removal_behind_the_head_stops_on_the_first_tasks_of_the_sequential_gate():
    """Retiring "g0" (probed on a stuck task it seems to block) scores worse than the
    head: with ``sequential_retire`` its confirmation stops on the first four held-out
    tasks, where it scored the whole split before."""
    costs = {}
    for seq in (False, True):
        m = Merger(retire=True, sequential=True, sequential_first=4, sequential_retire=seq)
        answer_evals(m, m.handle(Open(heldout_ids=HELD)), solves)
        merge(m, 0, [("e0", d("g0")), ("e1", d("g1"))])
        # Stuck train tasks (failed, no new edit) that taking g0 out appears to repair:
        # "x" tasks pass without g0 in this made-up model, on the probe's tasks only.
        m.handle(LeaseDone(lease_id="r1.u1", worker="w", round=1, version=m.version,
                           results=[RolloutResult(task_id=t, score=0.0)
                                    for t in ("x0", "x1")]))

        def blocks(state, task):
            if task.startswith("x"):
                return 0.0 if "g0" in state else 1.0
            return solves(state, task)

        log: list = []
        merge(m, 1, [("e9", d("useless"))], log=log, solve=blocks)
        confirm = [r for r in log if "g1" in r.state and "g0" not in r.state
                   and set(r.task_ids) <= set(HELD)]
        costs[seq] = sum(len(r.task_ids) for r in confirm)
        assert m.state.keys() == {"g0", "g1"}   # not retired: the head scores higher
    assert costs == {False: 8, True: 4}


def test_a_diff_that_replaces_a_committed_fix_is_left_to_the_gate():
    """"tone" committed as "casual" (a minority's preference) fixed its evidence task;
    "tone: formal" breaks that task, as any replacement of it would: the cross-check
    does not blame a diff for the suite task whose fix it rewrites, and the gate, where
    the majority's tasks count, takes it."""
    held = ["h0", "h1", "h2", "h3"]

    def tone(state, task):
        if task in ("eu", "h3"):
            return 1.0 if state.get("units") == "metric" else 0.0
        if task == "ed":
            return 1.0 if state.get("dates") == "iso" else 0.0
        want = "casual" if task in ("ec", "h0") else "formal"
        return 1.0 if state.get("tone") == want else 0.0

    m = Merger(screen=True, cross=True, hold=False)
    answer_evals(m, m.handle(Open(heldout_ids=held)), tone)
    casual = Diff("w:casual", "w", 0, {"tone": "casual"})
    merge(m, 0, [("ec", casual), ("eu", Diff("w:metric", "w", 0, {"units": "metric"}))],
          solve=tone)
    assert m.state == {"tone": "casual", "units": "metric"} and m.score == 2 / 4
    formal = Diff("w:formal", "w", 1, {"tone": "formal"})
    extra = Diff("w:dates", "w", 1, {"dates": "iso"})
    log: list = []
    out, closed = merge(m, 1, [("ef", formal), ("ed", extra)], log=log, solve=tone)
    assert "ec" in log[2].task_ids   # the suite task was checked, and broken
    assert m.state["tone"] == "formal" and m.score == 3 / 4
    assert "harmful" not in closed.outcomes


def test_a_model_measured_deterministic_pays_no_control_in_the_cross_check():
    """Once repeated rollouts measure the model deterministic (variance 0), a broken
    evidence task fails again for sure: the cross-check goes straight to leave-one-out."""
    from actors.machines.scoring import NOISE_MIN_DF

    m = opened(attribute=True, cross=True)
    for _ in range(NOISE_MIN_DF + 1):   # the same score every time at the head
        m.handle(LeaseDone(lease_id="r0.u1", worker="w", round=0, version=m.version,
                           results=[RolloutResult(task_id="e0", score=0.0)]))
    assert m.noise.variance() == 0.0
    log: list = []
    merge(m, 0, ROUND, log=log)
    assert m.state == {"g0": "on", "g1": "on"}
    # The screen, the candidate on the evidence, three leave-one-out evals, the gate:
    # no second look at the two tasks it broke.
    assert [r.task_ids for r in log] == [["e0"], ["ef"], ["e1"], ["e0", "e1", "ef"],
                                         ["e0", "e1"], ["e0", "e1"], ["e0", "e1"], HELD]
