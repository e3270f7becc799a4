"""The ledger's notifications: the outbox of ``spec.notify``, one row per (event,
trigger), PENDING until delivered or given up."""

from __future__ import annotations

import json
from typing import Any

from orchestrator.ledger.core import LedgerCore


class Notifications(LedgerCore):
    def add_notifications(self, rows: list[dict]) -> int:
        """New PENDING notifications; one that exists for its (event, trigger) is left as it is.
        Returns how many were added."""
        now = self.clock()
        with self.tx():
            before = self.conn.total_changes
            self.conn.executemany(
                "insert or ignore into notifications (experiment_id, event_id, trigger, payload, state, attempts, next_at, created_at) "
                "values (?, ?, ?, ?, 'PENDING', 0, ?, ?)",
                [(r["experiment_id"], r["event_id"], r["trigger"], json.dumps(r["payload"], sort_keys=True), now, now) for r in rows],
            )
            return self.conn.total_changes - before

    def due_notifications(self, exp_id: str, now: float, limit: int = 100, eager_prefix: str | None = None) -> list[dict]:
        """PENDING rows due at ``now``, oldest first; with ``eager_prefix`` also, due or not,
        those never tried and those whose last error starts with it."""
        where, args = "experiment_id = ? and state = 'PENDING' and (next_at <= ?", [exp_id, now]
        if eager_prefix is not None:
            where += " or attempts = 0 or substr(coalesce(last_error, ''), 1, ?) = ?"
            args += [len(eager_prefix), eager_prefix]
        return self._select("notifications", where + ")", args, order_by=f"id limit {int(limit)}")

    def pending_notifications(self, exp_ids: list[str]) -> int:
        """How many PENDING notifications the experiments have."""
        marks = ", ".join("?" * len(exp_ids))
        return self.conn.execute(f"select count(*) from notifications where state = 'PENDING' and experiment_id in ({marks})",
                                 list(exp_ids)).fetchone()[0]

    def notification(self, row_id: int) -> dict | None:
        rows = self._select("notifications", "id = ?", [row_id])
        return rows[0] if rows else None

    def notifications(self, exp_id: str) -> list[dict]:
        return self._select("notifications", "experiment_id = ?", [exp_id], order_by="id")

    def update_notification(self, row_id: int, **fields: Any) -> None:
        sets = ", ".join(f'"{c}" = ?' for c in fields)  # our own column names
        with self.tx():
            self.conn.execute(f"update notifications set {sets} where id = ?", [*fields.values(), row_id])

    def notify_backlog(self, cursor_prefix: str) -> list[str]:
        """Experiments with ``notify`` in their spec that have PENDING notifications, or events
        past their cursor (``cursor_prefix`` + id): ended ones too, so that nothing is lost."""
        rows = self.conn.execute(
            "select id from experiments e where e.spec like '%\"notify\": {%' and ("
            " exists (select 1 from notifications n where n.state = 'PENDING' and n.experiment_id = e.id)"
            " or coalesce((select offset from cursors where path = ? || e.id), 0)"
            "    < coalesce((select max(id) from events v where v.experiment_id = e.id), 0))"
            " order by created_at",
            [cursor_prefix],
        ).fetchall()
        return [r[0] for r in rows]
