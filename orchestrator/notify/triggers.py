"""Which ledger events become which notification, and the message each one is (pure).

A trigger is decided from one event (and, for a task that runs again, the task's state
change before it), so the same events always give the same notifications: the outbox
can look at them again after a crash and enqueue nothing twice.
"""

from __future__ import annotations

import re
from typing import Any

from orchestrator.contract.safe_read import cut

# Events a person must act on (or at least know of at once); the experiment ending FAILED
# is one too (``trigger_of``). Not here, because the watcher handles them by itself:
# queue.waiting and a dropped queue submission (the tasks go out as room frees up),
# recovery.exclusion_lifted (its own fix of a job SLURM could not start), hang.detected
# (the agents restart in place: `recovered` follows). A job SLURM can never start has no
# refusal event of its own: its task is failed (task.state FAILED, so `failed`).
NEEDS_ATTENTION_KINDS = frozenset({
    "scheduler.unreachable",  # nothing is recovered until SLURM answers again
    "watcher.failed",  # one task's supervision stopped on an error (a bug, a damaged file)
    "refresh.failed",
    "hang.escalated",  # node agents that did not answer: stuck processes may hold nodes
    "recovery.hold_kept",  # the site refused to release SLURM's hold: the job waits its BeginTime
    "recovery.wait_storage",  # a full or failing filesystem: someone must free space (it resumes by itself then)
    "storage.watcher_write_failed",  # the watcher's own write into a run folder failed for want of space
    "eval.failed",  # a checkpoint's evaluation failed its every try, or cannot run as asked
})
# Not ledger.illegal_transition: a bug of ours (or a stale observation) that can repeat
# every cycle; it is logged and in the events, and a message per cycle would be a flood.

LABELS = {
    "failed": "task failed",
    "recovered": "task recovered",
    "completed": "experiment completed",
    "needs_attention": "needs attention",
    "new_best": "new best checkpoint",
}

TEXT_CAUSE_CHARS = 300  # of the one-line text; the JSON part carries more
CAUSE_CHARS = 2000


def came_from_recovery(previous: dict | None) -> bool:
    """A task's earlier state change that put it back in the queue after a failed attempt."""
    return previous is not None and previous.get("old_state") == "RECOVERING" and previous.get("new_state") == "PENDING"


def needs_previous(event: dict) -> bool:
    """Whether ``trigger_of`` must see the task's state change before this one: a task that
    starts after waiting in the queue started for the first time, or after a requeue."""
    return event["kind"] == "task.state" and event.get("new_state") == "RUNNING" and event.get("old_state") == "PENDING"


def trigger_of(event: dict, previous: dict | None = None) -> str | None:
    """The trigger of one event, or None. ``previous``: the task's ``task.state`` event
    before this one, where ``needs_previous`` says so."""
    kind, old, new = event["kind"], event.get("old_state"), event.get("new_state")
    if kind == "task.state":
        if new == "FAILED":
            return "failed"
        if new == "RUNNING" and (old == "RECOVERING" or (old == "PENDING" and came_from_recovery(previous))):
            return "recovered"  # runs again after a failed attempt (requeued, or a new job)
        return None
    if kind == "attempt.restarted":
        return "recovered"  # the ranks restarted in place, inside the allocation
    if kind == "experiment.state":
        return {"COMPLETED": "completed", "FAILED": "needs_attention"}.get(new)
    if kind == "eval.best":
        return "new_best"  # checkpoint.keep_best's metric has a new best (sent where notify.on names it)
    return "needs_attention" if kind in NEEDS_ATTENTION_KINDS else None


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]+")


def one_line(text: str) -> str:
    return _CONTROL.sub(" ", text).strip()


def slack_escape(text: str) -> str:
    """Slack reads `<!channel>` and `<url|label>` in a message's text; a cause quotes the
    user's own error messages, so these three are escaped (Mattermost decodes them too)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def message(exp: dict, event: dict, trigger: str) -> dict[str, Any]:
    """The JSON body: a one-line `text` for Slack and Mattermost, and the facts for a program."""
    idx = event.get("idx")
    cause = one_line(str(event.get("cause") or ""))
    where = f"{exp.get('name')} ({exp['id']})" + (f" task {idx}" if idx is not None else "")
    text = f"orchestrate: {where}: {LABELS[trigger]}: {cut(cause, TEXT_CAUSE_CHARS)}"
    return {
        "text": slack_escape(text),
        "orchestrate": {
            "experiment": exp["id"],
            "name": exp.get("name"),
            "task": idx,
            "trigger": trigger,
            "event_id": event["id"],
            "kind": event["kind"],
            "cause": cut(cause, CAUSE_CHARS),
            "time": event["time"],
        },
    }
