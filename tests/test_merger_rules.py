"""The Merger's optional acceptance rules, driven by messages alone (no bus, no
threads): the screen on each diff's evidence task, attribution of a fused commit's
diffs, retiring an accepted edit, recheck, the sequential gate and the noise test."""

from __future__ import annotations

from actors.addresses import PLANNER, SCHEDULER
from actors.machines.attribution import Probe, without
from actors.machines.merger import Merger
from actors.machines.scoring import NOISE_MIN_DF, NoiseMeter
from protocol import REMOVE, Barrier, Commit, Diff, EvalDone, EvalRequest, Finish, LeaseDone, \
    Open, RolloutResult, RoundClosed
from tests.merger_drive import answer_evals

HELD = [f"h{i}" for i in range(8)]
#: Held-out task -> the key it needs (h6, h7 need none: only "bad" solves them).
NEEDS = {"h0": "g0", "h1": "g1", "h2": "g2", "h3": "g0", "h4": "g1", "h5": "g2",
         "x0": "g0", "x1": "g1"}
#: "bad" solves h6 and h7 and breaks h0, h1, h2: on top of nothing it helps (2/8); on
#: top of g0..g2 it costs 3 tasks for 2 (5/8 against 6/8 without it). It breaks the
#: train tasks x0 and x1 too (their proposer has nothing to add: g0, g1 are in).
BROKEN_BY_BAD = {"h0", "h1", "h2"}
TRAIN_BROKEN_BY_BAD = {"x0", "x1"}


def solves(state: dict[str, str], task: str) -> float:
    if task in ("h6", "h7"):
        return 1.0 if "bad" in state else 0.0
    if task in BROKEN_BY_BAD | TRAIN_BROKEN_BY_BAD and "bad" in state:
        return 0.0
    return 1.0 if NEEDS.get(task) in state else 0.0


def d(key: str) -> Diff:
    return Diff(f"w:{key}", "w", 0, {key: "on"})


def answer(m: Merger, out: list, log: list) -> list:
    """Answer every EvalRequest (per-task scores from ``solves``) until none is left;
    the requests are kept in ``log``."""
    return answer_evals(m, out, solves, log)


def opened(**rules) -> Merger:
    m = Merger(**rules)
    answer(m, m.handle(Open(heldout_ids=HELD)), [])
    return m


def merge_round(m: Merger, r: int, diffs, evidence="t", log=None) -> tuple[list, RoundClosed]:
    m.handle(LeaseDone(lease_id=f"r{r}.u0", worker="w", round=r, results=[
        RolloutResult(task_id=evidence, score=0.0, diff=x) for x in diffs]))
    out = answer(m, m.handle(Barrier(round=r)), log if log is not None else [])
    closed = [msg for _, msg in out if isinstance(msg, RoundClosed)]
    return out, closed[-1]


def commits(out) -> list[Commit]:
    return [msg for to, msg in out if to == SCHEDULER and isinstance(msg, Commit)]


def test_without_the_rules_a_harmful_diff_rides_in_with_good_ones():
    m = opened()
    out, closed = merge_round(m, 0, [d("g0"), d("bad"), d("g1"), d("g2")])
    assert closed.committed and commits(out)[0].state.keys() == {"g0", "g1", "g2", "bad"}
    assert closed.outcomes == {"committed": 4}


def test_a_harmful_diff_fused_with_good_ones_is_found_and_dropped():
    m = opened(attribute=True)
    merge_round(m, 0, [d("g0")])                       # the head solves h0, h3: 2/8
    log: list = []
    out, closed = merge_round(m, 1, [d("g1"), d("bad"), d("g2")], log=log)
    # The fused candidate (5/8) beats the head (2/8) but regresses on h0 ("bad" breaks
    # it): scored afresh there it fails again, and of the three diffs taken back out
    # one at a time only "bad" repairs it; without "bad" the candidate scores 6/8.
    assert commits(out)[0].state == {"g0": "on", "g1": "on", "g2": "on"}
    assert closed.outcomes == {"committed": 2, "harmful": 1}
    assert m.score == 6 / 8 and (PLANNER, closed) in out
    # The gate, the control and three leave-one-out evals on the one regression, the
    # confirmation: the whole split twice, the rest one call each.
    assert [r.task_ids for r in log] == [HELD, ["h0"], ["h0"], ["h0"], ["h0"], HELD]


def test_a_failed_candidate_is_attributed_instead_of_bisected():
    """The fused candidate does worse than the head (3/6 against 4/6): its regressions
    (h0, h1) are put down to "bad", and the candidate without it is committed (6/6):
    two calls of control, two leave-one-out evals of two calls, one confirmation, where
    bisecting would score halves on the whole split."""
    held = ["h0", "h1", "h2", "h3", "h4", "h5"]
    m = Merger(attribute=True)
    answer(m, m.handle(Open(heldout_ids=held)), [])
    merge_round(m, 0, [d("g0"), d("g1")])
    assert m.score == 4 / 6
    log: list = []
    out, closed = merge_round(m, 1, [d("g2"), d("bad")], log=log)
    assert commits(out)[0].state == {"g0": "on", "g1": "on", "g2": "on"}
    assert closed.outcomes == {"committed": 1, "harmful": 1} and m.score == 1.0
    assert [len(r.task_ids) for r in log] == [6, 2, 2, 2, 6]


def test_a_regression_that_does_not_hold_on_a_second_look_is_the_noise():
    """The candidate's gate sample fails h3 (the model's noise: g0 solves it); scored
    afresh it passes, so no diff is taken back out and the candidate is committed."""
    m = Merger(attribute=True)
    noise = {"h3": 1}   # the first time the candidate meets h3, it fails there

    def noisy_answer(out) -> list:
        result, pending = [], list(out)
        while pending:
            to, msg = pending.pop(0)
            if isinstance(msg, EvalRequest):
                scores = {t: solves(msg.state, t) for t in msg.task_ids}
                if "g1" in msg.state and noise.get("h3") and "h3" in scores:
                    scores["h3"], noise["h3"] = 0.0, 0
                pending += m.handle(EvalDone(eval_id=msg.eval_id, scores=scores,
                                             score=sum(scores.values()) / len(scores)))
            else:
                result.append((to, msg))
        return result

    noisy_answer(m.handle(Open(heldout_ids=HELD)))
    m.handle(LeaseDone(lease_id="r0", worker="w", round=0, results=[
        RolloutResult(task_id="t", score=0.0, diff=d("g0"))]))
    noisy_answer(m.handle(Barrier(round=0)))
    m.handle(LeaseDone(lease_id="r1", worker="w", round=1, results=[
        RolloutResult(task_id="t", score=0.0, diff=d("g1")),
        RolloutResult(task_id="t", score=0.0, diff=d("g2"))]))
    out = noisy_answer(m.handle(Barrier(round=1)))
    closed = [msg for _, msg in out if isinstance(msg, RoundClosed)][-1]
    assert closed.outcomes == {"committed": 2} and "harmful" not in m.outcomes
    assert m.state == {"g0": "on", "g1": "on", "g2": "on"}


