"""Every parallelism paradigm through evolve(): the rules of docs/parallelism.md, end to end."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from actors import AppendRules, ClusterParallel, ConfigError, DataParallel, DifficultyWeighted, KeyedRules, ParallelStrategy, PipelineParallel, SingleSlot, TensorParallel, evolve
from bus.log import read_log
from protocol import Lease, decode
from scenarios import parallelism, router


def run_router(parallel, **kw):
    base = dict(tasks=router.tasks(), reward=router.reward, run=router.run,
                propose=router.propose, strategy=KeyedRules(router.CATEGORIES),
                parallel=parallel, rounds=6, n_workers=4, seed=0)
    base.update(kw)
    return evolve(**base)


def leases_in(path):
    return [decode(r.body) for r in read_log(path).records
            if isinstance(decode(r.body), Lease) and decode(r.body).kind == "rollout"]


def test_the_parallelism_example_keeps_its_invariants():
    rows = dict(parallelism.main(["--rounds", "6"]))
    dp = rows["DataParallel()"]
    routed = rows["TensorParallel(4, keys=..., route=...)"]
    unrouted = rows["TensorParallel(4, keys=...)"]
    assert routed["out-of-section"] == 0
    assert routed["delivered"] == routed["proposed"] and dp["delivered"] == dp["proposed"]
    assert routed["reward"] == dp["reward"] == 1.0
    assert unrouted["out-of-section"] > 0
    assert unrouted["delivered"] + unrouted["out-of-section"] == unrouted["proposed"]
    assert rows["BlockParallel()  [custom]"]["reward"] == 1.0


def test_a_custom_strategy_is_a_parallel_strategy_and_works_in_evolve():
    custom = parallelism.BlockParallel()
    assert isinstance(custom, ParallelStrategy)
    assert run_router(custom).final_reward == 1.0


def test_unrouted_tensor_parallel_counts_section_violations():
    result = run_router(TensorParallel(4, keys=router.CATEGORIES), rounds=2)
    assert result.outcomes()["section-violation"] > 0


def test_routed_tensor_parallel_fills_its_keys_from_the_strategy_and_has_no_violations(tmp_path):
    # keys omitted, route given: the key space comes from KeyedRules (no silent zero rollouts)
    log = tmp_path / "tp.evolog"
    result = run_router(TensorParallel(4, route=router.route), log=str(log))
    assert result.rollouts > 0 and result.final_reward == 1.0
    assert "section-violation" not in result.outcomes()
    sections = TensorParallel(4, keys=router.CATEGORIES).section_map()
    for lease in leases_in(log):
        assert {sections[router.route(t)] for t in lease.task_ids} <= {lease.section}


def test_workers_sharing_a_section_never_roll_out_the_same_task_twice_in_a_round(tmp_path):
    log = tmp_path / "tp8.evolog"
    run_router(TensorParallel(4, route=router.route), n_workers=8, rounds=2, log=str(log))
    per_round = collections.defaultdict(list)
    for lease in leases_in(log):
        per_round[lease.round] += lease.task_ids
    assert per_round
    for tasks in per_round.values():
        assert len(tasks) == len(set(tasks))


def test_mixed_case_categories_work_with_tensor_parallel():
    categories = [c.capitalize() for c in router.CATEGORIES]
    result = run_router(TensorParallel(4, route=lambda t: router.route(t).upper()),
                        strategy=KeyedRules(categories))
    assert result.final_reward == 1.0 and "section-violation" not in result.outcomes()


@pytest.mark.parametrize("parallel,strategy,needle", [
    (TensorParallel(2), AppendRules(), "key space"),
    (TensorParallel(2), SingleSlot(), "SingleSlot"),
    (TensorParallel(8), KeyedRules(router.CATEGORIES), "lower n_sections to at most 4"),
    (PipelineParallel(["a", "b"]), KeyedRules(router.CATEGORIES), "PipelineChain"),
    (object(), KeyedRules(router.CATEGORIES), "plan("),
])
def test_incompatible_pairings_are_refused_before_the_first_rollout(parallel, strategy, needle):
    def never(*a):
        raise AssertionError("no rollout may happen")

    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        evolve(router.tasks(), router.reward, run=never, propose=never, strategy=strategy,
               parallel=parallel)


def test_fewer_than_one_section_is_refused_at_construction():
    with pytest.raises(ConfigError, match="n_sections must be an integer >= 1"):
        TensorParallel(0)


def test_a_task_routed_to_no_section_is_refused_naming_it():
    def route(task_id):
        return "nowhere" if task_id == "billing-refund-0" else router.route(task_id)

    with pytest.raises(ConfigError, match="billing-refund-0"):
        run_router(TensorParallel(4, route=route))


def test_append_rules_with_explicit_keys_can_be_tensor_parallel():
    tasks = router.tasks()
    result = evolve(tasks, router.reward, run=router.run, propose=router.propose,
                    strategy=AppendRules(), parallel=TensorParallel(2, keys=["x", "y"]),
                    rounds=1)
    # AppendRules content-addresses its keys: every proposal is outside both sections.
    assert result.outcomes().get("section-violation", 0) > 0


def test_cluster_parallel_leases_whole_clusters_and_learns_from_every_rollout(tmp_path):
    seen = []

    class Watched(ClusterParallel):
        def observe(self, unit, task_id, score):
            seen.append(task_id)
            super().observe(unit, task_id, score)

    log = tmp_path / "cp.evolog"
    result = run_router(Watched(router.cluster_of), log=str(log), target_reward=None, rounds=4)
    assert result.final_reward == 1.0
    assert len(seen) == result.rollouts
    for lease in leases_in(log):
        assert len({router.cluster_of(t) for t in lease.task_ids}) == 1


def test_a_task_sampler_orders_tasks_inside_leases_and_still_learns():
    result = run_router(DataParallel(), task_sampler=DifficultyWeighted(seed=1))
    assert result.final_reward == 1.0


def test_a_minibatch_round_rolls_out_per_worker_tasks_and_learns_from_each(tmp_path):
    # One task per worker per round (agentdescent's round): the router reaches held-out
    # 1.0 after its 43 train tasks are seen once (and one round more: a merge of one diff
    # holds it for the next, ``hold``), where the whole-split round needs 3
    # when each proposal is made on the head (its keyword lists conflict; the default for
    # a strategy of several keys) and 1 when the lease's proposals chain (each builds on
    # the list the last one wrote).
    log = tmp_path / "mini.evolog"
    result = run_router(DataParallel(per_worker=1), n_workers=1, rounds=300,
                        held_out_frac=0.4, target_reward=1.0, log=str(log))
    assert result.stop_reason == "target_reward" and result.rollouts == 44
    assert {len(lease.task_ids) for lease in leases_in(log)} == {1}
    whole = run_router(DataParallel(), n_workers=1, rounds=300, held_out_frac=0.4,
                       target_reward=1.0, chain=False)
    assert whole.rollouts == 3 * 43
    chained = run_router(DataParallel(), n_workers=1, rounds=300, held_out_frac=0.4,
                         target_reward=1.0, chain=True)
    assert chained.rollouts == 43 and chained.version == 1


def test_a_scenario_declares_the_minibatch_round():
    from actors.runtime.launch import build_parallel
    from protocol.scenario import parse_scenario

    toml = Path(__file__).resolve().parent.parent / "scenarios" / "router.toml"
    text = toml.read_text().replace('kind = "DataParallel"\n',
                                    'kind = "DataParallel"\nper_worker = 2\n')
    assert build_parallel(parse_scenario(text).parallel) == DataParallel(per_worker=2)


def test_a_scenario_round_is_the_default_minibatch_unless_it_asks_for_the_whole_shard():
    from actors.runtime.launch import build_parallel
    from protocol.scenario import parse_scenario

    toml = Path(__file__).resolve().parent.parent / "scenarios" / "router.toml"
    text = toml.read_text()
    assert build_parallel(parse_scenario(text).parallel) == DataParallel(per_worker=4)
    no_section = text.replace('[parallel]\nkind = "DataParallel"\n', "")
    assert "[parallel]" not in no_section
    assert build_parallel(parse_scenario(no_section).parallel) == DataParallel(per_worker=4)
    shard = text.replace('kind = "DataParallel"\n', 'kind = "DataParallel"\nper_worker = "shard"\n')
    assert build_parallel(parse_scenario(shard).parallel) == DataParallel()


TP_SCENARIO = '''[parallel]
kind = "TensorParallel"
n_sections = 4
route = "scenarios.router:route"
per_worker = 2
'''


def _router_toml_with(parallel: str) -> str:
    toml = Path(__file__).resolve().parent.parent / "scenarios" / "router.toml"
    return toml.read_text().replace('[parallel]\nkind = "DataParallel"\n', parallel)


def test_a_scenario_declares_the_tensor_parallel_minibatch_round():
    from actors.runtime.launch import build_parallel
    from protocol.scenario import parse_scenario

    built = build_parallel(parse_scenario(_router_toml_with(TP_SCENARIO)).parallel)
    assert isinstance(built, TensorParallel) and built.per_worker == 2
    assert built.route is router.route
    whole = build_parallel(parse_scenario(_router_toml_with(
        TP_SCENARIO.replace("per_worker = 2\n", ""))).parallel)
    assert whole.per_worker is None


def test_a_tensor_parallel_scenario_with_per_worker_runs_minibatch_leases(tmp_path):
    from actors.runtime.launch import run_scenario
    from protocol.scenario import parse_scenario

    text = _router_toml_with(TP_SCENARIO).replace("rounds = 15", "rounds = 3")
    result = run_scenario(parse_scenario(text), log=str(tmp_path / "tp.evolog"))
    assert result.error is None
    leases = leases_in(tmp_path / "tp.evolog")
    assert leases and {len(lease.task_ids) for lease in leases} == {2}
    assert {lease.section for lease in leases} == {0, 1, 2, 3}
