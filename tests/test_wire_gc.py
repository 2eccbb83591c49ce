"""What crosses the bus for every rollout stays out of the garbage collector's way: a
rollout's result made of scalars is not tracked, whether a worker built it or the
coordinator decoded it. (Tracked objects that survive a little while, such as the
results of the leases in flight, set off collections; in a worker process hosting
many connections a full collection stalls all of them.)"""

from __future__ import annotations

import gc

from actors.usage import take
from protocol import Codec, LeaseDone, RolloutResult, Usage


def _done(results: list[RolloutResult]) -> LeaseDone:
    return LeaseDone(lease_id="r1.u1", worker="w", round=1, unit=1, version=0,
                     results=results)


def test_a_result_of_scalars_is_not_tracked_by_the_garbage_collector_built_or_decoded():
    built = RolloutResult(task_id="t1", score=1.0, calls=1, usage=take({}, "run"))
    assert not gc.is_tracked(built)
    codec = Codec()
    decoded = codec.decode(codec.encode(_done([built] * 10)))
    assert [gc.is_tracked(r) for r in decoded.results] == [False] * 10
    assert decoded.results[0] == built


def test_a_results_reported_usage_still_crosses_the_wire():
    used = (Usage(phase="run", model="m", input_tokens=3, output_tokens=4, calls=1),)
    result = RolloutResult(task_id="t1", score=0.5, calls=1, usage=used)
    codec = Codec()
    back = codec.decode(codec.encode(_done([result]))).results[0]
    assert back.usage == used and back == result
