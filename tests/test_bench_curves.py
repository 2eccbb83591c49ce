"""bench/curves.py's summaries, on points made up here (no run)."""

from __future__ import annotations

from bench import curves


def point(system, budget, quality, seconds=1.0, domain="settings"):
    return {"system": system, "domain": domain, "budget": budget, "seed": 0,
            "calls": budget - 10, "quality": quality, "seconds": seconds}


def test_to_quality_names_the_first_budget_whose_mean_reaches_the_goal():
    points = [point("a", 500, 0.9), point("a", 500, 1.0), point("a", 1500, 1.0, 3.0),
              point("b", 500, 0.5), point("b", 1500, 0.9)]
    rows = curves.to_quality(points, ["a", "b"], 0.96)
    assert rows == [("settings (KeyedRules)", "1.00 at 1,500 (1,490 calls) in 3.0 s", "-")]
    rows = curves.to_quality(points, ["a", "b"], 0.90)
    assert rows[0][1] == "0.95 at 500 (490 calls) in 1.0 s" and rows[0][2].startswith("0.90 at 1,500")


def test_a_mean_that_reaches_the_goal_and_falls_back_does_not_count():
    points = [point("evobus", 500, 0.96, 2.0), point("evobus", 1000, 0.97, 4.0),
              point("agentdescent", 500, 0.96), point("agentdescent", 1000, 0.9),
              point("agentdescent", 1500, 1.0, 8.0), point("gepa", 1500, 0.5)]
    assert curves.held_from([p for p in points if p["system"] == "agentdescent"],
                            0.95) == 1500
    (row,) = curves.to_quality(points, ["evobus", "agentdescent", "gepa"], 0.95)
    assert row[1] == "0.96 at 500 (490 calls) in 2.0 s = 0.25x the faster anchor"
    assert row[2] == "1.00 at 1,500 (1,490 calls) in 8.0 s" and row[3] == "-"


def test_the_matrix_is_twelve_configurations_with_their_default_rounds():
    systems = curves.MATRIX.split(";")
    assert len(systems) == 12 and "evobus[cp=auto,async,w=16]" in systems
    for name in systems:
        curves.system(name)   # every spec parses


def test_repeatable_noise_makes_one_seed_one_run_and_the_shared_stream_draws_per_call():
    runs = [curves.one("evobus", "router", 1000, seed=3, repeatable=True) for _ in range(2)]
    assert [(r["calls"], r["quality"]) for r in runs[:1]] == [(r["calls"], r["quality"])
                                                              for r in runs[1:]]
    domain = curves.DOMAINS["settings"]()
    task = domain.tasks[0]
    a, b = (curves.Calls(domain, 10, seed=3, repeatable=True) for _ in range(2))
    first = [a._noise("run", "p", task).random() for _ in range(3)]
    assert first == [b._noise("run", "p", task).random() for _ in range(3)]
    assert len(set(first)) == 3            # the k-th call of a pair draws anew


def test_tensor_parallel_on_the_router_files_rules_under_the_category_they_route_to():
    from bench import noisy_domains

    domain = curves.DOMAINS["router"]()
    for n_workers, n_sections in ((4, 4), (16, 6)):
        tp, strategy = curves.tensor_parallel(domain, n_workers, per_worker=1)
        assert tp.n_sections == n_sections and tp.per_worker == 1
        assert strategy.keys() == [f"{c}/" for c in noisy_domains.CATEGORIES]
    task = domain.tasks[0]
    assert tp.route(task.id) == task.meta["want"]
    right = domain.right("", task)
    wrong = noisy_domains._rule(task.meta["kw"], "sales" if task.meta["want"] != "sales"
                                else "billing")
    assert strategy.section(right) == task.meta["want"] and strategy.section(wrong) != \
        task.meta["want"]
    # the model reads the same text as with the domain's own (unsectioned) strategy
    plain = domain.strategy()
    assert strategy.render(strategy.to_diff({}, right, "w", 0).ops) == plain.render(
        plain.to_diff({}, right, "w", 0).ops)
    assert curves.one("evobus[tp=auto]", "router", 300, seed=1, repeatable=True)["calls"] > 0


def test_a_variant_switches_a_rule_off_or_on_by_name(monkeypatch):
    seen: list[dict] = []
    monkeypatch.setattr(curves, "run_evobus",
                        lambda domain, calls, seed, **kw: seen.append(kw) or "")
    for spec in ("evobus[hold=off]", "evobus[hold=False,cross=on]", "evobus[noise_z=1.5]"):
        curves.system(spec)(None, None, 0)
    assert seen == [{"hold": False}, {"hold": False, "cross": True}, {"noise_z": 1.5}]
