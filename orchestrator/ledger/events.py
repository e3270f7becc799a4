"""The ledger's event history, read: what happened to an experiment and its tasks, in
order. Events are written with the change they record (``LedgerCore.event``)."""

from __future__ import annotations

from orchestrator.ledger.core import LedgerCore


class Events(LedgerCore):
    def events(self, exp_id: str) -> list[dict]:
        return self._select("events", "experiment_id = ?", [exp_id], order_by="id")

    def events_after(self, exp_id: str, after_id: int, limit: int) -> list[dict]:
        """The experiment's events past ``after_id``, oldest first, at most ``limit``."""
        return self._select("events", "experiment_id = ? and id > ?", [exp_id, after_id], order_by=f"id limit {int(limit)}")

    def task_events(self, exp_id: str, idx: int, kind: str) -> list[dict]:
        return self._select("events", "experiment_id = ? and idx = ? and kind = ?", [exp_id, idx, kind], order_by="id")

    def has_event_of_kind(self, experiment_id: str, kind: str) -> bool:
        return self.conn.execute("select 1 from events where experiment_id = ? and kind = ? limit 1", [experiment_id, kind]).fetchone() is not None

    def has_event(self, experiment_id: str, kind: str, cause: str, *, idx: int | None = None) -> bool:
        """Whether this exact event was recorded already (events said once, not every refresh)."""
        row = self.conn.execute(
            "select 1 from events where experiment_id = ? and idx is ? and kind = ? and cause = ? limit 1",
            [experiment_id, idx, kind, cause],
        ).fetchone()
        return row is not None

    def last_task_state(self, exp_id: str, idx: int, before_id: int) -> dict | None:
        """The task's newest ``task.state`` event before event ``before_id``."""
        rows = self._select("events", "experiment_id = ? and idx = ? and kind = 'task.state' and id < ?", [exp_id, idx, before_id],
                            order_by="id desc limit 1")
        return rows[0] if rows else None

    def last_event_id(self, exp_id: str) -> int:
        """The id of the experiment's newest event (0: none)."""
        return self.conn.execute("select coalesce(max(id), 0) from events where experiment_id = ?", [exp_id]).fetchone()[0]

    def last_event_of(self, exp_id: str, kinds: tuple[str, ...]) -> dict | None:
        rows = self._select("events", f"experiment_id = ? and kind in ({', '.join('?' * len(kinds))})", [exp_id, *kinds],
                            order_by="id desc limit 1")
        return rows[0] if rows else None

    def newest_task_events(self, exp_id: str, kind: str) -> dict[int, dict]:
        """Each task's newest event of ``kind``, by task index."""
        rows = self._select("events", "id in (select max(id) from events where experiment_id = ? and kind = ? and idx is not null "
                            "group by idx)", [exp_id, kind], order_by="id")
        return {r["idx"]: r for r in rows}
