"""The front doors: :func:`parallel`, :func:`run_group`, :func:`resume_group`.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from pathlib import Path
from typing import Any

import msgspec

from actors.machines.collector import check_inputs
from actors.errors import ConfigError
from protocol import UserInputs
from actors.groups.limits import Budgets
from actors.errors import ResumeRefused
from actors.groups.outcome import GroupOutcome, results_of
from actors.groups.store import Store
from actors.groups.driver import (
                                  _FIXED_AT_START, _OPTIONS, _Plan, _RESUME_ONLY, _ambient_parent, _check_bounds, _check_items, _check_options, _execute, _take_items, NO_BUDGETS)
from actors.groups.target import _resolve_target, _target_returns
from actors.groups.host import _Host
from actors.groups.checkpoint import (EffectLog, _exclusive, _write_checkpoint, check_code,
                                      effects_path, load_checkpoint, running_checkpoint)
from actors.groups.limits import CANCEL_DEADLINE_S
from actors.version import PACKAGE_VERSION
from actors.groups.types import output_type, type_name, type_named
from actors.workers import scope


#: A standalone group's id: a random prefix per process (drawn again in a forked child)
#: and a count, so a call makes no system call for it.
_ids: list = [os.urandom(4).hex(), itertools.count()]


def _new_ids() -> None:
    _ids[:] = [os.urandom(4).hex(), itertools.count()]


os.register_at_fork(after_in_child=_new_ids)


def _new_group_id() -> str:
    return f"{_ids[0]}{next(_ids[1]):04x}"


def run_group(target, items, *, max_concurrency: int, max_items: int,
              checkpoint: str | os.PathLike | None = None, _parent: _Host | None = None,
              **options) -> GroupOutcome:
    """Run ``target`` over ``items`` as a bounded parallel group; never raises for the
    group's own errors or pauses: read ``outcome.status``.

    ``target``: a callable taking ``item`` or ``(item, ctx)``, or an import path
    ``"package.module:function"`` (then a checkpoint can be resumed without it). Its
    output type R is its return annotation, or ``returns=R`` (``returns=object``: any
    value); each branch's value is checked and converted to R.
    ``checkpoint``: where to write the checkpoint if the group pauses (default: a new
    temporary file, ``outcome.checkpoint``). ``options``: ``limits``, ``budgets``,
    ``store``, ``approvers``, ``cancel_deadline``, ``chunk``, ``bus``, ``log``,
    ``runtime``, ``allow``, ``trace``, ``pass_ctx``, ``on_progress``, ``returns``,
    ``suspend`` (docs/groups.md).
    Called inside a branch, it runs as a nested group sharing the branch's limits,
    budgets and store."""
    _check_options(options, _OPTIONS, "run_group()")
    _check_bounds(max_concurrency, max_items)
    taken = _take_items(items, max_items)
    fn, ref = _resolve_target(target, options.get("allow"))
    returns = _target_returns(fn, options.get("returns"), "run_group()")
    parent = _ambient_parent(_parent)
    if parent is not None and parent.runtime is None:   # a branch on a worker elsewhere:
        return parent.nested(target, items, max_concurrency=max_concurrency,   # the group
                             max_items=max_items, _parent=parent, **options)   # runs there
    # Started inside an evolve() run's call (not inside a branch): part of that run.
    call = scope.current() if parent is None and options.get("runtime") is None else None
    gid = call.next_group_id() if call is not None else _new_group_id()
    finished = call.run.finished.get(gid, {}) if call is not None else {}
    budgets = options.get("budgets") or NO_BUDGETS
    if not isinstance(budgets, Budgets):
        raise ConfigError(f"budgets must be Budgets(calls=, seconds=, cost=), got "
                          f"{type(budgets).__name__}")
    store = options.get("store")
    if store is not None and not isinstance(store, (dict, Store)):
        raise ConfigError(f"store must be a dict (its initial content), got {type(store).__name__}")
    if isinstance(store, dict):
        try:
            store = Store(store)
        except TypeError as exc:
            raise ConfigError(str(exc)) from None
    approvers = options.get("approvers")
    if approvers is not None:
        if isinstance(approvers, str) or not all(isinstance(a, str) for a in approvers):
            raise ConfigError(f"approvers must be a list of names, got {approvers!r}")
        approvers = list(approvers)
    if not taken:   # an empty list: an empty result, the target is never called
        return GroupOutcome(status="completed", group_id=gid, results=[])
    checked = _check_items(taken)
    items_bytes, taken = checked if checked is not None else (None, taken)
    plan = _Plan(items_bytes=items_bytes, nested=run_group, group_id=gid, fn=fn, ref=ref, items=taken, max_concurrency=max_concurrency,
                 max_items=max_items, options=options, parent=parent, budgets=budgets,
                 store=store, approvers=approvers,
                 checkpoint=Path(checkpoint) if checkpoint is not None else None,
                 branches_to_run=len(taken) - len(finished), returns=returns, call=call,
                 finished=finished)
    # A top-level group with a checkpoint keeps it on disk from the start (_checkpointed).
    run = _checkpointed if plan.checkpoint is not None and parent is None else _execute
    if call is None:
        return run(plan)
    outcome = None
    try:
        outcome = run(plan)
    finally:   # reported with the rollout: the run's Planner counts them
        call.calls += outcome.consumed.calls if outcome is not None else 0
    return outcome


def _checkpointed(plan: _Plan, *, again: bool = False) -> GroupOutcome:
    """A top-level group with a checkpoint path: the checkpoint is on disk (status
    ``running``) before the first branch starts and its effects are written ahead, so a
    crash at any moment leaves a checkpoint :func:`resume_group` goes on from. One
    process at a time runs or resumes it (the checkpoint's lock)."""
    path = plan.checkpoint
    with _exclusive(path):
        if not again:
            fresh_checkpoint(path)
        running = running_checkpoint(
            group_id=plan.group_id, target=plan.ref, fn=plan.fn, items=plan.items,
            max_concurrency=plan.max_concurrency, max_items=plan.max_items,
            budgets=plan.budgets, consumed=plan.consumed,
            store=(plan.store or Store()).snapshot(), approvers=plan.approvers,
            chunk=plan.options.get("chunk", 0),
            cancel_deadline=plan.options.get("cancel_deadline", CANCEL_DEADLINE_S),
            package_version=PACKAGE_VERSION, written_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            returns=type_name(plan.returns), suspend=plan.options.get("suspend", "all"),
            workers=plan.options.get("workers"))
        _write_checkpoint(path, running)
        outcome = _execute(plan)   # a pause rewrites the checkpoint itself (_outcome)
        if outcome.status == "failed" and again:
            # A failed resume does not spend the checkpoint: it stays resumable.
            _write_checkpoint(path, msgspec.structs.replace(
                running, consumed=outcome.consumed,
                written_at=time.strftime("%Y-%m-%dT%H:%M:%S%z")))
        elif outcome.status in ("completed", "failed"):
            _write_checkpoint(path, msgspec.structs.replace(
                running, status=outcome.status, consumed=outcome.consumed,
                store=outcome.store, effects=outcome.effects, not_started=[],
                written_at=time.strftime("%Y-%m-%dT%H:%M:%S%z")))
        if outcome.status == "completed":
            EffectLog(path).remove()
    return outcome


#: The statuses of a checkpoint whose group has ended: a new group may take its path.
ENDED = ("completed", "failed")


def fresh_checkpoint(path: Path) -> None:
    """A new group at the checkpoint path ``path``: refused when :func:`checkpoint_taken`
    says why; the effect journal an ended group left there (a failed one keeps it) is
    removed: it is not the new group's, whose effects must not take results from it."""
    taken = checkpoint_taken(path)
    if taken is not None:
        raise ConfigError(taken)
    try:
        os.unlink(effects_path(path))
    except FileNotFoundError:   # no journal left there: nothing to remove
        pass


def checkpoint_taken(path: Path) -> str | None:
    """Why a new group may not take the checkpoint path ``path`` (None: it may): a
    checkpoint there of a group that has not ended (paused, or running when its process
    stopped), which the new group would replace, taking its effects' results from its
    journal; or a file there that is no checkpoint. The message names how to go on."""
    if not path.exists():
        return None
    try:
        old = load_checkpoint(path)
    except ResumeRefused as exc:   # not a checkpoint: not ours to replace
        return (f"checkpoint={path}: the file there is not a checkpoint a new group may "
                f"replace ({exc}); give this group another checkpoint path, or move that "
                "file away")
    if old.status in ENDED:
        return None
    crashed = old.status == "running"
    what = ("running when its process stopped (a crash)" if crashed else
            f"paused ({old.status}) with {len(old.pending)} interaction(s) waiting")
    resume = (f"`evobus resume {path}`" if crashed else
              f"`evobus resume {path} --answers FILE`; --show lists what it waits on")
    return (f"checkpoint={path} holds group {old.group_id}, {what}; a new group would "
            f"replace it and take its effects' results from its journal. Resume it "
            f"({resume}; resume_group() from Python), or remove {path} and "
            f"{effects_path(path)} to start over (`evobus run --overwrite` does), or give "
            "this group another checkpoint path")


def parallel(target, items, *, max_concurrency: int, max_items: int,
             _parent: _Host | None = None, **options) -> list[Any]:
    """The results of ``target`` over ``items``, in input order.

    Raises :class:`GroupFailed` (the first error, and which branches finished, failed,
    were cancelled or never started) or :class:`GroupPaused` (a branch asked a question
    or an approval: resume the checkpoint with :func:`resume_group`)."""
    return results_of(run_group(target, items, max_concurrency=max_concurrency,
                                max_items=max_items, _parent=_parent, **options))


async def parallel_async(target, items, *, max_concurrency: int, max_items: int,
                         **options) -> list[Any]:
    """:func:`parallel` for code already inside an event loop: the group runs in a
    worker thread (which copies the caller's context, so a group started inside a run
    or a branch still nests there) and the loop stays free. Cancelling the awaiting
    task does not cancel the group: bound it with ``budgets=`` or ``limits=``."""
    return await asyncio.to_thread(parallel, target, items, max_concurrency=max_concurrency,
                                   max_items=max_items, **options)


def resume_group(checkpoint: str | os.PathLike, *, target=None,
                 user_inputs: dict[str, Any] | None = None,
                 approvals: dict[str, bool] | None = None, **options) -> GroupOutcome:
    """Resume a paused group from its checkpoint file (this process or another one).

    ``user_inputs`` answers questions and ``approvals`` decides actions, by interaction
    id; each id is consumed once. Approvals need ``principal=`` among the group's
    approvers. Finished branches are never dispatched again, consumed budgets stay
    consumed, suspended branches replay their journal. ``target`` may be omitted when
    the group's target was named by import path. The checkpoint file is rewritten with
    the new state (a later pause, or the end)."""
    _check_options(options, {**_OPTIONS, **_RESUME_ONLY}, "resume_group()")
    for name in _FIXED_AT_START:
        if name in options:
            raise ConfigError(f"resume_group(): {name} is fixed when the group starts and "
                              "kept in its checkpoint; it cannot change on resume")
    path = Path(checkpoint)
    ckpt = load_checkpoint(path)
    if ckpt.status == "running":
        return _restart(path, ckpt, target, user_inputs, approvals, options)
    if ckpt.status not in ("user_input_pending", "approval_pending"):
        raise ResumeRefused(f"{path}: the group {ckpt.group_id} already ended "
                            f"({ckpt.status}); there is nothing to resume")
    user_inputs = dict(user_inputs or {})
    approvals = dict(approvals or {})
    principal = options.pop("principal", None)
    pending = {p.id: p for p in ckpt.pending}
    problem = check_inputs(pending, ckpt.used_ids, user_inputs, approvals, principal,
                           ckpt.approvers)
    if problem is not None:
        raise ResumeRefused(f"{path}: {problem}")
    fn, ref, returns = _checkpoint_target(path, ckpt, target, options)
    suspend = options.setdefault("suspend", ckpt.suspend)
    answered = {pending[i].branch for i in [*user_inputs, *approvals]}
    answered |= {i for i in ckpt.not_started if i in ckpt.journals}
    left = len(pending) - len(user_inputs) - len(approvals)
    to_run = len(answered) + (len(ckpt.not_started) if left == 0 or suspend == "all" else 0)
    try:
        store = Store(ckpt.store)
    except TypeError as exc:
        raise ResumeRefused(f"{path}: the checkpoint's store does not load: {exc}") from None
    with _exclusive(path):
        ckpt = load_checkpoint(path)   # re-read under the lock: another resumer may have won
        if ckpt.status not in ("user_input_pending", "approval_pending"):
            raise ResumeRefused(f"{path}: the group {ckpt.group_id} already ended "
                                f"({ckpt.status}); there is nothing to resume")
        problem = check_inputs({p.id: p for p in ckpt.pending}, ckpt.used_ids, user_inputs,
                               approvals, principal, ckpt.approvers)
        if problem is not None:
            raise ResumeRefused(f"{path}: {problem}")
        options = {**options, "chunk": options.get("chunk", ckpt.chunk),
                   "cancel_deadline": options.get("cancel_deadline", ckpt.cancel_deadline)}
        if ckpt.workers is not None:   # the branches run where they ran before the pause
            options.setdefault("workers", ckpt.workers)
        plan = _Plan(nested=run_group, group_id=ckpt.group_id, fn=fn, ref=ref or ckpt.target, items=ckpt.items,
                     max_concurrency=ckpt.max_concurrency, max_items=ckpt.max_items,
                     options=options, parent=_ambient_parent(None), budgets=ckpt.budgets,
                     consumed=ckpt.consumed, store=store, approvers=ckpt.approvers,
                     resume=ckpt, checkpoint=path, branches_to_run=max(1, to_run),
                     returns=returns,
                     inputs=UserInputs(group_id=ckpt.group_id, answers=user_inputs,
                                       approvals=approvals, principal=principal))
        outcome = _execute(plan)
        _after_resume(path, ckpt, outcome, [*ckpt.used_ids, *user_inputs, *approvals])
    # Finished results from before the pause are part of the join.
    return outcome


def _after_resume(path: Path, ckpt, outcome: GroupOutcome, used: list[str]) -> None:
    """The checkpoint once a resume ended: spent when the group completed (a second
    resume is refused, by name); kept resumable when it failed (a retry with fixed code
    or other answers may resume it), with what it consumed recorded. A new pause
    rewrote the file in _outcome already."""
    now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    if outcome.status == "completed":
        _write_checkpoint(path, msgspec.structs.replace(
            ckpt, status=outcome.status, pending=[], used_ids=used,
            consumed=outcome.consumed, store=outcome.store, effects=outcome.effects,
            written_at=now))
        EffectLog(path).remove()   # nothing is left to replay
    elif outcome.status == "failed":
        _write_checkpoint(path, msgspec.structs.replace(ckpt, consumed=outcome.consumed,
                                                        written_at=now))


def _checkpoint_target(path: Path, ckpt, target, options: dict[str, Any]):
    """The target a checkpoint is resumed with (the one given, else the one it names),
    checked against the code that wrote it, and its output type R (given, else the
    checkpoint's)."""
    if target is None:
        if ckpt.target is None:
            raise ConfigError(f"{path}: the group's target was not named by import path, so "
                              "the checkpoint cannot name it: pass target=the same callable")
        target = ckpt.target
    fn, ref = _resolve_target(target, options.get("allow"))
    check_code(path, ckpt, fn)
    returns = options.get("returns")
    if returns is None and ckpt.returns:
        returns = type_named(ckpt.returns, f"{path}: the checkpoint's returns")
    return fn, ref, output_type(fn, returns, "resume_group()")


def _restart(path: Path, ckpt, target, user_inputs, approvals, options) -> GroupOutcome:
    """Resume a checkpoint left ``running``: the process running its group died (or is
    still running it: then the checkpoint's lock refuses). The group runs again, under
    its id, over the same items; effects that finished before the crash are taken from
    the effect log instead of running again (docs/groups.md)."""
    if user_inputs or approvals or "principal" in options:
        raise ResumeRefused(f"{path}: the group {ckpt.group_id} stopped while running (no "
                            "interaction is pending): resume it without user_inputs, "
                            "approvals or principal")
    fn, ref, returns = _checkpoint_target(path, ckpt, target, options)
    try:
        store = Store(ckpt.store)
    except TypeError as exc:
        raise ResumeRefused(f"{path}: the checkpoint's store does not load: {exc}") from None
    options = {**options, "chunk": options.get("chunk", ckpt.chunk),
               "cancel_deadline": options.get("cancel_deadline", ckpt.cancel_deadline),
               "suspend": options.get("suspend", ckpt.suspend)}
    if ckpt.workers is not None:   # the branches run where they ran before the crash
        options.setdefault("workers", ckpt.workers)
    plan = _Plan(nested=run_group, group_id=ckpt.group_id, fn=fn, ref=ref or ckpt.target,
                 items=ckpt.items, max_concurrency=ckpt.max_concurrency,
                 max_items=ckpt.max_items, options=options, parent=_ambient_parent(None),
                 budgets=ckpt.budgets, consumed=ckpt.consumed, store=store,
                 approvers=ckpt.approvers, checkpoint=path,
                 branches_to_run=len(ckpt.items), returns=returns)
    return _checkpointed(plan, again=True)
