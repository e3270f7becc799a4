"""The ledger's actions: a recovery of a failed attempt, or the submission of a task
that waited for room in the queue, written down (PLANNED) before it is taken and
marked DONE after, so that a watcher killed in between finishes it once."""

from __future__ import annotations

import json

from orchestrator.ledger.core import LedgerCore
from orchestrator.states import ActionState


class Actions(LedgerCore):
    def plan_action(self, exp_id: str, idx: int, attempt: int, kind: str, detail: dict, cause: str, topic: str = "recovery") -> bool:
        """Record an action before taking it: a recovery (one per failed attempt), or with
        ``attempt`` 0 the submission of a task that waited for room in the queue (topic
        ``queue``); False if one exists."""
        with self.tx():
            if self.db["actions"].count_where("experiment_id = ? and idx = ? and attempt = ?", [exp_id, idx, attempt]):
                return False
            self.db["actions"].insert(
                {
                    "experiment_id": exp_id,
                    "idx": idx,
                    "attempt": attempt,
                    "kind": kind,
                    "state": ActionState.PLANNED.value,
                    "detail": json.dumps(detail, sort_keys=True),
                    "created_at": self.clock(),
                }
            )
            self.event(exp_id, f"{topic}.{kind}", cause, idx=idx, attempt=attempt or None)
            return True

    def replan_action(self, exp_id: str, idx: int, attempt: int, kind: str, detail: dict, cause: str) -> None:
        """An attempt's action taken already that did not do its work (a requeue that never
        took) replaced by another, planned before it is taken like the first."""
        with self.tx():
            self.db["actions"].update((exp_id, idx, attempt), {"kind": kind, "state": ActionState.PLANNED.value,
                                                               "detail": json.dumps(detail, sort_keys=True), "created_at": self.clock(), "done_at": None})
            self.event(exp_id, f"recovery.{kind}", cause, idx=idx, attempt=attempt)

    def drop_action(self, exp_id: str, idx: int, attempt: int, cause: str, topic: str = "recovery") -> None:
        """A planned action that was never taken (the scheduler has no trace of it): gone, so it can be planned anew."""
        with self.tx():
            row = self._get("actions", "experiment_id = ? and idx = ? and attempt = ?", [exp_id, idx, attempt])
            self.db["actions"].delete((exp_id, idx, attempt))
            self.event(exp_id, f"{topic}.{row['kind']}.dropped", cause, idx=idx, attempt=attempt or None)

    def finish_action(self, exp_id: str, idx: int, attempt: int, detail: dict, cause: str, topic: str = "recovery") -> None:
        with self.tx():
            row = self._get("actions", "experiment_id = ? and idx = ? and attempt = ?", [exp_id, idx, attempt])
            merged = {**json.loads(row["detail"] or "{}"), **detail}
            self.db["actions"].update(
                (exp_id, idx, attempt), {"state": ActionState.DONE.value, "detail": json.dumps(merged, sort_keys=True), "done_at": self.clock()}
            )
            self.event(exp_id, f"{topic}.{row['kind']}.done", cause, idx=idx, attempt=attempt or None)

    def actions(self, exp_id: str, idx: int | None = None, state: ActionState | None = None) -> list[dict]:
        where, args = ["experiment_id = ?"], [exp_id]
        if idx is not None:
            where.append("idx = ?")
            args.append(idx)
        if state is not None:
            where.append("state = ?")
            args.append(ActionState(state).value)
        rows = self._select("actions", " and ".join(where), args, order_by="idx, attempt")
        for r in rows:
            r["detail"] = json.loads(r["detail"] or "{}")
        return rows
