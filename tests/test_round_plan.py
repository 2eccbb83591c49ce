"""How a round is planned and merged, beyond its size: DataParallel's ``busy`` workers
(a round of chained leases on some of the workers, the others sharing the gates),
ClusterParallel's rotation over every cluster and its round's size, and an
asynchronous wave's merge holding a diff too few for a gate (``hold_waves``), each
driven through the pure parallelism policy or the pure Merger by messages alone."""

from __future__ import annotations

import pytest

from actors.addresses import PLANNER
from actors.artifacts import AppendRules, SingleSlot
from actors.errors import ParallelConfigError
from actors.machines.merger import Merger
from actors.policies.parallelism import (
    ClusterParallel,
    DataParallel,
    TensorParallel,
    async_pacing,
    cluster_round,
    data_parallel_from_repr,
)
from protocol import (
    Diff,
    EvalRequest,
    Finish,
    Flush,
    LeaseDone,
    Open,
    RolloutResult,
    RoundClosed,
    WaveSettled,
)
from tests.merger_drive import answer_evals

TASKS = [f"t{i}" for i in range(40)]


# -- DataParallel(busy=...) ----------------------------------------------------------------


@pytest.mark.parametrize("rounds", [range(10)])
def test_busy_workers_hold_disjoint_chained_leases_and_the_rest_idle(rounds):
    dp = DataParallel(per_worker=4, busy=4)
    seen: list[str] = []
    for r in rounds:
        units = dp.plan(16, r, TASKS)
        assert [u.worker for u in units] == list(range(16))
        assert [len(u.keys) for u in units] == [4] * 4 + [0] * 12
        keys = [k for u in units for k in u.keys]
        assert len(set(keys)) == 16     # disjoint within the round
        seen += keys
    assert set(seen) == set(TASKS)      # every task is walked through


def test_busy_plans_as_the_same_round_on_that_many_workers():
    """The busy units are the plan DataParallel makes for ``busy`` workers: a run at 16
    workers with busy=4 rolls out what one at 4 workers does, round for round."""
    for r in range(12):
        wide = DataParallel(per_worker=4, busy=4).plan(16, r, TASKS)
        four = DataParallel(per_worker=4).plan(4, r, TASKS)
        assert [u.keys for u in wide[:4]] == [u.keys for u in four]


def test_busy_beyond_the_workers_is_every_worker():
    assert DataParallel(per_worker=2, busy=8).plan(4, 3, TASKS) == \
        DataParallel(per_worker=2).plan(4, 3, TASKS)


@pytest.mark.parametrize("dp", [DataParallel(), DataParallel(per_worker=4),
                                DataParallel(per_worker=4, busy=4), DataParallel(busy=2)])
def test_a_log_header_names_the_round_it_planned_with(dp):
    assert data_parallel_from_repr(repr(dp)) == dp


@pytest.mark.parametrize("text", ["DataParallel(, )", "DataParallel(busy=2, per_worker=4)",
                                  "DataParallel(per_worker=4, )", "DataParallel(busy=0)"])
def test_a_header_that_is_not_a_data_parallel_repr_is_not_read_as_one(text):
    assert data_parallel_from_repr(text) is None


@pytest.mark.parametrize("busy", [0, -1, True, 2.0])
def test_busy_must_be_a_positive_integer(busy):
    with pytest.raises(ParallelConfigError, match="busy"):
        DataParallel(per_worker=4, busy=busy)


# -- TensorParallel(busy=...) --------------------------------------------------------------

SECTION_KEYS = ("a", "b", "c", "d", "e", "f")
WANTS = {t: SECTION_KEYS[i % len(SECTION_KEYS)] for i, t in enumerate(TASKS)}


def routed(n_sections: int, **kw) -> TensorParallel:
    return TensorParallel(n_sections, keys=SECTION_KEYS, route=WANTS.__getitem__,
                          per_worker=4, **kw)


