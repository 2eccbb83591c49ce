"""Parallelism strategies and task samplers: pure plans, checked without any actor."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.policies.parallelism import ClusterParallel, DataParallel, ParallelStrategy, TensorParallel, TensorParallelMerge, assign_key_sections, section_of, shard_round_robin
from actors.policies.pipeline import CounterfactualOutcome, PipelineChain, PipelineParallel, StageRecord
from actors.errors import ParallelConfigError, SectionViolation
from actors.policies.sampling import DifficultyWeighted, RoundRobin, TaskSampler
from protocol.domain import Diff, WorkUnit

# Derandomized and database-free: a property test runs the same examples every time
# and writes nothing next to the sources; a failure prints its falsifying example.
PROPERTY = settings(derandomize=True, database=None, deadline=None, max_examples=150)

CATEGORIES = ["billing", "refunds", "shipping", "auth"]


def task_ids(n: int) -> list[str]:
    return [f"t{i:03d}" for i in range(n)]


def all_keys(units: list[WorkUnit]) -> list[str]:
    return [k for u in units for k in u.keys]


# -- DataParallel ------------------------------------------------------------------


@PROPERTY
@given(n_tasks=st.integers(0, 40), n_workers=st.integers(1, 12), round_index=st.integers(0, 30))
def test_data_parallel_shards_are_disjoint_complete_and_rotate_each_round(
        n_tasks, n_workers, round_index):
    ids = task_ids(n_tasks)
    dp = DataParallel()
    now = dp.plan(n_workers, round_index, ids)
    nxt = dp.plan(n_workers, round_index + 1, ids)

    assert [u.worker for u in now] == list(range(n_workers))
    assert sorted(all_keys(now)) == ids                      # complete, no task twice
    assert all(u.section is None and u.stage == 0 for u in now)
    # rotating: next round, worker i holds what worker i+1 held this round
    for i in range(n_workers):
        assert nxt[i].keys == now[(i + 1) % n_workers].keys
    # shard sizes differ by at most one
    sizes = [len(u.keys) for u in now]
    assert max(sizes) - min(sizes) <= 1


def test_data_parallel_gives_extra_workers_empty_units_and_rotates_who_idles():
    dp = DataParallel()
    r0 = dp.plan(5, 0, ["a", "b"])
    r1 = dp.plan(5, 1, ["a", "b"])
    assert [u.keys for u in r0] == [("a",), ("b",), (), (), ()]
    assert [u.keys for u in r1] == [("b",), (), (), (), ("a",)]


def test_data_parallel_plans_empty_units_for_an_empty_task_list():
    assert DataParallel().plan(3, 7, []) == [WorkUnit(worker=i, keys=()) for i in range(3)]


def test_data_parallel_refuses_duplicate_task_ids_and_zero_workers():
    with pytest.raises(ParallelConfigError, match=r"duplicate task ids \['a'\]"):
        DataParallel().plan(2, 0, ["a", "b", "a"])
    with pytest.raises(ParallelConfigError, match="n_workers >= 1"):
        DataParallel().plan(0, 0, ["a"])


@PROPERTY
@given(n_tasks=st.integers(0, 40), n_workers=st.integers(1, 12), k=st.integers(1, 7),
       round_index=st.integers(0, 30))
def test_data_parallel_per_worker_rounds_are_disjoint_minibatches_that_walk_every_shard(
        n_tasks, n_workers, k, round_index):
    ids = task_ids(n_tasks)
    dp, whole = DataParallel(per_worker=k), DataParallel()
    now = dp.plan(n_workers, round_index, ids)
    assert [u.worker for u in now] == list(range(n_workers))
    keys = all_keys(now)
    assert len(keys) == len(set(keys))                       # disjoint within a round
    for mini, full in zip(now, whole.plan(n_workers, round_index, ids)):
        assert set(mini.keys) <= set(full.keys)              # a minibatch of its shard
        assert len(mini.keys) == min(k, len(full.keys))
    # every shard is walked through in ceil(len / k) consecutive rounds, whoever holds it
    longest = -(-n_tasks // n_workers)
    span = range(round_index, round_index + max(1, -(-longest // k)))
    assert sorted({t for r in span for t in all_keys(dp.plan(n_workers, r, ids))}) == ids


def test_data_parallel_per_worker_one_is_agentdescents_round_robin_pick():
    ids = task_ids(10)   # shards of 3, 3, 2, 2 with 4 workers
    dp = DataParallel(per_worker=1)
    plans = [[u.keys for u in dp.plan(4, r, ids)] for r in range(3)]
    assert plans[0] == [("t000",), ("t001",), ("t002",), ("t003",)]
    assert plans[1] == [("t005",), ("t006",), ("t007",), ("t004",)]
    assert plans[2] == [("t002",), ("t003",), ("t008",), ("t009",)]
    # the minibatch wraps around its shard; a shard no longer than k goes whole
    assert DataParallel(per_worker=2).plan(1, 1, ["a", "b", "c"]) == [
        WorkUnit(worker=0, keys=("c", "a"))]
    assert DataParallel(per_worker=2).plan(2, 1, ["a", "b", "c"]) == [
        WorkUnit(worker=0, keys=("b",)), WorkUnit(worker=1, keys=("a", "c"))]


def test_data_parallel_per_worker_is_validated_and_part_of_its_identity():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ParallelConfigError, match="per_worker"):
            DataParallel(per_worker=bad)
    assert DataParallel(per_worker=None) == DataParallel()
    assert DataParallel(per_worker=2) != DataParallel()
    assert len({DataParallel(per_worker=2), DataParallel(per_worker=2), DataParallel()}) == 2
    assert repr(DataParallel(per_worker=3)) == "DataParallel(per_worker=3)"


def test_shard_round_robin_deals_items_in_turn():
    assert shard_round_robin(range(7), 3) == [[0, 3, 6], [1, 4], [2, 5]]
    with pytest.raises(ValueError):
        shard_round_robin([1], 0)


# -- sections of a key space ---------------------------------------------------------


@PROPERTY
@given(keys=st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=30),
       n=st.integers(1, 12), data=st.data())
def test_assign_key_sections_is_balanced_and_independent_of_input_order(keys, n, data):
    shuffled = data.draw(st.permutations(keys + keys[:3]))   # reordered, with duplicates
    sections = assign_key_sections(keys, n)
    assert assign_key_sections(shuffled, n) == sections
    assert set(sections) == set(keys)
    sizes = [sum(1 for s in sections.values() if s == i) for i in range(n)]
    assert max(sizes) - min(sizes) <= 1
    if n <= len(set(keys)):
        assert all(size >= 1 for size in sizes)


def test_section_of_is_a_stable_hash_bucket_that_can_leave_a_section_empty():
    # Pinned: CRC-32, so the same in every process (Python's hash() is salted).
    assert section_of("billing", 4) == 2
    assert section_of("refunds", 7) == 4
    assert sorted({section_of(k, 4) for k in CATEGORIES}) == [0, 1, 2]   # section 3 owns nothing
    assert sorted(set(assign_key_sections(CATEGORIES, 4).values())) == [0, 1, 2, 3]


# -- TensorParallel --------------------------------------------------------------------


def route_by_prefix(task_id: str) -> str:
    return task_id.split("-")[0]


def routed_tasks(per_key: int = 3) -> list[str]:
    return [f"{k}-{i}" for i in range(per_key) for k in CATEGORIES]


def test_tensor_parallel_with_one_section_shards_like_data_parallel():
    tp = TensorParallel(1, keys=CATEGORIES)
    ids = task_ids(7)
    plan = tp.plan(3, 2, ids)
    assert [u.section for u in plan] == [0, 0, 0]
    assert [u.keys for u in plan] == [u.keys for u in DataParallel().plan(3, 2, ids)]


def test_tensor_parallel_without_route_attaches_section_i_mod_n_to_data_parallel_shards():
    plan = TensorParallel(2, keys=CATEGORIES).plan(5, 1, task_ids(9))
    assert [u.section for u in plan] == [0, 1, 0, 1, 0]
    assert [u.keys for u in plan] == [u.keys for u in DataParallel().plan(5, 1, task_ids(9))]


@PROPERTY
@given(n_sections=st.integers(1, 4), extra_workers=st.integers(0, 9),
       per_key=st.integers(0, 6), round_index=st.integers(0, 10))
def test_tensor_parallel_with_route_hands_out_no_out_of_section_task(
        n_sections, extra_workers, per_key, round_index):
    tp = TensorParallel(n_sections, keys=CATEGORIES, route=route_by_prefix)
    ids = routed_tasks(per_key)
    n_workers = n_sections + extra_workers
    plan = tp.plan(n_workers, round_index, ids)

    assert [u.worker for u in plan] == list(range(n_workers))
    assert sorted(all_keys(plan)) == sorted(ids)             # complete and disjoint
    for u in plan:
        assert u.section == u.worker % n_sections
        assert all(tp.owner_of(route_by_prefix(t)) == u.section for t in u.keys)


def test_workers_sharing_a_section_split_its_tasks_disjointly_and_rotate():
    tp = TensorParallel(2, keys=CATEGORIES, route=route_by_prefix)
    ids = routed_tasks(2)
    r0, r1 = tp.plan(4, 0, ids), tp.plan(4, 1, ids)
    sections = tp.section_map()
    for plan in (r0, r1):
        for s in (0, 1):
            sharing = [u for u in plan if u.section == s]
            assert len(sharing) == 2
            assert not set(sharing[0].keys) & set(sharing[1].keys)
            owned = [t for t in ids if sections[route_by_prefix(t)] == s]
            assert sorted(sharing[0].keys + sharing[1].keys) == sorted(owned)
    assert r1[0].keys == r0[2].keys and r1[2].keys == r0[0].keys


def test_tensor_parallel_per_worker_is_a_minibatch_round_that_walks_each_unit():
    whole = TensorParallel(2, keys=CATEGORIES, route=route_by_prefix)
    tp = TensorParallel(2, keys=CATEGORIES, route=route_by_prefix, per_worker=1)
    ids = routed_tasks(3)
    assert repr(tp) == "TensorParallel(2, keys=..., route=..., per_worker=1)"
    seen: dict[int, set[str]] = {0: set(), 1: set()}
    for r in range(6):
        units, full = tp.plan(2, r, ids), whole.plan(2, r, ids)
        for u, f in zip(units, full, strict=True):
            # One task of the unit the whole-unit round would hand this worker.
            assert u.section == f.section and len(u.keys) == 1 and u.keys[0] in f.keys
            seen[u.worker].add(u.keys[0])
    sections = tp.section_map()
    for w in (0, 1):   # over the rounds each worker walks its section's tasks
        assert {sections[route_by_prefix(t)] for t in seen[w]} == {w}
        assert len(seen[w]) > 1
    with pytest.raises(ParallelConfigError, match="per_worker"):
        TensorParallel(2, keys=CATEGORIES, per_worker=0)


def test_tensor_parallel_refuses_a_task_routed_to_a_key_no_section_owns():
    tp = TensorParallel(2, keys=CATEGORIES, route=route_by_prefix)
    with pytest.raises(ParallelConfigError, match=r"task 'returns-1' -> key 'returns'"):
        tp.plan(2, 0, ["billing-1", "returns-1"])
    with pytest.raises(ParallelConfigError, match=r"task 'returns-1' -> key 'returns'"):
        tp.validate(["billing-1", "returns-1"])
    tp.validate(["billing-1", "auth-2"])                     # everything routed: fine


def test_tensor_parallel_validation_names_the_fix():
    with pytest.raises(ParallelConfigError, match="n_sections must be an integer >= 1"):
        TensorParallel(0, keys=CATEGORIES)
    with pytest.raises(ParallelConfigError) as no_keys:
        TensorParallel(2).validate()
    assert str(no_keys.value) == (
        "TensorParallel needs the artifact's key space: pass keys=[...] or use a strategy "
        "that declares keys (KeyedRules); AppendRules content-addresses its keys unless it "
        "declares sections (AppendRules(sections=[...]))")
    with pytest.raises(ParallelConfigError) as too_many:
        TensorParallel(8, keys=CATEGORIES).validate()
    assert str(too_many.value) == ("TensorParallel(n_sections=8) but the key space has 4 keys: "
                                   "lower n_sections to at most 4, or use DataParallel")
    with pytest.raises(ParallelConfigError, match="SingleSlot has exactly one key, so it "
                                                  "cannot be tensor-parallelised"):
        TensorParallel(2, keys=["value"]).validate()
    with pytest.raises(ParallelConfigError, match=r"sections \[2, 3\] would have no owner"):
        TensorParallel(4, keys=CATEGORIES).plan(2, 0, task_ids(4))


def test_tensor_parallel_normalises_mixed_case_keys_and_routes():
    tp = TensorParallel(2, keys=["Billing", "BILLING", "Refunds"],
                        route=lambda t: t.split("-")[0].upper(), normalise=str.lower)
    assert tp.section_map() == {"billing": 0, "refunds": 1}
    assert tp.owner_of("BiLLing") == 0 and tp.owner_of("refunds") == 1
    plan = tp.plan(2, 0, ["billing-1", "refunds-1", "Billing-2"])
    assert [(u.section, u.keys) for u in plan] == [(0, ("billing-1", "Billing-2")),
                                                   (1, ("refunds-1",))]
    with pytest.raises(ParallelConfigError, match="n_sections=3.*2 keys"):
        TensorParallel(3, keys=["A", "a", "b"], normalise=str.lower).validate()


def test_with_keys_fills_the_key_space_from_the_artifact_strategy():
    lower = str.lower
    tp = TensorParallel(2, route=route_by_prefix).with_keys(["Billing", "Auth"], lower)
    assert tp.keys == ("Billing", "Auth") and tp.normalise is lower
    assert tp.section_map() == {"auth": 0, "billing": 1}
    tp.validate(["billing-1", "AUTH-1"])
    # keys the caller passed win, but must be keys the artifact declares
    own = TensorParallel(1, keys=["billing"]).with_keys(["Billing", "Auth"], lower)
    assert own.section_map() == {"billing": 0}
    with pytest.raises(ParallelConfigError, match=r"names \['refunds'\]"):
        TensorParallel(1, keys=["refunds"]).with_keys(["Billing"], lower)
    # an artifact that declares no keys leaves TP unconfigured, and validate says so
    with pytest.raises(ParallelConfigError, match="AppendRules content-addresses"):
        TensorParallel(2).with_keys(None).validate()


def test_a_key_outside_the_declared_space_has_no_owner():
    tp = TensorParallel(2, keys=CATEGORIES)
    assert tp.owner_of("r1a2b3c4d5e") is None
    assert tp.merger().owner_of("r1a2b3c4d5e") is None
    assert TensorParallel(2).owner_of("billing") is None


# -- TensorParallelMerge ----------------------------------------------------------------


def diff(diff_id: str, **ops: str) -> Diff:
    return Diff(diff_id=diff_id, author="w", base_version=3, ops=ops)


def test_tensor_parallel_merge_is_a_union_of_section_diffs():
    merge = TensorParallelMerge(2, keys=CATEGORIES)
    s = assign_key_sections(CATEGORIES, 2)
    base = {"billing": "old", "shipping": "keep"}
    merged, ok = merge.merge(base, [(s["billing"], diff("d1", billing="new")),
                                    (s["refunds"], diff("d2", refunds="add"))])
    assert ok
    assert merged == {"billing": "new", "shipping": "keep", "refunds": "add"}
    assert base == {"billing": "old", "shipping": "keep"}


def test_tensor_parallel_merge_rejects_an_out_of_section_edit_naming_diff_key_and_sections():
    merge = TensorParallelMerge(2, keys=CATEGORIES)
    owner = merge.owner_of("billing")
    with pytest.raises(SectionViolation) as err:
        merge.validate(diff("d9", billing="x"), 1 - owner)
    assert err.value.diff_id == "d9" and err.value.key == "billing"
    assert err.value.section == 1 - owner and err.value.owner == owner
    assert (f"diff 'd9' by 'w' was proposed from section {1 - owner} but writes key "
            f"'billing', which section {owner} owns") in str(err.value)
    with pytest.raises(SectionViolation, match="which no section owns"):
        merge.validate(diff("d10", unknown="x"), 0)
    with pytest.raises(SectionViolation):   # merge validates everything before merging
        merge.merge({}, [(owner, diff("d1", billing="a")), (0, diff("d2", unknown="b"))])


def test_tensor_parallel_merge_reports_a_key_written_twice_with_different_text():
    merge = TensorParallelMerge(2, keys=CATEGORIES)
    s = merge.owner_of("auth")
    base = {"auth": "v0"}
    clash = [(s, diff("a", auth="v1")), (s, diff("b", auth="v2"))]
    assert merge.merge(base, clash) == (base, False)
    assert merge.merge(base, [(s, diff("a", auth="v1")), (s, diff("b", auth="v1"))]) == (
        {"auth": "v1"}, True)


def test_tensor_parallel_merge_without_keys_falls_back_to_hash_buckets():
    merge = TensorParallelMerge(4)
    assert merge.owner_of("billing") == section_of("billing", 4) == 2
    merge.validate(diff("d", billing="x"), 2)


# -- ClusterParallel -------------------------------------------------------------------


def cluster_of(task_id: str) -> str:
    return task_id.split("-")[0]


CLUSTERED = ["mixed-1", "easy-1", "hard-1", "easy-2", "mixed-2", "hard-2"]


def feed(cp: ClusterParallel, scores: dict[str, list[float]]) -> None:
    for cluster, values in scores.items():
        for i, score in enumerate(values):
            task = f"{cluster}-{i % 2 + 1}"
            cp.observe(WorkUnit(worker=0, keys=(task,)), task, score)


def test_cluster_parallel_leases_unexplored_clusters_first_in_first_appearance_order():
    cp = ClusterParallel(cluster_of)
    plan = cp.plan(3, 0, CLUSTERED)
    assert [u.keys for u in plan] == [("mixed-1", "mixed-2"), ("easy-1", "easy-2"),
                                      ("hard-1", "hard-2")]
    feed(cp, {"mixed": [1.0], "easy": [1.0]})
    assert cp.ranking(CLUSTERED)[0] == "hard"                # still unexplored


def test_cluster_parallel_learns_that_an_always_passing_cluster_teaches_less():
    cp = ClusterParallel(cluster_of)
    feed(cp, {"easy": [1.0] * 6, "mixed": [1.0, 0.0] * 3})
    assert cp.score("mixed") > cp.score("easy")
    ids = ["easy-1", "easy-2", "mixed-1", "mixed-2"]
    assert cp.ranking(ids) == ["mixed", "easy"]
    assert cp.plan(1, 5, ids) == [WorkUnit(worker=0, keys=("mixed-1", "mixed-2"))]


def test_cluster_parallel_gives_extra_workers_empty_units_rather_than_duplicate_work():
    plan = ClusterParallel(cluster_of).plan(5, 0, CLUSTERED)
    assert [len(u.keys) for u in plan] == [2, 2, 2, 0, 0]
    assert sorted(all_keys(plan)) == sorted(CLUSTERED)


def test_cluster_parallel_per_worker_leases_a_minibatch_of_each_ranked_cluster():
    cp = ClusterParallel(cluster_of, per_worker=1)
    assert [u.keys for u in cp.plan(3, 0, CLUSTERED)] == [("mixed-1",), ("easy-1",),
                                                          ("hard-1",)]
    # The ranked clusters are dealt in a rotation, so a worker's chain (a branch carried
    # over rounds) meets each cluster: worker i gets the (i + r) mod 3-th ranked one.
    assert [u.keys for u in cp.plan(3, 1, CLUSTERED)] == [("easy-2",), ("hard-2",),
                                                          ("mixed-2",)]
    assert [u.keys for u in cp.plan(3, 2, CLUSTERED)] == [("hard-1",), ("mixed-1",),
                                                          ("easy-1",)]
    assert cp.plan(3, 0, CLUSTERED)[0].keys == cp.plan(3, 6, CLUSTERED)[0].keys
    # Without per_worker, whole clusters by rank, every round.
    assert [u.keys for u in ClusterParallel(cluster_of).plan(3, 1, CLUSTERED)] == [
        ("mixed-1", "mixed-2"), ("easy-1", "easy-2"), ("hard-1", "hard-2")]
    assert [len(u.keys) for u in ClusterParallel(cluster_of, per_worker=5).plan(
        3, 0, CLUSTERED)] == [2, 2, 2]                              # the whole cluster
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ParallelConfigError, match="per_worker"):
            ClusterParallel(cluster_of, per_worker=bad)
    assert repr(cp) == "ClusterParallel(c=1.4, pass_threshold=0.999, per_worker=1)"
    assert repr(ClusterParallel(cluster_of)) == "ClusterParallel(c=1.4, pass_threshold=0.999)"


def test_cluster_parallel_can_spread_extra_workers_over_clusters_without_duplicates():
    plan = ClusterParallel(cluster_of, spread=True).plan(4, 0, CLUSTERED)
    assert [u.keys for u in plan] == [("mixed-1",), ("easy-1", "easy-2"),
                                      ("hard-1", "hard-2"), ("mixed-2",)]


def test_cluster_parallel_is_deterministic_and_breaks_ties_by_cluster_id():
    a, b = ClusterParallel(cluster_of), ClusterParallel(cluster_of)
    history = {"hard": [0.0, 0.0], "easy": [1.0, 1.0], "mixed": [0.0, 1.0]}
    feed(a, history)
    feed(b, history)
    assert a.plan(2, 3, CLUSTERED) == b.plan(2, 3, CLUSTERED) == a.plan(2, 3, CLUSTERED)
    tied = ClusterParallel(cluster_of)
    feed(tied, {"zeta": [1.0], "alpha": [1.0]})
    assert tied.ranking(["zeta-1", "alpha-1"]) == ["alpha", "zeta"]


def test_cluster_parallel_refuses_a_reward_outside_the_unit_interval():
    cp = ClusterParallel(cluster_of)
    with pytest.raises(ValueError, match=r"task 'easy-1' must be in \[0, 1\], got 1.5"):
        cp.observe(WorkUnit(worker=0, keys=("easy-1",)), "easy-1", 1.5)


# -- custom strategies and the protocol ---------------------------------------------------


# The documented custom strategy (docs/parallelism.md), as the example ships it.
from scenarios.parallelism import BlockParallel  # noqa: E402


def test_a_custom_block_strategy_satisfies_the_parallel_strategy_protocol():
    assert isinstance(BlockParallel(), ParallelStrategy)
    plan = BlockParallel().plan(2, 0, ["a", "b", "c"])
    assert [list(u.keys) for u in plan] == [["a", "b"], ["c"]]
    for strategy in (DataParallel(), TensorParallel(2, keys=CATEGORIES),
                     ClusterParallel(cluster_of), PipelineParallel(["a", "b"])):
        assert isinstance(strategy, ParallelStrategy)
    assert not isinstance(object(), ParallelStrategy)
    assert not hasattr(DataParallel(), "observe")
    assert hasattr(ClusterParallel(cluster_of), "observe")


# -- pipelines ----------------------------------------------------------------------------


def test_pipeline_parallel_is_refused_with_a_pointer_to_pipeline_chain():
    pp = PipelineParallel(["lit-review", "mol-engine"])
    with pytest.raises(ParallelConfigError) as err:
        pp.plan(2, 0, ["t"])
    assert str(err.value) == pp.refusal_message() == (
        "evolve() evolves one artifact; pipeline parallelism needs one artifact per stage. "
        "Use PipelineChain(stages) directly: stage order, blame, counterfactual replay.")
    assert pp.chain() == PipelineChain(["lit-review", "mol-engine"])


def test_pipeline_blame_goes_to_the_earliest_failing_stage():
    chain = PipelineChain(["lit", "mol", "hpc"])
    assert chain.upstream_of("hpc") == ["lit", "mol"] and chain.upstream_of("lit") == []
    assert chain.blame({"lit": True, "mol": False, "hpc": False}) == "mol"
    assert chain.blame({"hpc": False}) == "hpc"              # missing stages count as success
    assert chain.blame({"lit": True}) is None
    assert chain.blame({}) is None
    with pytest.raises(ValueError, match=r"\['typo'\].*not stages"):
        chain.blame({"typo": False})
    with pytest.raises(ValueError, match="not a stage"):
        chain.upstream_of("typo")
    with pytest.raises(ParallelConfigError, match="unique"):
        PipelineChain(["a", "a"])


def test_counterfactual_replay_reruns_recorded_inputs_under_old_and_new_artifacts():
    chain = PipelineChain(["lit", "mol"])
    records = [StageRecord("lit", "q1", "papers"),
               {"stage": "mol", "input": "papers", "output": "x"},
               StageRecord("mol", "more papers", "y")]
    pairs = chain.counterfactual_pairs("mol", records)
    assert [(p.stage, p.input, p.recorded_output) for p in pairs] == [
        ("mol", "papers", "x"), ("mol", "more papers", "y")]

    calls = []

    def run_stage(artifact, stage_input):
        calls.append((artifact, stage_input))
        return f"{artifact}({stage_input})"

    outcomes = chain.replay_counterfactual("mol", records, run_stage, "v1", "v2")
    assert outcomes == [
        CounterfactualOutcome("papers", "v1(papers)", "v2(papers)"),
        CounterfactualOutcome("more papers", "v1(more papers)", "v2(more papers)")]
    assert calls == [("v1", "papers"), ("v2", "papers"),
                     ("v1", "more papers"), ("v2", "more papers")]
    with pytest.raises(ValueError, match="not a stage"):
        chain.counterfactual_pairs("mol", [StageRecord("hpc", "job")])


# -- samplers -----------------------------------------------------------------------------


def test_round_robin_keeps_the_order_and_rotates_it_by_round():
    rr = RoundRobin()
    assert isinstance(rr, TaskSampler)
    assert rr.order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert rr.order(["a", "b", "c"], 4) == ["b", "c", "a"]
    assert rr.order([], 3) == []


def test_difficulty_weighted_tries_unexplored_tasks_first_then_those_near_half_pass():
    dw = DifficultyWeighted(seed=1)
    assert isinstance(dw, TaskSampler)
    for score in (1.0, 1.0, 1.0, 1.0):
        dw.record("solved", score)
    for score in (1.0, 0.0, 1.0, 0.0):
        dw.record("coin", score)
    assert dw.order(["solved", "coin", "new"], 0) == ["new", "coin", "solved"]
    assert dw.stats() == {"solved": (4, 4), "coin": (2, 4)}


@PROPERTY
@given(n_tasks=st.integers(0, 20), seed=st.integers(0, 5), round_index=st.integers(0, 5),
       scores=st.lists(st.tuples(st.integers(0, 19), st.sampled_from([0.0, 0.5, 1.0])),
                       max_size=40),
       data=st.data())
def test_difficulty_weighted_order_is_a_deterministic_permutation(
        n_tasks, seed, round_index, scores, data):
    ids = task_ids(n_tasks)
    a, b = DifficultyWeighted(seed=seed), DifficultyWeighted(seed=seed)
    for index, score in scores:
        a.record(f"t{index:03d}", score)
        b.record(f"t{index:03d}", score)
    order = a.order(ids, round_index)
    assert sorted(order) == ids
    assert order == a.order(ids, round_index)                 # order() changes no state
    assert b.order(data.draw(st.permutations(ids)), round_index) == order


def test_difficulty_weighted_refuses_a_reward_outside_the_unit_interval():
    with pytest.raises(ValueError, match=r"task 't' must be in \[0, 1\]"):
        DifficultyWeighted().record("t", -0.1)
    with pytest.raises(ValueError, match="duplicate task ids"):
        DifficultyWeighted().order(["a", "a"], 0)