def stuck(m: Merger, r: int, tasks, score: float = 0.0) -> None:
    """Rollouts of round ``r`` at the head that failed and brought no edit."""
    m.handle(LeaseDone(lease_id=f"r{r}.u1", worker="w", round=r, version=m.version,
                       results=[RolloutResult(task_id=t, score=score) for t in tasks]))


def test_an_accepted_edit_is_retired_when_removing_it_scores_better():
    m = opened(retire=True)
    _, first = merge_round(m, 0, [d("bad")])            # alone it helps: 2/8
    _, second = merge_round(m, 1, [d("g0"), d("g1"), d("g2")])   # 5/8 with "bad"
    assert first.committed and second.committed and "bad" in m.state
    # Train tasks x0, x1 fail at this head and their proposer has nothing new: when a
    # round commits nothing, the head is scored on them afresh (they fail again), its
    # keys are probed there, and "bad" is removed.
    stuck(m, 2, ["x0", "x1"])
    log: list = []
    out, third = merge_round(m, 2, [d("useless")], log=log)
    assert commits(out)[0].state == {"g0": "on", "g1": "on", "g2": "on"}
    assert third.committed and third.outcomes == {"below-threshold": 1, "retired": 1}
    assert m.score == 6 / 8
    # The gate (8 tasks), the control and the probes on the two stuck tasks, the
    # confirmation on the whole split: 8 + 2 x 5 + 8 calls.
    assert [len(r.task_ids) for r in log] == [8, 2, 2, 2, 2, 2, 8]
    # The stuck tasks are spent: the next stalled round probes nothing.
    _, fourth = merge_round(m, 3, [d("useless")])
    assert not fourth.committed and fourth.outcomes == {"below-threshold": 1}


def test_retiring_probes_nothing_without_stuck_tasks():
    """No train task is stuck at the head (every failed rollout proposed something):
    a stalled round costs its gate and nothing more (the deterministic router's
    case: retiring on by default costs it nothing)."""
    m = opened(retire=True)
    merge_round(m, 0, [d("bad")])
    merge_round(m, 1, [d("g0"), d("g1"), d("g2")])
    log: list = []
    out, closed = merge_round(m, 2, [d("useless")], log=log)
    assert not closed.committed and [len(r.task_ids) for r in log] == [8]


def test_a_stuck_task_the_head_passes_when_scored_again_is_not_probed():
    """x2 failed once at the head (the model's noise: the head solves it): the control
    says so and no probe is spent on it."""
    m = opened(retire=True)
    merge_round(m, 0, [d("g0")])
    stuck(m, 1, ["h0", "h3"])     # g0 solves both
    log: list = []
    out, closed = merge_round(m, 1, [d("useless")], log=log)
    assert not closed.committed and [r.task_ids for r in log[1:]] == [["h0", "h3"]]


def test_nothing_is_retired_when_every_key_earns_its_place():
    m = opened(retire=True)
    merge_round(m, 0, [d("g0"), d("g1"), d("g2")])
    stuck(m, 1, ["h6", "h7"])     # only "bad" would solve these: removing keys does not
    out, closed = merge_round(m, 1, [d("useless")])
    assert not commits(out) and not closed.committed and "retired" not in closed.outcomes


def test_the_screen_drops_a_diff_that_does_not_fix_its_own_evidence_task():
    m = opened(screen=True)
    log: list = []
    # Evidence h0: g0 fixes it, g1 does not; each costs one call on that task alone.
    out, closed = merge_round(m, 0, [d("g0"), d("g1")], evidence="h0", log=log)
    assert commits(out)[0].state == {"g0": "on"}
    assert closed.outcomes == {"screened-out": 1, "committed": 1}
    assert [r.task_ids for r in log[:2]] == [["h0"], ["h0"]]


def test_a_budget_that_refuses_the_screen_counts_every_proposal_unscored():
    m = opened(screen=True)
    m.handle(LeaseDone(lease_id="r0.u0", worker="w", round=0, results=[
        RolloutResult(task_id="t", score=0.0, diff=d(k)) for k in ("g0", "g1", "g2")]))
    requests = [msg for _, msg in m.handle(Barrier(round=0)) if isinstance(msg, EvalRequest)]
    out = [o for r in requests
           for o in m.handle(EvalDone(eval_id=r.eval_id, score=0.0, unscored="max_calls"))]
    closed = next(msg for _, msg in out if isinstance(msg, RoundClosed))
    assert not closed.committed and closed.proposals == 3
    assert closed.outcomes == {"unscored-at-budget": 3}


def test_the_screen_compares_conflicting_variants_on_a_minibatch_first():
    held = [f"h{i}" for i in range(40)]
    m = Merger(screen=True)
    answer(m, m.handle(Open(heldout_ids=held)), [])
    log: list = []
    m.handle(LeaseDone(lease_id="r0.u0", worker="w", round=0, results=[
        RolloutResult(task_id="x", score=None, diff=Diff("a", "a", 0, {"g0": "1"})),
        RolloutResult(task_id="x", score=None, diff=Diff("b", "b", 0, {"g0": "2"}))]))
    answer(m, m.handle(Barrier(round=0)), log)
    sizes = [len(r.task_ids) for r in log]
    # Two variants and the head on 16 held-out tasks, then the winner on all 40.
    assert sizes == [16, 16, 16, 40]


def test_probe_narrows_groups_down_to_the_harmful_units_within_its_budget():
    base = {f"k{i}": "on" for i in range(40)}
    units = [{f"k{i}": None} for i in range(40)]
    harmful = {7, 23}
    probe = Probe(base=base, units=units, tasks=["a", "b"], base_score=0.0, margin=0.25,
                  max_evals=24)
    assert probe.group == 4   # 40 units, 12 evals' worth of singles: groups of 4
    while True:
        batch = probe.batch()
        if not batch:
            break
        for i, state in batch:
            gone = {int(k[1:]) for k in base if k not in state}
            probe.scored(i, 1.0 if gone & harmful else 0.0)
        probe.step()
    assert sorted(probe.flagged) == [7, 23] and probe.evals <= 24
    assert without(base, [units[7]]) == {k: v for k, v in base.items() if k != "k7"}


def run_probe(probe: Probe, repaired) -> Probe:
    """Drive a probe to its end, each eval scored 1.0 when ``repaired(removed units)``."""
    while True:
        batch = probe.batch()
        if not batch:
            return probe
        for i, state in batch:
            probe.scored(i, 1.0 if repaired({k for k in probe.base if k not in state})
                         else 0.0)
        probe.step()


