"""Support tickets triaged by a bounded parallel group: the domain behind
scenarios/groups.toml (docs/groups.md).

Each branch routes one ticket to a category by keyword. A message with no keyword is
asked about (``ctx.ask``: the group pauses with ``user_input_pending``); a refund above
``APPROVAL_EUR`` needs a human's approval (``ctx.approve``). Issuing the refund and
sending the reply are external effects run through ``ctx.effect``, so a branch replayed
after a pause never issues a refund or sends a reply twice. The category counts go to
the shared store after the last interaction (a replayed branch runs its code again; its
effects do not).

``python -m scenarios.tickets CHECKPOINT`` prints answers for what a checkpoint waits on
(a stand-in human: approve everything, file unclear tickets under ``account``).

Offline and deterministic. Effects append a JSON line to the file named by
``$EVOBUS_TICKETS_OUTBOX`` when it is set (tests count them), and otherwise only return
a reference.
"""

from __future__ import annotations

import json
import os

APPROVAL_EUR = 100

KEYWORDS: dict[str, tuple[str, ...]] = {
    "billing": ("refund", "invoice", "charged"),
    "shipping": ("parcel", "delivery", "tracking"),
    "technical": ("crash", "error", "freeze"),
    "account": ("password", "username", "login"),
}
CATEGORIES = list(KEYWORDS)

TICKETS: list[dict] = [
    {"id": "T1", "text": "I was charged twice this month", "refund": 30},
    {"id": "T2", "text": "Where is my parcel? The tracking page is empty"},
    {"id": "T3", "text": "The app shows an error when I open settings"},
    {"id": "T4", "text": "Please refund my annual plan, I never used it", "refund": 480},
    {"id": "T5", "text": "I forgot my password again"},
    {"id": "T6", "text": "The delivery came broken"},
    {"id": "T7", "text": "Hello? Is anybody there?"},
    {"id": "T8", "text": "Login fails since the update"},
]


def tickets() -> list[dict]:
    """The eight tickets of the scenario, as JSON-like dicts."""
    return [dict(t) for t in TICKETS]


def classify(text: str) -> str | None:
    words = text.lower()
    for category, keywords in KEYWORDS.items():
        if any(k in words for k in keywords):
            return category
    return None


def _outbox(record: dict) -> None:
    path = os.environ.get("EVOBUS_TICKETS_OUTBOX")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def issue_refund(ticket_id: str, amount: int) -> str:
    _outbox({"effect": "refund", "ticket": ticket_id, "amount": amount})
    return f"refund-{ticket_id}"


def send_reply(ticket_id: str, category: str) -> str:
    _outbox({"effect": "reply", "ticket": ticket_id, "category": category})
    return f"reply-{ticket_id}"


def triage(ticket: dict, ctx) -> dict:
    """One branch: route, maybe ask, maybe get a refund approved, reply, count."""
    category = classify(ticket["text"])
    if category is None:
        category = ctx.ask(f"Which category for ticket {ticket['id']} ({ticket['text']!r})? "
                           f"One of: {', '.join(CATEGORIES)}")
        if category not in CATEGORIES:
            raise ValueError(f"ticket {ticket['id']}: {category!r} is not a category; answer "
                             f"one of {CATEGORIES}")
    refund = None
    amount = ticket.get("refund", 0)
    if amount:
        if amount <= APPROVAL_EUR or ctx.approve(f"refund {amount} EUR on ticket {ticket['id']}"):
            refund = ctx.effect("refund", issue_refund, ticket["id"], amount)
    reply = ctx.effect("reply", send_reply, ticket["id"], category)
    ctx.store.incr(f"tickets.{category}")
    return {"id": ticket["id"], "category": category, "refund": refund, "reply": reply}


def stand_in_answers(checkpoint: str) -> dict:
    """A stand-in for the human, for demos and docs: approve every pending action and
    file every unclear ticket under ``account``. Prints nothing; returns the answers."""
    from actors.groups.checkpoint import load_checkpoint

    ckpt = load_checkpoint(checkpoint)
    return {p.id: (True if p.kind == "approve" else "account") for p in ckpt.pending}


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m scenarios.tickets CHECKPOINT  (prints answers as JSON)")
    print(json.dumps(stand_in_answers(sys.argv[1]), indent=2))
