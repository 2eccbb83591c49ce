"""The Merger with every rule evolve() turns on by default, driven by random rounds on a
noisy model (hypothesis): whatever the proposals and the noise, each round is closed
once, each of its proposals gets exactly one outcome, a commit is the Merger's state,
and the run's totals count every proposal once. The rules' own tests feed chosen
messages (tests/test_merger_rules.py, tests/test_cross_check.py); this one looks for
the message sequences nobody thought of."""

from __future__ import annotations

import hashlib

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.machines.merger import Merger
from protocol import (Barrier, Commit, Diff, EvalDone, EvalRequest, Finish, LeaseDone, Open,
                      RolloutResult, RoundClosed, RunDone)

HELD = [f"h{i}" for i in range(12)]
KEYS = ["a", "b", "c", "d"]
VALUES = ["0", "1", "2"]
#: The rules evolve() runs with by default (actors/runtime/evolve.py).
DEFAULTS = dict(screen=True, attribute=True, retire=True, sequential=True,
                sequential_first=4, conflicts="first", hold=True, rescore=3, vouch=2,
                cross=True, sequential_retire=True)


def _draw(seed: int, *parts) -> float:
    digest = hashlib.blake2b(repr((seed,) + parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def model(seed: int, noise: float):
    """A task is solved when the state holds its wanted value ("1" for the key its
    number picks), except at random ``noise`` of the time (the k-th call of a pair
    draws anew)."""
    calls: dict = {}

    def solves(state: dict[str, str], task: str) -> float:
        key = (frozenset(state.items()), task)
        k = calls[key] = calls.get(key, -1) + 1
        if _draw(seed, "noise", sorted(key[0]), task, k) < noise:
            return float(_draw(seed, "coin", sorted(key[0]), task, k) < 0.5)
        want = KEYS[int(task.lstrip("hx")) % len(KEYS)]
        return 1.0 if state.get(want) == "1" else 0.0
    return solves


def drive(m: Merger, out: list, solves) -> list:
    """Answer every EvalRequest with per-task scores until none is left; the rest."""
    result, pending = [], list(out)
    while pending:
        to, msg = pending.pop(0)
        if isinstance(msg, EvalRequest):
            scores = {t: solves(msg.state, t) for t in msg.task_ids}
            pending += m.handle(EvalDone(eval_id=msg.eval_id, scores=scores,
                                         score=sum(scores.values()) / len(scores)))
        else:
            result.append((to, msg))
    return result


proposal = st.tuples(st.sampled_from([f"x{i}" for i in range(8)]),    # evidence task
                     st.sampled_from(KEYS), st.sampled_from(VALUES),  # the edit
                     st.sampled_from([0.0, 0.0, 1.0]))                # its rollout's score
rounds = st.lists(st.lists(proposal, max_size=6), min_size=1, max_size=10)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rounds=rounds, seed=st.integers(0, 10**6), noise=st.sampled_from([0.0, 0.1, 0.3]))
def test_every_proposal_gets_one_outcome_whatever_the_rounds_and_the_noise(rounds, seed,
                                                                          noise):
    solves = model(seed, noise)
    m = Merger(**DEFAULTS)
    drive(m, m.handle(Open(heldout_ids=HELD)), solves)
    proposed = 0
    for r, props in enumerate(rounds):
        results = [RolloutResult(task_id=t, score=s, diff=Diff(f"w{r}.{i}:{k}", "w",
                                                               m.version, {k: v}))
                   for i, (t, k, v, s) in enumerate(props)]
        # failed rollouts that proposed nothing: stuck tasks for retiring
        results += [RolloutResult(task_id=f"x{(r + j) % 8}", score=0.0) for j in (0, 3)]
        m.handle(LeaseDone(lease_id=f"r{r}.u0", worker="w", round=r, version=m.version,
                           results=results))
        version = m.version
        out = drive(m, m.handle(Barrier(round=r)), solves)
        closed = [msg for _, msg in out if isinstance(msg, RoundClosed)]
        assert len(closed) == 1 and closed[0].round == r, out
        assert closed[0].proposals == len(props)
        # ("retired" counts the head's keys a retirement took out, not proposals)
        own = {k: n for k, n in closed[0].outcomes.items() if k != "retired"}
        assert sum(own.values()) == len(props), closed[0]
        commits = [msg for _, msg in out if isinstance(msg, Commit)]
        assert len(commits) == int(closed[0].committed) == m.version - version
        if commits:
            assert commits[-1].state == m.state and commits[-1].version == m.version
        assert m.merge is None
        proposed += len(props)
    (_, done), = m.handle(Finish(stop_reason="rounds"))
    assert isinstance(done, RunDone) and done.state == m.state
    assert sum(n for k, n in done.outcomes.items() if k != "retired") == proposed, \
        done.outcomes


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(waves=rounds, seed=st.integers(0, 10**6), noise=st.sampled_from([0.0, 0.1, 0.3]),
       stale=st.lists(st.integers(0, 2), max_size=10))
def test_asynchronous_waves_close_once_each_and_count_every_proposal(waves, seed, noise,
                                                                     stale):
    """The same with waves paced by merges (evolve()'s asynchronous runs): proposals made
    on a head up to two versions old, each wave merged on its WaveSettled, the run ended
    by a Flush whose RoundClosed is final."""
    from protocol import Flush, WaveSettled

    from actors.policies.parallelism import async_pacing

    solves = model(seed, noise)
    m = Merger(asynchronous=True, **DEFAULTS, **async_pacing(4, 3)["merger"])
    drive(m, m.handle(Open(heldout_ids=HELD)), solves)
    proposed, closed_all = 0, []
    for w, props in enumerate(waves):
        base = max(0, m.version - (stale[w] if w < len(stale) else 0))
        results = [RolloutResult(task_id=t, score=s, diff=Diff(f"w{w}.{i}:{k}", "w", base,
                                                               {k: v}))
                   for i, (t, k, v, s) in enumerate(props)]
        results += [RolloutResult(task_id=f"x{(w + j) % 8}", score=0.0) for j in (0, 3)]
        out = drive(m, m.handle(LeaseDone(lease_id=f"w{w}.u0", worker="w", round=w,
                                          version=base, results=results)), solves)
        out += drive(m, m.handle(WaveSettled(wave=w)), solves)
        closed_all += [msg for _, msg in out if isinstance(msg, RoundClosed)]
        commits = [msg for _, msg in out if isinstance(msg, Commit)]
        if commits:
            assert commits[-1].state == m.state and commits[-1].version == m.version
        assert m.merge is None
        proposed += len(props)
    out = drive(m, m.handle(Flush()), solves)
    closed_all += [msg for _, msg in out if isinstance(msg, RoundClosed)]
    assert closed_all and closed_all[-1].final
    # The last wave's WaveSettled may come after the final close: it starts nothing.
    assert m.handle(WaveSettled(wave=len(waves))) == []
    assert sum(msg.proposals for msg in closed_all) == proposed
    counted = sum(n for msg in closed_all for k, n in msg.outcomes.items() if k != "retired")
    assert counted == proposed, closed_all
    (_, done), = m.handle(Finish(stop_reason="budget"))
    assert sum(n for k, n in done.outcomes.items() if k != "retired") == proposed, \
        done.outcomes
