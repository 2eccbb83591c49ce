"""AppendRules with declared sections: rules filed under what they are about, so
tensor parallelism can split a rule list, route tasks to a section's owner and reject
(and count) an out-of-section rule. Without sections nothing changes."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors import AppendRules, ConfigError, DataParallel, SectionViolation, TensorParallel, \
    TensorParallelMerge, evolve
from actors.artifacts import declared_keys, normaliser, rule_id
from actors.machines.merger import Merger
from actors.runtime.evolve import prepare_parallel, strategy_spec
from actors.runtime.launch import build_strategy, run_scenario
from bus.log import read_log
from protocol import Barrier, Commit, Diff, Lease, LeaseDone, Open, \
    RolloutResult, RoundClosed, decode
from protocol.domain import key_section
from protocol.scenario import parse_scenario
from tests import rules_domain
from test_machines import answer  # EvalRequests answered until none is left

SECTIONS = ["Billing", "shipping", "returns"]
INVOICE = "route messages containing 'invoice' to billing"
PARCEL = "route messages containing 'parcel' to shipping"
POLITE = "answer politely"


def sectioned(**kw) -> AppendRules:
    return AppendRules(sections=SECTIONS, **kw)


# -- the artifact ----------------------------------------------------------------------


def test_without_sections_an_append_rules_is_what_it_was():
    plain = AppendRules()
    assert plain.keys() is None and declared_keys(plain) is None
    diff = plain.to_diff({}, INVOICE, "w0", 3)
    assert diff == Diff(f"w0:{rule_id(INVOICE)}:3", "w0", 3, {rule_id(INVOICE): INVOICE})
    state = {rule_id(t): t for t in (INVOICE, PARCEL, POLITE)}
    assert plain.render(state) == "\n".join(
        ["# Playbook"] + [f"- {state[k]}" for k in sorted(state)])
    assert strategy_spec(plain) == {"kind": "AppendRules", "title": "# Playbook"}
    assert normaliser(plain)("r0123") == "r0123"


def test_a_rule_is_filed_under_the_one_declared_section_its_text_names():
    rules = sectioned()
    assert rules.keys() == ["billing/", "shipping/", "returns/"]
    assert rules.section(INVOICE) == "billing"
    assert rules.section("Send PARCEL questions to Shipping") == "shipping"
    assert rules.section("route 'bill' to billingdesk") is None        # whole words only
    assert rules.section("billing or shipping, whichever") is None      # several: none
    assert rules.section(POLITE) is None
    diff = rules.to_diff({}, INVOICE, "w0", 3)
    # the diff id is the one it was without sections; only the key is filed
    assert diff == Diff(f"w0:{rule_id(INVOICE)}:3", "w0", 3,
                        {f"billing/{rule_id(INVOICE)}": INVOICE})
    assert rules.to_diff({}, POLITE, "w0", 0).ops == {rule_id(POLITE): POLITE}
    state = {**diff.ops}
    assert rules.to_diff(state, f"  {INVOICE.upper()} ", "w1", 4) is None   # dedupes
    removal = rules.to_diff(state, f"remove: {INVOICE}", "w1", 4)
    assert removal.ops == {f"billing/{rule_id(INVOICE)}": ""}
    assert rules.to_diff(state, f"remove: {PARCEL}", "w1", 4) is None


def test_sections_change_neither_the_rules_text_nor_the_render_order():
    texts = [INVOICE, PARCEL, POLITE, "route messages containing 'refund' to returns"]
    plain, filed = AppendRules(), sectioned()
    plain_state = {k: v for t in texts for k, v in plain.to_diff({}, t, "w", 0).ops.items()}
    filed_state = {k: v for t in texts for k, v in filed.to_diff({}, t, "w", 0).ops.items()}
    assert plain_state.keys() != filed_state.keys()
    assert filed.render(filed_state) == plain.render(plain_state)


def test_section_of_decides_a_rule_s_section_and_must_answer_a_declared_one():
    rules = AppendRules(sections=rules_domain.CATEGORIES, section_of=rules_domain.section_of)
    assert rules.key_of("send 'refund' to Billing") == "billing/" + rule_id(
        "send 'refund' to Billing")
    assert rules.key_of("be brief") == rule_id("be brief")
    with pytest.raises(ConfigError, match=r"returned 'sales', which is not a declared "
                                          r"section \(\['account', 'billing'"):
        rules.to_diff({}, "send 'quote' to sales", "w", 0)


def test_bad_sections_are_refused_naming_the_fix():
    with pytest.raises(ConfigError, match="a list of section names, not one string"):
        AppendRules(sections="billing")
    with pytest.raises(ConfigError, match="distinct"):
        AppendRules(sections=["billing", "Billing "])
    with pytest.raises(ConfigError, match="without '/'"):
        AppendRules(sections=["a/b"])
    with pytest.raises(ConfigError, match="needs the declared sections="):
        AppendRules(section_of=rules_domain.section_of)


def test_a_folder_owns_the_keys_under_it_and_only_those():
    sections = {"billing/": 0, "shipping/": 1, "tone": 2}
    assert key_section(sections, "billing/r0a1b") == 0
    assert key_section(sections, "shipping/") == 1
    assert key_section(sections, "tone") == 2
    assert key_section(sections, "tone/x") is None          # "tone" is a key, not a folder
    assert key_section(sections, "r0a1b") is None
    assert key_section(sections, "sales/r0a1b") is None
    normalise = sectioned().normalise_key
    assert [normalise(k) for k in ("Billing", "billing/r1", "r1", "sales/r1")] == \
        ["billing/", "billing/", "r1", "sales/r1"]


# -- tensor parallelism over the sections -----------------------------------------------


def tp_of(rules: AppendRules, n: int, route=None, per_worker=None) -> TensorParallel:
    return TensorParallel(n, route=route, per_worker=per_worker).with_keys(
        declared_keys(rules), normaliser(rules))


def test_tensor_parallel_partitions_the_sections_and_routes_tasks_to_their_owner():
    tp = tp_of(sectioned(), 2, route=lambda t: t.split("-")[0])
    assert tp.section_map() == {"billing/": 0, "returns/": 1, "shipping/": 0}
    assert tp.owner_of(f"billing/{rule_id(INVOICE)}") == 0
    assert tp.owner_of(f"returns/{rule_id(INVOICE)}") == 1
    assert tp.owner_of(rule_id(POLITE)) is None
    ids = ["Billing-1", "returns-1", "shipping-1", "billing-2", "returns-2"]
    plan = tp.plan(4, 0, ids)
    assert [(u.worker, u.section, u.keys) for u in plan] == [
        (0, 0, ("Billing-1", "billing-2")), (1, 1, ("returns-1",)), (2, 0, ("shipping-1",)),
        (3, 1, ("returns-2",))]
    with pytest.raises(ConfigError, match="task 'sales-1' -> key 'sales'"):
        tp.validate(ids + ["sales-1"])
    with pytest.raises(ConfigError, match="key space has 3 keys"):
        tp_of(sectioned(), 4).validate()


def test_prepare_parallel_hands_the_merger_the_folders():
    plan_with, sections = prepare_parallel(TensorParallel(3, route=rules_domain.route),
                                           AppendRules(sections=rules_domain.CATEGORIES),
                                           [t.id for t in rules_domain.tasks()], 4)
    assert sections == {"account/": 0, "billing/": 1, "shipping/": 2, "technical/": 0}
    assert plan_with.route("billing-refund-0") == "billing"
    with pytest.raises(ConfigError, match="unless it declares sections"):
        prepare_parallel(TensorParallel(2), AppendRules(), [], 2)


def test_the_tensor_parallel_merge_is_a_union_of_filed_rules_and_refuses_the_others():
    rules = sectioned()
    merge = tp_of(rules, 2).merger()
    invoice = rules.to_diff({}, INVOICE, "w0", 0)
    parcel = rules.to_diff({}, PARCEL, "w1", 0)
    refund = rules.to_diff({}, "route messages containing 'refund' to returns", "w1", 0)
    state, ok = merge.merge({}, [(0, invoice), (0, parcel), (1, refund)])
    assert ok and state == {**invoice.ops, **parcel.ops, **refund.ops}
    with pytest.raises(SectionViolation, match="which section 0 owns") as other:
        merge.validate(parcel, 1)
    assert other.value.owner == 0 and other.value.key == next(iter(parcel.ops))
    with pytest.raises(SectionViolation, match="outside the declared key space"):
        merge.validate(rules.to_diff({}, POLITE, "w0", 0), 0)
    # no normaliser needed: a folder owns what is filed under it
    bare = TensorParallelMerge(2, keys=("shipping/", "returns/", "billing/"))
    assert (bare.owner_of(next(iter(invoice.ops))), bare.owner_of(next(iter(refund.ops)))) \
        == (0, 1)


def scored(state: dict[str, str]) -> float:
    return len(state) / 4


def test_the_merger_commits_filed_rules_and_counts_out_of_section_ones():
    rules = sectioned()
    m = Merger()
    answer(m, m.handle(Open(heldout_ids=["h1", "h2"],
                            sections={"billing/": 0, "returns/": 1, "shipping/": 0})), scored)
    invoice, parcel, polite = (rules.to_diff({}, t, "w", 0) for t in (INVOICE, PARCEL, POLITE))
    refund = rules.to_diff({}, "route messages containing 'refund' to returns", "w", 0)

    def lease(unit, section, *diffs):
        m.handle(LeaseDone(lease_id=f"r0.u{unit}", worker=f"w{unit}", round=0, unit=unit,
                           section=section, results=[RolloutResult("t", 0.0, x) for x in diffs]))
    lease(0, 0, invoice, refund, polite)     # refund: section 1's; polite: nobody's
    lease(1, 1, refund, parcel)              # parcel: section 0's
    out = answer(m, m.handle(Barrier(round=0)), scored)
    commit = next(msg for _, msg in out if isinstance(msg, Commit))
    closed = next(msg for _, msg in out if isinstance(msg, RoundClosed))
    assert commit.state == {**invoice.ops, **refund.ops}
    assert closed.outcomes == {"section-violation": 3, "committed": 2}


# -- end to end: evolve() and a scenario file ------------------------------------------


def run_rules(parallel, strategy, **kw):
    return evolve(rules_domain.tasks(), rules_domain.reward, run=rules_domain.run,
                  propose=rules_domain.propose, strategy=strategy, parallel=parallel,
                  rounds=8, n_workers=4, seed=0, target_reward=1.0, **kw)


def test_routed_tensor_parallel_on_a_sectioned_rule_list_learns_and_rejects_the_rest(tmp_path):
    log = tmp_path / "tp.evolog"
    result = run_rules(TensorParallel(4, route=rules_domain.route),
                       AppendRules(sections=rules_domain.CATEGORIES), log=str(log))
    assert result.error is None and result.final_reward == 1.0
    # every wrong-category rule (a task's fourth phrasing) was out of its worker's section
    assert result.outcomes()["section-violation"] > 0
    messages = [decode(r.body) for r in read_log(log).records]
    leases = [m for m in messages if isinstance(m, Lease) and m.kind == "rollout"]
    owner = dict(zip(sorted(rules_domain.CATEGORIES), range(4)))
    assert leases and all(owner[rules_domain.route(t)] == lease.section
                          for lease in leases for t in lease.task_ids)
    committed = {k: v for m in messages if isinstance(m, Commit) for k, v in m.state.items()}
    # every committed rule is filed under the category it sends its keyword to
    assert committed and all(k.split("/")[0] == rules_domain.section_of(v)
                             for k, v in committed.items())


def test_asynchronous_tensor_parallel_on_a_sectioned_rule_list_learns_and_counts(tmp_path):
    log = tmp_path / "async.evolog"
    result = evolve(rules_domain.tasks(), rules_domain.reward, run=rules_domain.run,
                    propose=rules_domain.propose,
                    strategy=AppendRules(sections=rules_domain.CATEGORIES),
                    parallel=TensorParallel(4, route=rules_domain.route), n_workers=4,
                    seed=0, target_reward=1.0, asynchronous=True, max_rollouts=400,
                    log=str(log))
    assert result.error is None and result.final_reward == 1.0
    # whatever the timing: the proposals of fourth phrasings (another category's rule)
    # the workers sent are exactly the violations counted
    wrong = sum(1 for r in read_log(log).records if r.receiver == "scheduler"
                for m in [decode(r.body)] if isinstance(m, LeaseDone)
                for x in m.results if x.diff is not None and x.task_id.endswith("-3"))
    assert result.outcomes().get("section-violation", 0) == wrong


def test_data_parallel_on_a_sectioned_rule_list_counts_no_violation():
    result = run_rules(DataParallel(per_worker=4), AppendRules(sections=rules_domain.CATEGORIES))
    assert result.error is None and "section-violation" not in result.outcomes()


SCENARIO = """
name = "sectioned rules"
mode = "sync"
rounds = 8
seed = 0