def test_probe_flags_two_units_that_repair_only_together():
    """k3 and k4 each shadow the task (two one-word rules that both sort before the right
    one): removing either alone repairs nothing, removing both does. Their group of
    three repairs, so does its half [k3, k4], and neither single does: both are flagged
    together, with no eval more."""
    base = {f"k{i:02d}": "on" for i in range(12)}
    units = [{k: None} for k in sorted(base)]
    probe = run_probe(Probe(base=base, units=units, tasks=["a"], base_score=0.0,
                            margin=0.5, max_evals=8),
                      lambda gone: {"k03", "k04"} <= gone)
    assert probe.group == 3 and sorted(probe.flagged) == [3, 4] and probe.evals == 4 + 2 + 2


def test_probe_flags_no_pair_on_one_repair_alone():
    """A group of two repaired once and neither of its units does: with nothing else to
    repeat that repair (it may have been the model's noise), nothing is flagged."""
    base = {"k0": "on", "k1": "on"}
    probe = run_probe(Probe(base=base, units=[{"k0": None}, {"k1": None}], tasks=["a"],
                            base_score=0.0, margin=0.5, max_evals=24, group=2),
                      lambda gone: gone == {"k0", "k1"})
    assert probe.flagged == [] and probe.evals == 3


def test_probe_keeps_each_unit_in_alone_to_find_a_pair_inside_a_larger_group():
    """A group of four whose halves split the pair (k0 with k2): each unit is kept in
    alone; keeping k0 or k2 in stops the repair, so those two are flagged, not k1, k3."""
    base = {f"k{i}": "on" for i in range(4)}
    units = [{f"k{i}": None} for i in range(4)]
    probe = run_probe(Probe(base=base, units=units, tasks=["a"], base_score=0.0,
                            margin=0.5, max_evals=24, group=4),
                      lambda gone: {"k0", "k2"} <= gone)
    assert sorted(probe.flagged) == [0, 2]
    assert probe.evals == 1 + 2 + 4   # the group, its halves, one keep-in per unit


def test_an_accepted_pair_that_shadows_a_blocked_edit_together_is_retired():
    """The head holds p and q (each solves a held-out task of its own) among 25 keys;
    together they break train task x0, whose right edit g0 the screen then drops (either
    one still shadows it). Retiring probes the head with g0 in, in groups of three:
    [p, q, z00] repairs x0, so does [p, q], neither p nor q alone: both are flagged,
    and the head without them, with g0 (3 held-out tasks for 2), is committed."""
    held = [f"h{i}" for i in range(6)]
    head = {"p": "on", "q": "on", **{f"z{i:02d}": "on" for i in range(23)}}

    def solves_pair(state, task):
        if task in ("x0", "h0", "h1", "h2"):   # g0's tasks: shadowed while p or q is in
            return 1.0 if "g0" in state and not ({"p", "q"} & state.keys()) else 0.0
        return 1.0 if {"h3": "p", "h4": "q"}.get(task) in state else 0.0

    m = Merger(screen=True, retire=True)
    log: list = []

    def ask(out):
        return answer_evals(m, out, solves_pair, log)

    ask(m.handle(Open(heldout_ids=held, initial_state=head)))
    assert m.score == 2 / 6
    m.handle(LeaseDone(lease_id="r0.u0", worker="w", round=0, version=0, results=[
        RolloutResult(task_id="x0", score=0.0, diff=d("g0")),
        RolloutResult(task_id="x0b", score=0.0)]))
    out = ask(m.handle(Barrier(round=0)))
    closed = [msg for _, msg in out if isinstance(msg, RoundClosed)][-1]
    assert "p" not in m.state and "q" not in m.state and "g0" in m.state
    assert len(m.state) == 24 and m.score == 3 / 6
    # g0 was screened out, and is committed after all: one outcome for one proposal.
    assert closed.outcomes == {"retired": 2, "committed": 1}


# -- a diff that deletes a key (protocol.REMOVE) ------------------------------------------


def test_a_removal_diff_from_the_proposer_deletes_an_accepted_key():
    from actors.artifacts import AppendRules, KeyedRules
    from protocol import REMOVE

    m = opened()
    merge_round(m, 0, [d("bad")])
    merge_round(m, 1, [d("g0"), d("g1"), d("g2")])
    assert m.state.keys() == {"bad", "g0", "g1", "g2"}
    # A proposer that asks to take "bad" out: an op of empty text, committed like any.
    out, closed = merge_round(m, 2, [Diff("w:-bad", "w", 2, {"bad": REMOVE})])
    assert commits(out)[0].state == {"g0": "on", "g1": "on", "g2": "on"}
    assert closed.outcomes == {"committed": 1}
    # Removing what the head does not hold changes nothing.
    _, again = merge_round(m, 3, [Diff("w:-bad", "w", 3, {"bad": REMOVE})])
    assert again.outcomes == {"unchanged": 1}
    # The strategies that can say it: "remove: ..." names a held rule or category.
    rules = AppendRules()
    held = rules.to_diff({}, "route refunds to returns", "w", 0).ops
    assert rules.to_diff(held, "remove: route refunds to returns", "w", 1).ops == {
        next(iter(held)): REMOVE}
    assert rules.to_diff({}, "remove: route refunds to returns", "w", 1) is None
    keyed = KeyedRules(["tone"])
    assert keyed.to_diff({"tone": "formal"}, "remove: Tone", "w", 1).ops == {"tone": REMOVE}
    assert KeyedRules(["remove"]).to_diff({}, "remove: x", "w", 0).ops == {"remove": "x"}


def test_a_removal_and_a_write_of_the_same_key_conflict_and_the_better_wins():
    from protocol import REMOVE

    m = opened()
    merge_round(m, 0, [d("bad")])
    merge_round(m, 1, [d("g0"), d("g1"), d("g2")])   # 5/8
    out, closed = merge_round(m, 2, [Diff("a", "a", 2, {"bad": "other"}),
                                     Diff("b", "b", 2, {"bad": REMOVE})])
    # Writing "other" keeps "bad" in the state (5/8 again); removing it scores 6/8.
    assert commits(out)[0].state == {"g0": "on", "g1": "on", "g2": "on"}
    assert closed.outcomes == {"conflict": 1, "committed": 1}


def test_tensor_parallel_merge_applies_a_removal():
    from actors.policies.parallelism import TensorParallelMerge
    from protocol import REMOVE

    tp = TensorParallelMerge(n_sections=1)
    merged, ok = tp.merge({"a": "1", "b": "2"}, [(0, Diff("x", "w", 0, {"a": REMOVE}))])
    assert ok and merged == {"b": "2"}


