"""The ledger's attempts: one per job a task ran as, numbered per task; a state change
goes through the attempt transition table and comes with its event."""

from __future__ import annotations

from typing import Any

from orchestrator import states
from orchestrator.ledger.experiments import Experiments
from orchestrator.states import AttemptState, TransitionError


class Attempts(Experiments):  # a new attempt is the task's job too
    def attempts(self, exp_id: str, idx: int | None = None) -> list[dict]:
        if idx is None:
            return self._select("attempts", "experiment_id = ?", [exp_id], order_by="idx, number")
        return self._select("attempts", "experiment_id = ? and idx = ?", [exp_id, idx], order_by="number")

    def attempts_started_since(self, since: float, limit: int = 100_000) -> list[dict]:
        """Every experiment's attempts that started at ``since`` or later (the cluster's recent history)."""
        return self._select("attempts", "started_at >= ?", [since], order_by=f"started_at desc limit {int(limit)}")

    def attempt(self, exp_id: str, idx: int, number: int) -> dict:
        return self._get("attempts", "experiment_id = ? and idx = ? and number = ?", [exp_id, idx, number])

    def add_attempt(self, exp_id: str, idx: int, job_id: str, cause: str) -> int:
        with self.tx():
            row = self.conn.execute(
                "select coalesce(max(number), 0) from attempts where experiment_id = ? and idx = ?", [exp_id, idx]
            ).fetchone()
            number = row[0] + 1
            self.db["attempts"].insert(
                {
                    "experiment_id": exp_id,
                    "idx": idx,
                    "number": number,
                    "job_id": job_id,
                    "state": AttemptState.PENDING.value,
                    "restarts": 0,
                    "submitted_at": self.clock(),
                }
            )
            self.update_task(exp_id, idx, job_id=job_id)
            self.event(exp_id, "attempt.submitted", cause, idx=idx, attempt=number, new="PENDING")
            return number

    def update_attempt(self, exp_id: str, idx: int, number: int, cause: str, **fields: Any) -> bool:
        """Update an attempt; a change of state is recorded as an event. False when the
        transition table refuses the change (nothing is written then)."""
        with self.tx():
            row = self._get("attempts", "experiment_id = ? and idx = ? and number = ?", [exp_id, idx, number])
            changes = {k: v for k, v in fields.items() if row.get(k) != v}
            if not changes:
                return True
            if "state" in changes:
                try:
                    states.check_attempt(AttemptState(row["state"]), AttemptState(changes["state"]))
                except TransitionError as exc:
                    self._illegal(exp_id, exc, cause, idx=idx, attempt=number)
                    return False
            self.db["attempts"].update((exp_id, idx, number), changes)
            if "state" in changes:
                self.event(exp_id, "attempt.state", cause, idx=idx, attempt=number, old=row["state"], new=changes["state"])
            return True

    def set_attempt_restarts(self, exp_id: str, idx: int, number: int, restarts: int) -> None:
        """How many times the attempt's ranks were restarted in place."""
        self.db["attempts"].update((exp_id, idx, number), {"restarts": restarts})

    def set_attempt_exclude(self, exp_id: str, idx: int, number: int, nodes: list[str]) -> None:
        """The nodes the task's next run is kept off, decided when this attempt was recovered."""
        self.db["attempts"].update((exp_id, idx, number), {"exclude": ",".join(sorted(nodes)) or None})
