"""The ledger of calls, tokens and cost: what the run used, by kind (``rollout``: run
calls on train tasks, ``proposal``: propose calls, ``scoring``: held-out scoring and
re-verification), and the calls that leases in flight have reserved. Pure: the
Scheduler feeds it the leases it dispatches and the results that come back.

The budgets (docs/budgets.md) hold before a call starts: a lease reserves its calls
(``calls_per_task`` a rollout task, one a scoring task) before it is dispatched and is
cut to what ``max_calls`` still allows; nothing is dispatched once the calls used and
reserved reach ``max_calls``, or the tokens or the cost used reach ``max_tokens`` or
``max_cost``. Tokens and cost are known only when a call ends, so those two budgets
can be passed by what the calls in flight use; ``in_flight_when_spent`` says how many
calls were reserved when a budget was first found spent.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from protocol import Budget, Lease, RolloutResult, Usage

KINDS = ("rollout", "proposal", "scoring")


class Ledger:
    def __init__(self) -> None:
        self.limits: Budget | None = None
        self.calls = dict.fromkeys(KINDS, 0)
        self.tokens = dict.fromkeys(KINDS, 0)
        self.cost = dict.fromkeys(KINDS, 0.0)
        self.attempts = 0
        self.throttled = 0.0
        self.unpriced: set[str] = set()
        #: What each lease (or scoring request) in flight reserved: (calls, expected
        #: tokens, expected cost); and the sums.
        self.reserved: dict[str, tuple[int, float, float]] = {}
        self.reserved_total = 0
        self.reserved_tokens = 0.0
        self.reserved_cost = 0.0
        self.spent: str | None = None
        self.in_flight_when_spent: int | None = None
        #: A token or cost budget has been passed (not only found too small for a lease).
        self.passed = False
        self.refused_leases = 0

    # -- limits ---------------------------------------------------------------------------

    def _per_task(self, used: dict[str, float], rollout: bool) -> float | None:
        """Expected tokens (or cost) of one task: the average per call so far of each
        kind of call the task makes (run and propose for a rollout task, one scoring
        call otherwise), falling back to the average of every call; None before any."""
        total = sum(self.calls.values())
        if not total:
            return None
        fallback = sum(used.values()) / total

        def mean(kind: str) -> float:
            n = self.calls[kind]
            return used[kind] / n if n else fallback

        return mean("rollout") + mean("proposal") if rollout else mean("scoring")

    def fit(self, rollout: bool, n: int) -> tuple[int, str | None]:
        """How many of ``n`` tasks the budgets allow to start now, and the budget that
        allows fewer than ``n`` (None when all fit)."""
        b = self.limits
        fit, which = n, None
        if b is None:
            return fit, which
        if b.max_calls is not None:
            per = b.calls_per_task if rollout else 1
            room = (b.max_calls - sum(self.calls.values()) - self.reserved_total) // per
            if room < fit:
                fit, which = max(0, room), "max_calls"
        for name, limit, used, reserved in (
                ("max_tokens", b.max_tokens, self.tokens, self.reserved_tokens),
                ("max_cost", b.max_cost, self.cost, self.reserved_cost)):
            if limit is None:
                continue
            left = limit - sum(used.values()) - reserved
            if sum(used.values()) >= limit:
                return 0, name
            each = self._per_task(used, rollout)
            if each:  # else nothing is known yet: the first request goes
                room = int(max(0.0, left) // each)
                if room < fit:
                    fit, which = room, name
        return fit, which

    def _note_spent(self, which: str | None) -> None:
        if which is not None and self.spent is None:
            self.spent, self.in_flight_when_spent = which, self.reserved_total

    def admit(self, lease: Lease) -> tuple[Lease | None, int, str | None]:
        """Reserve ``lease``'s calls before it is dispatched: (the lease to send, cut to
        what the budgets allow, or None; the tasks left out; the budget that cut it).
        A lease sent before (a re-dispatch) keeps its reservation."""
        b = self.limits
        if b is None or lease.lease_id in self.reserved:
            return lease, 0, None
        n = len(lease.task_ids)
        rollout = lease.kind == "rollout"
        fit, reason = self.fit(rollout, n)
        self._note_spent(reason)
        if fit == 0:
            self.refused_leases += 1
            return None, n, reason
        if fit < n:
            lease = msgspec.structs.replace(lease, task_ids=list(lease.task_ids[:fit]))
        self._reserve(lease.lease_id, rollout, fit)
        return lease, n - fit, reason

    def admit_eval(self, eval_id: str, n_tasks: int) -> str | None:
        """Reserve a whole scoring request (``n_tasks`` calls) at once, or say which budget
        refuses it: a candidate is scored on every held-out task or not at all."""
        if self.limits is None:
            return None
        fit, which = self.fit(False, n_tasks)
        if fit < n_tasks:
            self._note_spent(which)
            return which
        self._reserve(eval_id, False, n_tasks)
        return None

    def extend(self, key: str, calls: int) -> str | None:
        """Reserve ``calls`` more calls for lease ``key`` in flight (the branches of a
        group one of its calls started, on a worker in another process), released with
        the lease's own reservation: refused past ``max_calls`` counting what is used and
        reserved, or once the tokens or the cost used reach their budget. None when
        reserved (or no budget is set); else why not, naming the budget."""
        b = self.limits
        if b is None:
            return None
        if key not in self.reserved:
            return f"lease {key!r} is not in flight: its calls were settled"
        used_calls = sum(self.calls.values())
        which = None
        if b.max_calls is not None and used_calls + self.reserved_total + calls > b.max_calls:
            which = "max_calls"
        need = {}
        for name, limit, used, reserved in (
                ("max_tokens", b.max_tokens, self.tokens, self.reserved_tokens),
                ("max_cost", b.max_cost, self.cost, self.reserved_cost)):
            # Known only when the calls end: refused once spent, as a lease is, so the
            # overshoot is what the calls in flight use.
            need[name] = (sum(used.values()) / used_calls if used_calls else 0.0) * calls
            if which is None and limit is not None and sum(used.values()) >= limit:
                which = name
        if which is not None:
            self._note_spent(which)
            limit = getattr(b, which)
            return (f"the run's {which} ({limit:g}) is used up: every call to run/propose/an "
                    "agent counts, and so does every branch of a group started inside one; "
                    f"raise {which} or start fewer branches")
        c, t, co = self.reserved[key]
        self.reserved[key] = (c + calls, t + need["max_tokens"], co + need["max_cost"])
        self.reserved_total += calls
        self.reserved_tokens += need["max_tokens"]
        self.reserved_cost += need["max_cost"]
        return None

    def _reserve(self, key: str, rollout: bool, tasks: int) -> None:
        calls = tasks * (self.limits.calls_per_task if rollout else 1)
        tokens = (self._per_task(self.tokens, rollout) or 0.0) * tasks
        cost = (self._per_task(self.cost, rollout) or 0.0) * tasks
        self.reserved[key] = (calls, tokens, cost)
        self.reserved_total += calls
        self.reserved_tokens += tokens
        self.reserved_cost += cost

    def release(self, key: str) -> None:
        calls, tokens, cost = self.reserved.pop(key, (0, 0.0, 0.0))
        self.reserved_total -= calls
        self.reserved_tokens -= tokens
        self.reserved_cost -= cost

    # -- usage ----------------------------------------------------------------------------

    def settle(self, lease: Lease, results: Iterable[RolloutResult], *,
               reservation: str | None = None) -> str | None:
        """Count what a lease's calls used; release its reservation (``reservation``: the
        key it was made under, by default the lease id). Returns a fatal error when a
        token or cost budget is set and a call did not say what it used (or used a model
        with no price)."""
        self.release(reservation or lease.lease_id)
        scoring = lease.kind != "rollout"
        b = self.limits
        check = b is not None and (b.max_tokens is not None or b.max_cost is not None)
        # One pass, the counts summed in locals (a Scheduler settles every lease here).
        calls = proposals = 0
        for r in results:
            n = r.calls
            if n and not scoring:  # run, at most one propose, then the calls of groups
                proposals += min(1, n - r.group_calls - 1)
            calls += n
            for u in r.usage:
                self._count(u, "scoring" if scoring else
                            "proposal" if u.phase == "propose" else "rollout")
            if check:
                fatal = self._check_reported(r, scoring)
                if fatal:
                    self._add_calls(scoring, calls, proposals)
                    return fatal
        self._add_calls(scoring, calls, proposals)
        if b is not None:
            self._note_passed(calls)
        return None

    def _add_calls(self, scoring: bool, calls: int, proposals: int) -> None:
        if scoring:
            self.calls["scoring"] += calls
        else:
            self.calls["proposal"] += proposals
            self.calls["rollout"] += calls - proposals

    def _note_passed(self, calls: int) -> None:
        """A token or cost budget passed by this lease's end: the calls in flight then
        were this lease's and those still reserved."""
        b = self.limits
        if b is None or self.passed:
            return
        for name, limit, used in (("max_tokens", b.max_tokens, self.tokens),
                                  ("max_cost", b.max_cost, self.cost)):
            if limit is not None and sum(used.values()) >= limit:
                # Passed now: the calls in flight now are what passed it, even when the
                # budget refused a lease before (work already admitted, e.g. the gate
                # of a round whose next leases were refused, still runs).
                self.passed = True
                self.spent = self.spent or name
                self.in_flight_when_spent = self.reserved_total + calls
                return

    def _count(self, u: Usage, kind: str) -> None:
        # Calls made inside this one (a group's branches): counted, never reserved ahead
        # (the hook the groups on the run's runtime report through; see budgets.md).
        self.calls[kind] += u.calls
        tokens = u.input_tokens + u.output_tokens
        self.tokens[kind] += tokens
        self.attempts += u.attempts
        self.throttled += u.throttled
        cost = u.cost
        if cost is None and tokens:
            price = (self.limits.prices if self.limits is not None else {}).get(u.model)
            if price is None:
                self.unpriced.add(u.model)
                return
            cost = (u.input_tokens * price[0] + u.output_tokens * price[1]) / 1e6
        if cost:
            self.cost[kind] += cost

    def _check_reported(self, r: RolloutResult, scoring: bool) -> str | None:
        b = self.limits
        name = "max_tokens" if b.max_tokens is not None else "max_cost"
        ran = [("run", r.score is not None)]
        if r.calls - r.group_calls >= 2:
            ran.append(("propose", not (r.error or "").startswith("propose: ")))
        for phase, ok in ran:
            seen = [u for u in r.usage if u.phase == phase
                    and (u.input_tokens or u.output_tokens or u.cost is not None)]
            if ok and not seen:
                call = "a scoring call" if scoring else f"{phase}()"
                return (f"{name} is set but {call} on task {r.task_id!r} reported no usage: "
                        "the agent must report each model call with actors.usage.report("
                        "model=..., input_tokens=..., output_tokens=...) (OpenAIAgent "
                        f"does), or drop {name}")
            if b.max_cost is not None:
                for u in seen:
                    if u.cost is None and u.model not in b.prices:
                        return (f"max_cost is set but model {u.model!r} has no price: pass "
                                f"prices={{{u.model!r}: (input, output)}} per 1M tokens "
                                "(evolve(prices=...), [budgets] prices in the scenario, or "
                                "the agent's prices argument)")
        return None

    # -- the report -----------------------------------------------------------------------

    def summary(self) -> dict:
        """What was used against each budget, by kind (the result's ``budget``)."""
        b = self.limits or Budget()
        out: dict = {}
        for what, used, limit in (("calls", self.calls, b.max_calls),
                                  ("tokens", self.tokens, b.max_tokens),
                                  ("cost", self.cost, b.max_cost)):
            total = sum(used.values())
            row = {**{k: (round(v, 6) if what == "cost" else v) for k, v in used.items()},
                   "total": round(total, 6) if what == "cost" else total, "limit": limit}
            if limit is not None:
                row["over"] = round(max(0, total - limit), 6)
            out[what] = row
        out.update(attempts=self.attempts, throttled_seconds=round(self.throttled, 3),
                   spent=self.spent, in_flight_when_spent=self.in_flight_when_spent,
                   refused_leases=self.refused_leases, unpriced_models=sorted(self.unpriced))
        return out
