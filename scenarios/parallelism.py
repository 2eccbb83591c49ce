"""The parallelism example: one domain, four strategies, through evolve().

    python -m scenarios.parallelism

For each strategy it prints what the workers proposed, what reached the merge
(delivered), what was rejected as out-of-section, how many artifact keys the final
artifact holds, and the held-out reward. The domain is the offline router
(scenarios/router.py), whose artifact is ``KeyedRules`` over four categories.
"""

from __future__ import annotations

import argparse

from actors import DataParallel, KeyedRules, TensorParallel, WorkUnit, evolve
from scenarios import router


class BlockParallel:
    """Give each worker a contiguous block of the task ids (good locality)."""

    name = "block"

    def plan(self, n_workers, round_index, keys):
        keys = list(keys)
        size = (len(keys) + n_workers - 1) // n_workers
        return [WorkUnit(worker=i, keys=keys[i * size:(i + 1) * size]) for i in range(n_workers)]

    def __repr__(self) -> str:
        return "BlockParallel()  [custom]"


ROWS = [
    ("DataParallel()", lambda: DataParallel()),
    ("BlockParallel()  [custom]", lambda: BlockParallel()),
    ("TensorParallel(4, keys=...)", lambda: TensorParallel(4, keys=router.CATEGORIES)),
    ("TensorParallel(4, keys=..., route=...)",
     lambda: TensorParallel(4, keys=router.CATEGORIES, route=router.route)),
]


def run_row(make, rounds: int = 6, seed: int = 0) -> dict:
    result = evolve(router.tasks(), router.reward, run=router.run, propose=router.propose,
                    strategy=KeyedRules(router.CATEGORIES), parallel=make(), rounds=rounds,
                    n_workers=4, seed=seed, target_reward=1.0)
    outcomes = result.outcomes()
    proposed = sum(h.proposals for h in result.history)
    violations = outcomes.get("section-violation", 0)
    return {"proposed": proposed, "delivered": proposed - violations,
            "out-of-section": violations, "keys": len(result.state),
            "reward": result.final_reward, "rounds": len(result.history)}


def main(argv=None) -> list[tuple[str, dict]]:
    p = argparse.ArgumentParser(description="the parallelism example table")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rows = [(label, run_row(make, args.rounds, args.seed)) for label, make in ROWS]
    print(f"{'strategy':>40}  proposed  delivered  out-of-section  keys  reward  rounds")
    for label, r in rows:
        print(f"{label:>40}  {r['proposed']:>8}  {r['delivered']:>9}  {r['out-of-section']:>14}"
              f"  {r['keys']:>4}  {r['reward']:>6.3f}  {r['rounds']:>6}")
    return rows


if __name__ == "__main__":
    main()