def test_tensor_parallel_busy_plans_the_round_of_that_many_workers_and_idles_the_rest():
    """At 16 workers with busy=4 each of the four sections has one owner rolling out
    chained leases of four, the round a run at 4 workers makes; the other twelve hold
    nothing (they share the gates)."""
    for r in range(6):
        wide = routed(4, busy=4).plan(16, r, TASKS)
        four = routed(4).plan(4, r, TASKS)
        assert [u.worker for u in wide] == list(range(16))
        assert [(u.keys, u.section) for u in wide[:4]] == [(u.keys, u.section) for u in four]
        assert all(not u.keys for u in wide[4:])


def test_tensor_parallel_busy_fewer_than_its_sections_is_refused_by_name():
    with pytest.raises(ParallelConfigError, match=r"busy=3.*fewer than the sections"):
        routed(4, busy=3).plan(16, 0, TASKS)
    with pytest.raises(ParallelConfigError, match="busy"):
        routed(4, busy=0)
    assert "busy=4" in repr(routed(4, busy=4))


# -- an asynchronous wave's merge holds a lone diff (hold_waves) ---------------------------

HELD = ["h0", "h1", "h2", "h3"]
NEEDS = {"h0": "g0", "h1": "g0", "h2": "g1", "h3": "g1"}


def solves(state: dict[str, str], task: str) -> float:
    return 1.0 if NEEDS[task] in state else 0.0


def wave_merger(**kw) -> Merger:
    kw.setdefault("hold", True)
    paced = async_pacing(4, 3)["merger"]
    m = Merger(asynchronous=True, **{**paced, **kw})
    answer_evals(m, m.handle(Open(heldout_ids=HELD)), solves)
    return m


def wave(m: Merger, w: int, keys: list[str], log: list, message=None) -> list:
    """One wave's proposals (each diff on its own train task), settled and merged."""
    for i, key in enumerate(keys):
        assert m.handle(LeaseDone(lease_id=f"w{w}.u{i}", worker="w", round=w, results=[
            RolloutResult(f"x{w}.{i}", 0.0, Diff(f"w:{key}", "w", m.version, {key: "on"}))
        ])) == []                                      # held until the wave settles
    return answer_evals(m, m.handle(message or WaveSettled(wave=w)), solves, log)


def closed(out: list) -> RoundClosed:
    return [msg for to, msg in out if to == PLANNER and isinstance(msg, RoundClosed)][-1]


def test_the_pacing_asks_the_merger_to_hold_a_wave_too_small_for_a_gate():
    assert async_pacing(4, 3)["merger"]["hold_waves"] is True


def test_a_wave_left_with_one_diff_pays_no_gate_and_the_next_gates_both_at_once():
    m = wave_merger()
    log: list[EvalRequest] = []
    first = closed(wave(m, 0, ["g0"], log))
    assert log == [] and first.outcomes == {"held": 1} and not first.committed
    second = closed(wave(m, 1, ["g1"], log))
    assert [r.task_ids for r in log] == [HELD]        # one gate for the two
    assert second.committed and m.state == {"g0": "on", "g1": "on"} and m.score == 1.0
    assert second.outcomes == {"committed": 1} and second.carried == {"committed": 1}


def test_without_hold_waves_an_asynchronous_merge_gates_its_one_diff():
    m = wave_merger(hold_waves=False)
    log: list[EvalRequest] = []
    first = closed(wave(m, 0, ["g0"], log))
    assert [r.task_ids for r in log] == [HELD] and first.committed


def test_the_last_merge_of_a_run_holds_nothing_back():
    """The merge a stop flushes has no merge after it: its lone diff is gated there
    rather than left ``held-at-stop``."""
    m = wave_merger()
    log: list[EvalRequest] = []
    out = wave(m, 0, ["g0"], log, message=Flush(merge=True))
    assert [r.task_ids for r in log] == [HELD] and closed(out).committed
    (_, done), = m.handle(Finish(stop_reason="max_calls"))
    assert "held-at-stop" not in done.outcomes and done.state == {"g0": "on"}