def test_recheck_scores_a_close_call_twice_and_decides_on_the_means():
    """A noisy gate: the first sample of the candidate says 3/8 against the head's 2/8
    (a gain of one task, a close call); the second samples say 1/8 and 3/8: the means
    (2/8 against 2.5/8) keep the head, and the head's score becomes its mean."""
    samples = {"cand": [3 / 8, 1 / 8], "head": [2 / 8, 3 / 8]}
    m = Merger(recheck=True)
    asked: list[str] = []

    def answer_all(out) -> list:
        result, pending = [], list(out)
        while pending:
            to, msg = pending.pop(0)
            if isinstance(msg, EvalRequest):
                which = "cand" if "x" in msg.state else "head"
                score = samples[which][asked.count(which)]
                asked.append(which)
                pending += m.handle(EvalDone(eval_id=msg.eval_id, score=score))
            else:
                result.append(msg)
        return result

    answer_all(m.handle(Open(heldout_ids=HELD)))
    m.handle(LeaseDone(lease_id="r0.u0", worker="w", round=0, results=[
        RolloutResult(task_id="t", score=0.0, diff=d("x"))]))
    closed = [msg for msg in answer_all(m.handle(Barrier(round=0)))
              if isinstance(msg, RoundClosed)][0]
    assert asked == ["head", "cand", "cand", "head"]
    assert not closed.committed and closed.outcomes == {"rechecked-out": 1}
    assert m.score == 2.5 / 8


def test_recheck_leaves_a_clear_gain_alone():
    m = opened(recheck=True)
    log: list = []
    out, closed = merge_round(m, 0, [d("g0"), d("g1")], log=log)
    assert closed.committed and len(log) == 1   # 4/8 against 0/8: one gate, no recheck


# -- the sequential gate ------------------------------------------------------------------


def test_the_sequential_gate_stops_a_candidate_behind_the_head_on_its_first_tasks():
    """The head holds g0..g2 (6/8); "bad" breaks h0..h2. On the first 4 held-out tasks
    it solves 1 where the head solves 4: it stops there, the rest is never scored."""
    m = Merger(sequential=True, sequential_first=4, sequential_slack=1.0)
    answer(m, m.handle(Open(heldout_ids=HELD,
                            initial_state={"g0": "on", "g1": "on", "g2": "on"})), [])
    assert m.score == 6 / 8
    log: list = []
    out, closed = merge_round(m, 0, [d("bad")], log=log)
    assert [r.task_ids for r in log] == [["h0", "h1", "h2", "h3"]]
    assert not commits(out) and not closed.committed
    assert closed.outcomes == {"below-threshold": 1} and m.stats["gate-stopped"] == 1


def test_the_sequential_gate_scores_the_rest_of_a_promising_candidate():
    """Ahead on its first tasks, a candidate is scored on the rest too; the two parts
    make its held-out score (the decision of the whole split), and its per-task
    scores are complete, so the next gate is sequential again."""
    m = opened(sequential=True, sequential_first=4)
    log: list = []
    out, closed = merge_round(m, 0, [d("g0"), d("g1"), d("g2")], log=log)
    assert [r.task_ids for r in log] == [["h0", "h1", "h2", "h3"], ["h4", "h5", "h6", "h7"]]
    assert closed.committed and m.score == 6 / 8 and closed.heldout_reward == 6 / 8
    assert commits(out)[0].state == {"g0": "on", "g1": "on", "g2": "on"}
    log = []
    _, second = merge_round(m, 1, [d("bad")], log=log)
    # The window moved on (h4..h7): "bad" solves h6, h7 there without breaking h4,
    # h5, so it goes on to h0..h3, where it breaks three: 5/8 < 6/8.
    assert [r.task_ids for r in log] == [["h4", "h5", "h6", "h7"], ["h0", "h1", "h2", "h3"]]
    assert not second.committed and m.score == 6 / 8


def test_without_per_task_scores_of_the_head_the_gate_scores_the_whole_split():
    m = Merger(sequential=True, sequential_first=4)
    out = m.handle(Open(heldout_ids=HELD))
    (_, req), = out
    m.handle(EvalDone(eval_id=req.eval_id, score=0.0))   # a mean, no per-task scores
    log: list = []
    _, closed = merge_round(m, 0, [d("g0")], log=log)
    assert [r.task_ids for r in log] == [HELD] and closed.committed


def test_a_harmful_diff_fused_with_good_ones_is_dropped_behind_the_sequential_gate():
    m = opened(attribute=True, sequential=True, sequential_first=4)
    merge_round(m, 0, [d("g0")])
    out, closed = merge_round(m, 1, [d("g1"), d("bad"), d("g2")])
    assert commits(out)[0].state == {"g0": "on", "g1": "on", "g2": "on"}
    assert closed.outcomes == {"committed": 2, "harmful": 1} and m.score == 6 / 8


def test_an_accepted_edit_is_retired_behind_the_sequential_gate():
    m = opened(retire=True, sequential=True, sequential_first=4)
    merge_round(m, 0, [d("bad")])
    merge_round(m, 1, [d("g0"), d("g1"), d("g2")])
    assert "bad" in m.state
    stuck(m, 2, ["x0", "x1"])
    out, third = merge_round(m, 2, [d("useless")])
    assert commits(out)[0].state == {"g0": "on", "g1": "on", "g2": "on"}
    assert third.outcomes == {"below-threshold": 1, "retired": 1} and m.score == 6 / 8


# -- one gate a merge: conflicts="first" ---------------------------------------------------


def test_conflicts_first_keeps_the_first_proposer_unscored_and_pays_one_gate():
    from protocol import REMOVE

    m = opened(conflicts="first")
    merge_round(m, 0, [d("bad")])
    merge_round(m, 1, [d("g0"), d("g1"), d("g2")])   # 5/8 with "bad"
    log: list = []
    out, closed = merge_round(m, 2, [Diff("a", "a", 2, {"bad": "other"}), d("g9"),
                                     Diff("b", "b", 2, {"bad": REMOVE})], log=log)
    # Plan order: "a" writes "bad" first, so it goes on unscored and "b" (the better
    # removal) is a conflict. One eval, the fused candidate's, and it does not beat the
    # head (5/8 again), so its two diffs are bisected: two more evals, no commit.
    assert [r.task_ids for r in log] == [HELD, HELD, HELD]
    assert not commits(out) and not closed.committed
    assert closed.outcomes == {"conflict": 1, "below-threshold": 2}


def test_conflicts_first_pays_one_gate_for_a_round_of_variants():
    m = opened(conflicts="first")
    log: list = []
    out, closed = merge_round(m, 0, [Diff("a", "a", 0, {"g0": "x"}), d("g1"),
                                      Diff("b", "b", 0, {"g0": "y"}),
                                      Diff("c", "c", 0, {"g1": "z"})], log=log)
    assert [r.task_ids for r in log] == [HELD]
    assert commits(out)[0].state == {"g0": "x", "g1": "on"}
    assert closed.outcomes == {"conflict": 2, "committed": 2} and m.score == 4 / 8


