"""Support tickets: classify (mechanical model, constrained to a label set) -> draft a reply
(reasoning model) -> reply (deterministic: the queue, the label and the draft, as the answer).

A ticket is a message on `support.classify` with context `{"subject": ..., "body": ...}`. Each
stage's result is the next stage's context. Model output is parsed as data: the label is one of
LABELS (the grammar allows nothing else, and pydantic checks it again), and the draft is text.
Nothing a model writes can change a message's state, tenant or budget.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

from pydantic import BaseModel

from appliance.domain.envelope import Lane
from appliance.domain.errors import InvalidInput
from appliance.domain.pipeline import Pipeline, Stage, StageContext, StageResult

Label = Literal["billing", "bug", "account", "feature", "other"]

# Where each label's tickets are worked.
QUEUES: dict[str, str] = {
    "billing": "billing-desk",
    "bug": "engineering",
    "account": "account-services",
    "feature": "product",
    "other": "front-desk",
}

SUBJECT_MAX = 300
BODY_MAX = 4000


class TicketLabel(BaseModel):
    """The classifier's answer: exactly one label."""

    label: Label


# Few-shot completion, not chat: the small instruction model follows examples better than
# instructions (measured on SAMPLE_TICKETS). The grammar makes the answer {"label": one of LABELS}.
CLASSIFY_PROMPT = (
    "Support tickets and their categories.\n\n"
    "Ticket: My card was charged the wrong amount.\nCategory: billing\n\n"
    "Ticket: The page freezes when I click save.\nCategory: bug\n\n"
    "Ticket: I cannot sign in, my password does not work.\nCategory: account\n\n"
    "Ticket: Please add a calendar view.\nCategory: feature\n\n"
    "Ticket: Where is your office?\nCategory: other\n\n"
    "Ticket: {subject}. {body}\nCategory:"
)

DRAFT_PROMPT = (
    "The following is a support desk's log. Every customer ticket is answered by a helpful, "
    "polite support agent in two or three sentences.\n\n"
    "Ticket (billing): My invoice shows the wrong VAT number.\n"
    "Agent reply: Thank you for letting us know. We have corrected the VAT number on your "
    "account and issued a new invoice, which you will find under Billing > Invoices.\n\n"
    "Ticket ({label}): {subject}. {body}\n"
    "Agent reply:"
)


def _ticket(ctx: StageContext) -> dict[str, Any]:
    context = ctx.message.context
    if not isinstance(context, dict):
        raise InvalidInput("context", "a ticket is an object with subject and body")
    subject = str(context.get("subject", "")).strip()
    body = str(context.get("body", "")).strip()
    if not subject and not body:
        raise InvalidInput("context", "a ticket needs a subject or a body")
    return {**context, "subject": subject[:SUBJECT_MAX], "body": body[:BODY_MAX]}


async def classify(ctx: StageContext) -> StageResult:
    """Label the ticket (mechanical tier, output constrained to the label set)."""
    ticket = _ticket(ctx)
    answer = await ctx.infer(
        "classify",
        CLASSIFY_PROMPT.format(subject=ticket["subject"], body=ticket["body"]),
        schema=TicketLabel,
        max_tokens=24,
    )
    label = answer.data.label
    return ctx.finish(
        {**ticket, "label": label, "queue": QUEUES[label], "classified_by": answer.model}
    )


async def draft(ctx: StageContext) -> StageResult:
    """Draft a reply (reasoning tier; never the mechanical model)."""
    ticket = _ticket(ctx)
    answer = await ctx.infer(
        "draft",
        DRAFT_PROMPT.format(
            label=ticket.get("label", "other"), subject=ticket["subject"], body=ticket["body"]
        ),
        max_tokens=80,
        temperature=0.0,
        stop=["\nTicket", "\n\n"],
    )
    text = " ".join(answer.text.split())
    outcome = "ok" if text else "empty"
    return ctx.finish({**ticket, "draft": text, "drafted_by": answer.model}, outcome)


async def reply(ctx: StageContext) -> StageResult:
    """The answer: queue, label and reply; an empty draft goes to a person instead."""
    ticket = _ticket(ctx)
    draft_text = str(ticket.get("draft", ""))
    return ctx.finish(
        {
            "ticket": ticket.get("ticket_id"),
            "label": ticket.get("label"),
            "queue": ticket.get("queue"),
            "reply": draft_text or None,
            "status": "answered" if draft_text else "escalated",
            "classified_by": ticket.get("classified_by"),
            "drafted_by": ticket.get("drafted_by"),
        }
    )


SUPPORT = Pipeline(
    "support",
    (
        Stage(
            "classify",
            classify,
            lane=Lane.INTERACTIVE,
            task_kind="classify",
            uses_model=True,
            directive="support: label the ticket",
            next={"ok": "draft"},
            max_runtime=timedelta(seconds=120),
        ),
        Stage(
            "draft",
            draft,
            lane=Lane.INTERACTIVE,
            task_kind="draft",
            uses_model=True,
            directive="support: draft a reply",
            next={"ok": "reply", "empty": "reply"},
            max_runtime=timedelta(seconds=300),
        ),
        Stage(
            "reply",
            reply,
            lane=Lane.INTERACTIVE,
            task_kind="format",
            directive="support: answer the customer",
            max_runtime=timedelta(seconds=30),
        ),
    ),
)

SAMPLE_TICKETS: list[dict[str, str]] = [
    {"subject": "Charged twice", "body": "I was charged twice for my subscription this month."},
    {"subject": "App crashes", "body": "The app crashes every time I open the settings page."},
    {"subject": "Cannot log in", "body": "I forgot my password and the reset email never comes."},
    {"subject": "Dark mode please", "body": "Could you add a dark mode to the dashboard?"},
    {"subject": "Refund", "body": "I cancelled last week. When will I get my refund?"},
    {"subject": "Error 500", "body": "Saving a report shows error 500 since this morning."},
    {"subject": "Change email", "body": "How do I change the email address on my account?"},
    {"subject": "Export to CSV", "body": "It would be great to export tables to CSV."},
]