def test_a_wave_with_nothing_new_gates_what_the_one_before_held():
    m = wave_merger()
    log: list[EvalRequest] = []
    wave(m, 0, ["g0"], log)
    second = closed(wave(m, 1, [], log))
    assert [r.task_ids for r in log] == [HELD] and m.state == {"g0": "on"}
    assert second.outcomes == {} and second.carried == {"committed": 1}


# -- ClusterParallel's rotation over every cluster -----------------------------------------

CLUSTERS = {f"{c}{i}": c for c in "abcdef" for i in range(4)}


def test_fewer_workers_than_clusters_still_meet_every_cluster_over_the_rounds():
    """Two busy workers, six clusters: each worker's unit walks through all six over six
    rounds (a chain carried on as its branch learns from each), where dealing only the
    two top-ranked clusters would have kept it on those two."""
    cp = ClusterParallel(CLUSTERS.__getitem__, per_worker=1)
    met: dict[int, set[str]] = {0: set(), 1: set()}
    for r in range(6):
        units = cp.plan(2, r, list(CLUSTERS))
        assert [len(u.keys) for u in units] == [1, 1]
        assert CLUSTERS[units[0].keys[0]] != CLUSTERS[units[1].keys[0]]   # one each
        for u in units:
            met[u.worker].add(CLUSTERS[u.keys[0]])
    assert met == {0: set("abcdef"), 1: set("abcdef")}


def test_whole_clusters_are_still_leased_by_rank():
    units = ClusterParallel(CLUSTERS.__getitem__).plan(2, 3, list(CLUSTERS))
    assert [sorted({CLUSTERS[k] for k in u.keys}) for u in units] == [["a"], ["b"]]


@pytest.mark.parametrize("n_workers,n_clusters,expected", [
    (4, 6, {"per_worker": 4, "busy": None}), (16, 6, {"per_worker": 4, "busy": 4}),
    (16, 15, {"per_worker": 4, "busy": 4}), (16, 3, {"per_worker": 4, "busy": None}),
    (1, 6, {"per_worker": 4, "busy": None})])
def test_a_cluster_round_is_sixteen_rollouts_in_leases_of_four(n_workers, n_clusters,
                                                               expected):
    """As DataParallel's default round: four chained leases of four, on four workers at
    most (one cluster each), whatever the worker count."""
    assert cluster_round(n_workers, n_clusters, AppendRules()) == expected


@pytest.mark.parametrize("n_workers", [4, 8, 16])
def test_a_single_slot_cluster_round_lets_each_chain_meet_every_cluster_within_a_gate(
        n_workers):
    """SingleSlot is gated once per 64 rollouts; over 8 clusters, each of four busy
    workers takes 2 tasks a round, so its chain meets all 8 clusters within the gate."""
    size = cluster_round(n_workers, 8, SingleSlot())
    assert size == {"per_worker": 2, "busy": None if n_workers == 4 else 4}
    assert size["per_worker"] * 4 * 8 <= SingleSlot().round_tasks


def test_busy_caps_the_workers_that_lease_a_cluster():
    wide = ClusterParallel(CLUSTERS.__getitem__, per_worker=4, busy=4)
    narrow = ClusterParallel(CLUSTERS.__getitem__, per_worker=4)
    for r in range(8):
        units = wide.plan(16, r, list(CLUSTERS))
        assert [len(u.keys) for u in units] == [4] * 4 + [0] * 12
        assert units[:4] == narrow.plan(4, r, list(CLUSTERS))   # the 4-worker round
    assert repr(wide) == "ClusterParallel(c=1.4, pass_threshold=0.999, per_worker=4, busy=4)"
    with pytest.raises(ParallelConfigError, match="busy"):
        ClusterParallel(CLUSTERS.__getitem__, busy=0)