def test_conflicts_names_its_choices():
    import pytest

    from actors import evolve
    from actors.errors import ConfigError
    from protocol import Task

    with pytest.raises(ValueError, match="conflicts='best'"):
        Merger(conflicts="best")
    with pytest.raises(ConfigError, match="conflicts='best'.*'score', 'first'"):
        evolve([Task(id="t0", prompt="p")], lambda t, o: 0.0, run=lambda r, t: "",
               propose=lambda *a: None, conflicts="best")


# -- the noise test: acceptance by the reward noise measured from repeated samples -------


def test_the_noise_meter_pools_the_variance_of_repeated_samples():
    meter = NoiseMeter()
    for i in range(NOISE_MIN_DF):
        meter.add("s", f"t{i}", 1.0)
        assert meter.variance() is None or i == NOISE_MIN_DF - 1
        meter.add("s", f"t{i}", 1.0 if i % 2 else 0.0)   # every other pair disagrees
    # A disagreeing pair's two samples deviate 0.5 from their mean: 0.5 a pair, 0 else.
    assert meter.df == NOISE_MIN_DF and meter.variance() == 0.25
    meter.add("other state", "t0", 0.0)   # a first sample adds nothing
    assert meter.df == NOISE_MIN_DF


def noisy(m: Merger, agree: bool) -> None:
    """Rollouts at the head: each of NOISE_MIN_DF train tasks twice, the two samples
    disagreeing on every other task (or never)."""
    for rep in range(2):
        m.handle(LeaseDone(lease_id=f"n{rep}", worker="w", round=0, version=m.version,
                           results=[RolloutResult(task_id=f"n{i}", score=float(
                               rep == 0 or agree or i % 2)) for i in range(NOISE_MIN_DF)]))


def test_a_close_call_is_decided_by_the_noise_test():
    """The noise measured from repeated rollouts is a variance of 0.25 a sample: on 8
    held-out tasks the standard error of a difference is 0.25. g0 alone gains 2/8, not
    more than one standard error: rejected with noise_z=1, accepted without the test;
    g0 and g1 together gain 4/8: accepted."""
    for z, want in ((1.0, False), (0.0, True)):
        m = opened(noise_z=z)
        noisy(m, agree=False)
        assert m.noise.variance() == 0.25
        _, closed = merge_round(m, 0, [d("g0")])
        assert closed.committed is want
    m = opened(noise_z=1.0)
    noisy(m, agree=False)
    _, closed = merge_round(m, 0, [d("g0"), d("g1")])
    assert closed.committed and m.score == 4 / 8


def test_a_deterministic_model_measures_no_noise_and_the_test_is_strict():
    m = opened(noise_z=1.0)
    noisy(m, agree=True)
    assert m.noise.variance() == 0.0
    _, closed = merge_round(m, 0, [d("g0")])
    assert closed.committed   # 2/8 > 0/8: no noise, so strictly better is enough


def test_without_enough_repeats_a_candidate_need_only_beat_the_head():
    m = opened(noise_z=3.0)
    _, closed = merge_round(m, 0, [d("g0")])
    assert m.noise.variance() is None and closed.committed


def test_a_head_that_keeps_winning_is_scored_again_and_its_score_becomes_the_mean():
    """The head's one held-out score (4/8) may be a lucky one: after two merges in a row
    that commit nothing it is scored afresh (2/8 this time), its score becomes the mean
    of the two (3/8), and each held-out task scored twice is a repeated sample for the
    noise."""
    m = opened(noise_z=1.0)
    merge_round(m, 0, [d("g0"), d("g1")])          # 4/8
    assert m.score == 4 / 8
    df = m.noise.df
    requests: list = []

    def fresh(out) -> list:
        result, pending = [], list(out)
        while pending:
            to, msg = pending.pop(0)
            if isinstance(msg, EvalRequest):
                requests.append(msg)
                scores = {t: solves(msg.state, t) for t in msg.task_ids}
                if msg.state == m.state and msg.task_ids == HELD:   # the fresh sample
                    scores = dict(scores, h0=0.0, h1=0.0)
                pending += m.handle(EvalDone(eval_id=msg.eval_id, scores=scores,
                                             score=sum(scores.values()) / len(scores)))
            else:
                result.append(msg)
        return result

    for r in (1, 2):
        m.handle(LeaseDone(lease_id=f"r{r}.u0", worker="w", round=r, version=m.version,
                           results=[RolloutResult(task_id="t", score=0.0, diff=d("useless"))]))
        fresh(m.handle(Barrier(round=r)))
    head_evals = [r for r in requests if r.state == m.state]
    assert len(head_evals) == 1 and m.head_samples == 2
    assert m.score == 3 / 8
    # Each held-out task's two samples (2 of 8 pairs disagree), and task t rolled out
    # twice at this head.
    assert m.noise.df == df + len(HELD) + 1
    assert m.noise.sum_sq == 2 * 0.5


def test_an_edit_blocked_by_an_accepted_one_is_taken_in_when_the_blocker_is_retired():
    """ "bad" is in the head (alone it helped). g0 and g1 are the right edits for the
    train tasks x0 and x1, but "bad" breaks those tasks, so the screen drops both: the
    tasks are stuck, with their edits blocked. Retiring probes the head's keys on them
    with the blocked edits in: taking "bad" out repairs both, each edit then fixes its
    own task, and the head without "bad", with g0 and g1, is committed (4/8 > 2/8)."""
    m = opened(screen=True, retire=True)
    _, first = merge_round(m, 0, [d("bad")], evidence="h6")
    assert first.committed and m.state == {"bad": "on"}
    m.handle(LeaseDone(lease_id="r1.u0", worker="w", round=1, version=m.version, results=[
        RolloutResult(task_id="x0", score=0.0, diff=d("g0")),
        RolloutResult(task_id="x1", score=0.0, diff=d("g1"))]))
    log: list = []
    out = answer(m, m.handle(Barrier(round=1)), log)
    closed = [msg for _, msg in out if isinstance(msg, RoundClosed)][-1]
    assert commits(out)[-1].state == {"g0": "on", "g1": "on"} and m.score == 4 / 8
    assert closed.outcomes == {"retired": 1, "committed": 2}   # (screened out first)
    assert m.outcomes == {"committed": 3, "retired": 1}
    # Two screens, the control and the one probe eval on the two stuck tasks, one call
    # per blocked edit, the confirmation on the whole split.
    assert [r.task_ids for r in log] == [["x0"], ["x1"], ["x0", "x1"], ["x0", "x1"],
                                         ["x0"], ["x1"], HELD]