[domain]
tasks = "tests.rules_domain:tasks"
reward = "tests.rules_domain:reward"
run = "tests.rules_domain:run"
propose = "tests.rules_domain:propose"

[strategy]
kind = "AppendRules"
sections = ["billing", "shipping", "technical", "account"]
{extra}

[parallel]
kind = "TensorParallel"
n_sections = 4
route = "tests.rules_domain:route"

[workers]
local = 4

[budgets]
target_reward = 1.0
"""


def test_a_scenario_declares_the_sections_and_runs_tensor_parallel(tmp_path):
    by_name = parse_scenario(SCENARIO.format(extra=""))
    assert build_strategy(by_name.strategy).keys() == [
        "billing/", "shipping/", "technical/", "account/"]
    chosen = build_strategy(parse_scenario(SCENARIO.format(
        extra='section_of = "tests.rules_domain:section_of"')).strategy)
    assert chosen.section_of is rules_domain.section_of
    result = run_scenario(by_name, log=str(tmp_path / "s.evolog"))
    assert result.error is None and result.final_reward == 1.0
    assert result.outcomes()["section-violation"] > 0
    assert Path(tmp_path / "s.evolog").exists()


def test_declared_sections_cross_a_process_as_data_and_a_section_of_function_does_not():
    from actors.workers.code import code_ref, resolve

    ref = code_ref(sectioned(), "strategy")
    assert ref.kwargs["sections"] == SECTIONS and resolve(ref).keys() == sectioned().keys()
    with pytest.raises(ConfigError, match="not all JSON values"):
        code_ref(AppendRules(sections=rules_domain.CATEGORIES,
                             section_of=rules_domain.section_of), "strategy")


def test_validate_refuses_bad_sections_as_run_does_naming_the_strategy():
    from actors.runtime.checks import scenario_problems

    bad = SCENARIO.format(extra="").replace('"technical", "account"]', '"Billing"]')
    for parallel in ("", 'kind = "DataParallel"\n'):
        text = bad if not parallel else bad.split("[parallel]")[0] + "[parallel]\n" + \
            parallel + "\n[workers]" + bad.split("[workers]")[1]
        assert scenario_problems(parse_scenario(text)) == [
            "at `$.strategy`: AppendRules(sections=['billing', 'shipping', 'Billing']): "
            "section names must be distinct (in any case), non-empty and without '/'"]
    assert scenario_problems(parse_scenario(SCENARIO.format(extra=""))) == []
