"""bench/remote.py's rows run end to end at a small scale: the rollout row (real worker
processes, synchronous rounds through the production Scheduler and broker) and the
group row (a parallel group over remote connections, results in input order), each
giving the figures its table prints."""

from __future__ import annotations

import math

import pytest

from bench import remote


@pytest.mark.slow
def test_the_rollout_row_measures_rounds_over_worker_processes():
    fig = remote.measure(4, 2, 0.01, 2, 2, write_log=False)
    assert fig["rollouts"] == 4 * 2 * 2 and fig["lost"] == 0
    assert 0 < fig["efficiency"] <= 1.05
    assert fig["messages"] > 0 and not math.isnan(fig["broker_us_per_msg"])


@pytest.mark.slow
def test_the_group_row_runs_a_group_over_remote_connections_in_input_order():
    # measure_group raises unless the group completed with its results in input order
    fig = remote.measure_group(4, 2, 0.01, 40)
    assert fig["items"] == 40 and fig["lost"] == 0
    assert 0 < fig["efficiency"] <= 1.05 and fig["messages_per_branch"] > 0