def test_a_blocked_edit_of_an_earlier_round_taken_in_is_counted_as_carried():
    """g0 is screened out in round 1 (blocked by "bad"; one stuck task is too few to
    probe), g1 in round 2; retiring "bad" then takes both in. Round 2 counts its own g1
    as committed and g0, round 1's, in ``carried``; the run counts each once."""
    m = opened(screen=True, retire=True)
    merge_round(m, 0, [d("bad")], evidence="h6")
    m.handle(LeaseDone(lease_id="r1.u0", worker="w", round=1, version=m.version,
                       results=[RolloutResult(task_id="x0", score=0.0, diff=d("g0"))]))
    out = answer(m, m.handle(Barrier(round=1)), [])
    first = [msg for _, msg in out if isinstance(msg, RoundClosed)][-1]
    assert not first.committed and first.outcomes == {"screened-out": 1}
    m.handle(LeaseDone(lease_id="r2.u0", worker="w", round=2, version=m.version,
                       results=[RolloutResult(task_id="x1", score=0.0, diff=d("g1"))]))
    out = answer(m, m.handle(Barrier(round=2)), [])
    second = [msg for _, msg in out if isinstance(msg, RoundClosed)][-1]
    assert m.state == {"g0": "on", "g1": "on"}
    assert second.outcomes == {"retired": 1, "committed": 1}
    assert second.carried == {"committed": 1}
    assert m.outcomes == {"committed": 3, "retired": 1}


def test_once_the_model_is_noisy_the_screen_looks_at_the_head_again_first():
    """The head solves h0; a rollout of h0 failed (the model's noise) and proposed
    "bad". With the noise measured, the screen scores the head on h0 again first: it
    passes, so "bad" is screened out without a call of its own, and no gate is paid."""
    m = opened(screen=True)
    merge_round(m, 0, [d("g0")], evidence="h0")
    noisy(m, agree=False)
    log: list = []
    _, closed = merge_round(m, 1, [d("bad")], evidence="h0", log=log)
    assert not closed.committed and closed.outcomes == {"screened-out": 1}
    assert [(r.state, r.task_ids) for r in log] == [({"g0": "on"}, ["h0"])]


def test_the_screen_turns_down_to_sampling_once_it_screens_nothing_out():
    m = Merger(screen=True)
    # Nothing decided yet: every diff of a first merge is looked at, however many.
    assert all(m._screen_this() for _ in range(12))
    m.screen_seen, m.screen_looked = 0, 4   # four decided, none screened out
    looked = [m._screen_this() for _ in range(8)]
    assert looked == [False, False, False, True] * 2   # one in four
    m.screen_out = 1   # one of the four it decided: at least one in ten, every diff
    assert all(m._screen_this() for _ in range(4))


def test_the_screen_judges_a_merge_on_earlier_merges_only():
    """A first merge of eight diffs is screened whole: the record counts decided diffs,
    and none was decided when the merge began (judging on diffs merely looked at, it
    looked at four and one in four after, since none was screened out yet)."""
    m = opened(screen=True)
    log: list = []
    _, closed = merge_round(m, 0, [d("g0")] + [d(f"u{i}") for i in range(7)],
                            evidence="h0", log=log)
    assert [r.task_ids for r in log[:8]] == [["h0"]] * 8
    assert closed.outcomes == {"screened-out": 7, "committed": 1}
    assert (m.screen_looked, m.screen_out) == (8, 7)


def test_a_merge_too_small_for_a_gate_holds_its_diff_for_the_next():
    """With ``hold``, a merge left with one diff pays no held-out gate: the diff waits,
    and the next merge gates it with its own in one candidate (one gate for two)."""
    m = opened(hold=True)
    log: list = []
    _, first = merge_round(m, 0, [d("g0")], log=log)
    assert not first.committed and log == [] and m.stats["held"] == 1
    assert first.outcomes == {"held": 1}
    _, second = merge_round(m, 1, [d("g1"), d("g0")], log=log)
    assert second.committed and m.state == {"g0": "on", "g1": "on"}
    assert second.outcomes == {"duplicate": 1, "committed": 1}
    assert second.carried == {"committed": 1}
    assert [r.task_ids for r in log] == [HELD]


def test_a_held_diff_is_gated_alone_by_the_next_merge():
    """A diff is held by one merge at most: the next one gates it even alone."""
    m = opened(hold=True)
    log: list = []
    merge_round(m, 0, [d("g0")], log=log)
    _, second = merge_round(m, 1, [], log=log)       # nothing new: gated alone
    assert second.committed and m.state == {"g0": "on"} and [r.task_ids for r in log] == [HELD]
    assert second.outcomes == {} and second.carried == {"committed": 1}
    assert m.stats["held"] == 1


def test_a_diff_still_held_when_the_run_stops_is_counted():
    m = opened(hold=True)
    merge_round(m, 0, [d("g0")])
    (_, done), = m.handle(Finish(stop_reason="max_calls"))
    assert done.outcomes == {"held-at-stop": 1} and done.state == {}


def test_a_held_diff_is_counted_in_the_round_that_proposed_it():
    """Each round's outcomes count its own proposals, one outcome each: a diff held by
    ``hold`` is ``held`` in its round; the next merge's decision about it is in that
    merge's ``carried``, not its outcomes; the run's totals count each diff's fate once."""
    m = opened(hold=True)
    _, first = merge_round(m, 0, [d("g0"), d("g0"), d("g0")])
    assert first.proposals == 3 and first.outcomes == {"duplicate": 2, "held": 1}
    _, second = merge_round(m, 1, [d("g1"), d("g2")])
    assert second.proposals == 2 and second.outcomes == {"committed": 2}
    assert second.committed and second.carried == {"committed": 1}
    assert m.state == {"g0": "on", "g1": "on", "g2": "on"}
    (_, done), = m.handle(Finish(stop_reason="rounds"))
    assert done.outcomes == {"duplicate": 2, "committed": 3}


def test_a_held_diff_that_loses_its_gate_is_counted_as_carried():
    m = opened(hold=True)
    _, first = merge_round(m, 0, [d("u0")])
    assert first.outcomes == {"held": 1}
    _, second = merge_round(m, 1, [])
    assert not second.committed and second.outcomes == {}
    assert second.carried == {"below-threshold": 1}
    assert m.outcomes == {"below-threshold": 1}


def _lucky_first(lucky_state: dict, lucky_tasks: set):
    """``solves``, but the first held-out sample of ``lucky_state`` also passes
    ``lucky_tasks`` (the model's noise in its favour, once)."""
    seen: set = set()

    def score(m: Merger, out: list, log: list) -> list:
        def noisy(state, task):
            base = solves(state, task)
            if state == lucky_state and task in lucky_tasks and task not in seen:
                seen.add(task)
                return 1.0
            return base
        return answer_evals(m, out, noisy, log)
    return score


