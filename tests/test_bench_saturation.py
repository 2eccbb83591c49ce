"""bench/saturation.py at a tiny size, so it cannot rot: it counts a recorded log's
messages per rollout, drives the real broker with two DEALER peers, and feeds the pure
Scheduler and Collector (no figure is checked against a target: the machine is shared)."""

from __future__ import annotations

import os

from bench import saturation

LOGS = os.path.join(os.path.dirname(__file__), "logs")


def test_a_recorded_sync_log_gives_messages_per_rollout_lease_and_per_round():
    counts = saturation.count_log(os.path.join(LOGS, "sync_data_parallel.evolog"), "sync",
                                  workers_prefix=("worker-",))
    assert counts.rollout_leases > 0 and counts.rounds > 0 and counts.heldout > 0
    assert counts.records == sum(counts.by_type.values())
    m = saturation.model(counts, len(counts.workers))
    # A lease is at least its Lease and its LeaseDone; a sync round commits to workers.
    assert m.per_lease >= 2 and m.tasks_per_lease >= 1
    assert m.per_round_at(10_000) > m.per_round_at(1)  # eval leases grow with workers


def test_the_machines_cpu_and_the_load_table_cover_both_scales():
    sched = saturation.scheduler_cpu(20, rounds=1)
    coll = saturation.collector_cpu(10, 100)
    capped = saturation.collector_cpu(10, 100, max_answers=3)
    assert sched["messages"] == 20 + 1 + 1 and sched["us_per_msg"] > 0
    assert coll["per_item"] > 0 and coll["leases"] >= 10 and capped["per_item"] is None
    counts = saturation.count_log(os.path.join(LOGS, "sync_data_parallel.evolog"), "sync",
                                  workers_prefix=("worker-",))
    m = saturation.model(counts, len(counts.workers))
    rows = saturation.loads(m, None, {10: coll}, broker_us=30.0, shell_us=20.0,
                            scheduler={20: sched})
    assert {(r.workers, r.call, r.unit) for r in rows} == {
        (w, c, u) for w in (1_000, 10_000) for c in (1.0, 10.0)
        for u in ("rollout, sync", "branch")}
    slow = [r for r in rows if r.call == 10.0 and r.unit == "branch"]
    assert all(r.heartbeats_per_call > 8 for r in slow)  # a 10 s call heartbeats meanwhile


def test_the_real_broker_is_measured_and_part_four_computed_again_from_its_figures(
        tmp_path, capsys):
    import json

    broker = saturation.broker_cpu(2, curve=False, seconds=0.2, gen_procs=1, warmup=0.1)
    assert broker["messages"] > 0 and broker["crashes"] == []
    assert 0 < broker["broker_us"] < broker["process_us"]
    counts = saturation.count_log(os.path.join(LOGS, "sync_data_parallel.evolog"), "sync",
                                  workers_prefix=("worker-",))
    figures = {"broker": [[broker]], "scheduler": [saturation.scheduler_cpu(20, rounds=1)],
               "collector": [saturation.collector_cpu(10, 100)],
               "models": {"sync": vars(saturation.model(counts, len(counts.workers)))}}
    path = tmp_path / "figures.json"
    path.write_text(json.dumps(figures))
    assert saturation.main(["--from-json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "rollout, sync" in out and "branch" in out and "10,000" in out