def test_a_stalled_head_is_scored_again_and_gated_on_the_mean_of_its_samples():
    """A head committed on a lucky sample (4/8; 2/8 is what it solves) keeps out a
    candidate that solves 4/8 (a tie is not a gain). After two merges that commit
    nothing on a model seen to be noisy, the head is scored afresh (one held-out eval)
    and its score is the mean of its samples (3/8): the candidate then beats it."""
    answer_lucky = _lucky_first({"g0": "on"}, {"h6", "h7"})
    m = Merger(rescore=3)
    answer_lucky(m, m.handle(Open(heldout_ids=HELD)), [])

    def merge(r: int, diffs, log=None):
        m.handle(LeaseDone(lease_id=f"r{r}.u0", worker="w", round=r, results=[
            RolloutResult(task_id="t", score=0.0, diff=x) for x in diffs]))
        out = answer_lucky(m, m.handle(Barrier(round=r)), [] if log is None else log)
        return [msg for _, msg in out if isinstance(msg, RoundClosed)][-1]

    assert merge(0, [d("g0")]).committed and m.score == 4 / 8
    # The same train task at this head: failed once, passed once (the model is noisy).
    stuck(m, 1, ["t"], score=1.0)
    stuck(m, 1, ["t"], score=0.0)
    solves_two_more = Diff("w:u", "w", 1, {"bad": "on", "g1": "on"})   # h3 h4 h6 h7
    assert not merge(1, [solves_two_more]).committed   # 4/8 against a lucky 4/8
    log: list = []
    second = merge(2, [solves_two_more], log)
    assert not second.committed
    assert [r.task_ids for r in log] == [HELD] and log[0].state == {"g0": "on"}
    assert m.score == 3 / 8 and m.head_samples == 2
    assert merge(3, [solves_two_more]).committed and m.score == 4 / 8


def test_a_deterministic_model_never_rescores_its_head():
    m = opened(rescore=3)
    merge_round(m, 0, [d("g0")])
    stuck(m, 1, ["t"])
    stuck(m, 1, ["t"])          # the same score twice: not noisy
    log: list = []
    for r in (1, 2, 3):
        merge_round(m, r, [d("u0")], log=log)
    assert all(r.state != {"g0": "on"} for r in log) and m.head_samples == 1


def _needs_g9(state: dict[str, str], task: str) -> float:
    """``solves``, with train tasks x9a, x9b that need a key (g9) no held-out task needs."""
    if task in ("x9a", "x9b"):
        return 1.0 if "g9" in state else 0.0
    return solves(state, task)


def test_an_edit_the_held_out_split_cannot_see_is_judged_on_failing_train_tasks():
    """With ``level``, a candidate level with the head on the held-out split (no
    held-out task needs g9) is scored on the train tasks seen failing at the head, the
    head afresh there unless the model is measured deterministic: it passes both, the
    head neither, so it is committed. Without ``level`` it is ``below-threshold``."""
    for level, want in ((True, {"committed": 1}), (False, {"below-threshold": 1})):
        m = Merger(level=level)
        answer_evals(m, m.handle(Open(heldout_ids=HELD)), _needs_g9)
        stuck(m, 0, ["x9a", "x9b"])
        m.handle(LeaseDone(lease_id="r0.u0", worker="w", round=0, results=[
            RolloutResult(task_id="x9a", score=0.0, diff=d("g9"))]))
        log: list = []
        out = answer_evals(m, m.handle(Barrier(round=0)), _needs_g9, log)
        (closed,) = [msg for _, msg in out if isinstance(msg, RoundClosed)]
        assert closed.outcomes == want and closed.committed == level
        if level:   # the candidate there, and the head afresh (the noise is not known)
            assert [r.task_ids for r in log[1:]] == [["x9a", "x9b"]] * 2
            assert m.state == {"g9": "on"} and m.stats["level-committed"] == 1


def test_a_level_candidate_that_fixes_no_failing_train_task_is_below_threshold():
    m = Merger(level=True)
    answer_evals(m, m.handle(Open(heldout_ids=HELD)), _needs_g9)
    stuck(m, 0, ["x9a", "x9b"])
    m.handle(LeaseDone(lease_id="r0.u0", worker="w", round=0, results=[
        RolloutResult(task_id="x9a", score=0.0, diff=d("u0"))]))
    out = answer_evals(m, m.handle(Barrier(round=0)), _needs_g9)
    (closed,) = [msg for _, msg in out if isinstance(msg, RoundClosed)]
    assert closed.outcomes == {"below-threshold": 1} and m.stats["level-checked"] == 1


def test_a_candidate_behind_the_head_is_not_judged_on_train_tasks():
    """Behind by more than one held-out task (g0 taken out and g9 put in: 4/8 against
    6/8), a candidate is not level: no train check, whatever it fixes there."""
    m = opened(level=True)
    merge_round(m, 0, [d("g0"), d("g1"), d("g2")])
    stuck(m, 1, ["x9a", "x9b"])
    log: list = []
    swap = Diff("w:swap", "w", 1, {"g0": REMOVE, "g9": "on"})
    _, closed = merge_round(m, 1, [swap], log=log)
    assert closed.outcomes == {"below-threshold": 1} and [r.task_ids for r in log] == [HELD]
    assert "level-checked" not in m.stats


def test_a_fused_candidate_level_with_the_head_keeps_only_the_diffs_train_tasks_back():
    """g9 (no held-out task needs it) fused with "bad" (5/8 against the head's 6/8) is
    level; each diff is scored alone on the train tasks failing at the head: g9 passes
    both, "bad" neither, so g9 alone is gated (6/8, level) and committed."""
    m = Merger(level=True, attribute=True)
    answer_evals(m, m.handle(Open(heldout_ids=HELD)), _needs_g9)

    def merge(r: int, diffs):
        m.handle(LeaseDone(lease_id=f"r{r}.u0", worker="w", round=r, results=[
            RolloutResult(task_id="t", score=0.0, diff=x) for x in diffs]))
        out = answer_evals(m, m.handle(Barrier(round=r)), _needs_g9)
        return out, [msg for _, msg in out if isinstance(msg, RoundClosed)][-1]

    merge(0, [d("g0"), d("g1"), d("g2")])
    stuck(m, 1, ["x9a", "x9b"])
    out, closed = merge(1, [d("g9"), d("bad")])
    assert closed.outcomes == {"committed": 1, "below-threshold": 1}
    assert commits(out)[-1].state == {"g0": "on", "g1": "on", "g2": "on", "g9": "on"}
    assert m.stats["level-committed"] == 1 and m.score == 6 / 8


def test_a_model_measured_deterministic_pays_no_head_eval_in_the_train_check():
    m = Merger(level=True)
    answer_evals(m, m.handle(Open(heldout_ids=HELD)), _needs_g9)
    for _ in range(NOISE_MIN_DF + 1):   # the same score every time: variance 0
        stuck(m, 0, ["x9a", "x9b"])
    assert m.noise.variance() == 0.0
    m.handle(LeaseDone(lease_id="r0.u0", worker="w", round=0, results=[
        RolloutResult(task_id="x9a", score=0.0, diff=d("g9"))]))
    log: list = []
    answer_evals(m, m.handle(Barrier(round=0)), _needs_g9, log)
    assert [r.task_ids for r in log[1:]] == [["x9a", "x9b"]] and m.state == {"g9": "on"}


def _vouch_round(m: Merger, r: int, task: str, diff: Diff, solves_fn) -> RoundClosed:
    m.handle(LeaseDone(lease_id=f"r{r}.u0", worker="w", round=r, results=[
        RolloutResult(task_id=task, score=0.0, diff=diff)]))
    out = answer_evals(m, m.handle(Barrier(round=r)), solves_fn)
    return [msg for _, msg in out if isinstance(msg, RoundClosed)][-1]


def test_an_edit_the_held_out_split_cannot_see_is_vouched_for_by_two_train_tasks():
    """With ``vouch=2``, g9 (no held-out task needs it: level with the head there)
    passes the screen on x9a and is ``below-threshold``; proposed again from x9b it has
    fixed two distinct train tasks, and the level candidate is committed at no call of
    its own. Without ``vouch`` it is turned down both times."""
    for vouch, second in ((2, {"committed": 1}), (0, {"below-threshold": 1})):
        m = Merger(screen=True, vouch=vouch)
        answer_evals(m, m.handle(Open(heldout_ids=HELD)), _needs_g9)
        first = _vouch_round(m, 0, "x9a", d("g9"), _needs_g9)
        assert first.outcomes == {"below-threshold": 1} and not first.committed
        closed = _vouch_round(m, 1, "x9b", d("g9"), _needs_g9)
        assert closed.outcomes == second and closed.committed == bool(vouch)
        assert (m.state == {"g9": "on"}) == bool(vouch)
        assert m.stats.get("vouched", 0) == (1 if vouch else 0)


def test_an_edit_proposed_again_from_the_same_task_is_not_vouched_for():
    m = Merger(screen=True, vouch=2)
    answer_evals(m, m.handle(Open(heldout_ids=HELD)), _needs_g9)
    for r in range(3):   # the same evidence task every time: one task, not three
        closed = _vouch_round(m, r, "x9a", d("g9"), _needs_g9)
        assert closed.outcomes == {"below-threshold": 1}
    assert m.state == {} and "vouched" not in m.stats


def _costs_two(state: dict[str, str], task: str) -> float:
    """``_needs_g9``, where g9 also breaks h0 and h3 (two held-out tasks g0 solves)."""
    if task in ("h0", "h3") and "g9" in state:
        return 0.0
    return _needs_g9(state, task)


def test_a_vouched_edit_behind_the_head_by_more_than_a_task_is_not_committed():
    """g9 fixes x9a and x9b (vouched for) but costs two held-out tasks (6/8 -> 4/8):
    not level, so the train evidence does not carry it in."""
    m = Merger(screen=True, vouch=2)
    answer_evals(m, m.handle(Open(heldout_ids=HELD)), _costs_two)
    m.handle(LeaseDone(lease_id="r0.u0", worker="w", round=0, results=[   # unscreened
        RolloutResult(task_id="t", score=None, diff=x) for x in (d("g0"), d("g1"), d("g2"))]))
    answer_evals(m, m.handle(Barrier(round=0)), _costs_two)
    assert m.score == 6 / 8
    _vouch_round(m, 1, "x9a", d("g9"), _costs_two)
    closed = _vouch_round(m, 2, "x9b", d("g9"), _costs_two)
    assert closed.outcomes == {"below-threshold": 1} and "g9" not in m.state
    assert len(m._vouch[frozenset(d("g9").ops.items())]) == 2   # vouched, and still out


def test_vouch_names_its_values():
    for bad in (-1, True, 1.5):
        try:
            Merger(vouch=bad)
        except ValueError as e:
            assert "vouch=" in str(e) and ">= 0" in str(e)
        else:
            raise AssertionError(f"vouch={bad!r} accepted")


def _junk(state: dict[str, str], task: str) -> float:
    """``solves``, where "junk" breaks the train tasks x0, x1 and no held-out task."""
    if task in TRAIN_BROKEN_BY_BAD and "junk" in state:
        return 0.0
    return solves(state, task)


def test_a_key_that_blocks_two_train_tasks_is_retired_level_on_the_held_out_split():
    """"junk" came in fused with g0..g2 (6/8); it breaks the stuck train tasks x0, x1
    and no held-out task, so the head without it is level (6/8), not better. With
    ``vouch=2`` the probe's evidence (its removal alone repaired both stuck tasks)
    retires it; without ``vouch`` the level confirmation keeps it."""
    for vouch in (2, 0):
        m = Merger(retire=True, vouch=vouch)
        answer_evals(m, m.handle(Open(heldout_ids=HELD)), _junk)
        m.handle(LeaseDone(lease_id="r0.u0", worker="w", round=0, results=[
            RolloutResult(task_id="t", score=0.0, diff=x)
            for x in (d("g0"), d("g1"), d("g2"), d("junk"))]))
        answer_evals(m, m.handle(Barrier(round=0)), _junk)
        assert "junk" in m.state and m.score == 6 / 8
        stuck(m, 1, ["x0", "x1"])
        closed = _vouch_round(m, 1, "t", d("useless"), _junk)
        assert ("junk" in m.state) == (not vouch)
        assert closed.outcomes == ({"below-threshold": 1, "retired": 1} if vouch
                                   else {"below-threshold": 1})
        assert m.stats.get("vouched-retired", 0) == (1 if vouch else 0)


def test_a_level_removal_that_repaired_one_stuck_task_is_not_retired():
    """Only x0 is stuck: the removal repaired one train task, fewer than ``vouch``."""
    m = Merger(retire=True, vouch=2)
    answer_evals(m, m.handle(Open(heldout_ids=HELD)), _junk)
    m.handle(LeaseDone(lease_id="r0.u0", worker="w", round=0, results=[
        RolloutResult(task_id="t", score=0.0, diff=x)
        for x in (d("g0"), d("g1"), d("g2"), d("junk"))]))
    answer_evals(m, m.handle(Barrier(round=0)), _junk)
    stuck(m, 1, ["x0", "h6"])   # h6: only "bad" solves it; removing keys does not
    closed = _vouch_round(m, 1, "t", d("useless"), _junk)
    assert "junk" in m.state and "retired" not in closed.outcomes
