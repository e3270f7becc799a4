"""The ledger's experiments and their tasks: created together, a task's state changed
only through the transition table, the experiment's state rolled up from its tasks'."""

from __future__ import annotations

import json
from typing import Any

from orchestrator import states
from orchestrator.ledger.core import LedgerCore
from orchestrator.states import TaskState, TransitionError


class Experiments(LedgerCore):
    # ------------------------------------------------------------ experiments

    def create_experiment(self, exp: dict, tasks: list[dict]) -> None:
        now = self.clock()
        with self.tx():
            self.db["experiments"].insert({**exp, "state": TaskState.PENDING.value, "created_at": now, "updated_at": now})
            self.event(exp["id"], "experiment.created", f"submitted {len(tasks)} task(s) from {exp['spec_path']}", new="PENDING")
            for t in tasks:
                self.db["tasks"].insert(
                    {
                        "experiment_id": exp["id"],
                        "idx": t["idx"],
                        "params": json.dumps(t["params"], sort_keys=True),
                        "state": TaskState.PENDING.value,
                        "task_dir": t["task_dir"],
                        "updated_at": now,
                    }
                )

    def delete_experiment(self, exp_id: str) -> None:
        """Remove an experiment whose submission failed before anything ran."""
        with self.tx():
            for table in ("notifications", "events", "metrics", "heartbeats", "attempts", "actions", "checkpoints", "tasks"):
                self.db[table].delete_where("experiment_id = ?", [exp_id])
            self.db["experiments"].delete_where("id = ?", [exp_id])

    def experiment(self, exp_id: str) -> dict | None:
        rows = self._select("experiments", "id = ?", [exp_id])
        return rows[0] if rows else None

    def find_experiments(self, ref: str | None = None, live_only: bool = False) -> list[dict]:
        """All experiments (newest first), or those whose id is ``ref``, else named ``ref``."""
        where, args = [], []
        if ref:
            exact = self._select("experiments", "id = ?", [ref])
            if exact:
                return exact
            where.append("name = ?")
            args.append(ref)
        if live_only:
            where.append("state not in ('COMPLETED', 'FAILED', 'CANCELLED')")
        return self._select("experiments", " and ".join(where) or None, args, order_by="created_at desc, id desc")

    # ------------------------------------------------------------ tasks

    def tasks(self, exp_id: str) -> list[dict]:
        return self._select("tasks", "experiment_id = ?", [exp_id], order_by="idx")

    def tasks_where(self, where: str, args: list, order_by: str | None = None) -> list[dict]:
        """Tasks by a condition of ours (never a file's)."""
        return self._select("tasks", where, args, order_by=order_by)

    def task(self, exp_id: str, idx: int) -> dict:
        return self._get("tasks", "experiment_id = ? and idx = ?", [exp_id, idx])

    def set_task_state(self, exp_id: str, idx: int, new: TaskState, cause: str, reason: str | None = None) -> bool:
        """Move a task to ``new`` if the transition table allows it; event and roll-up in one go."""
        with self.tx():
            row = self.task(exp_id, idx)
            old = TaskState(row["state"])
            if old == new:
                return False
            try:
                states.check_task(old, new)
            except TransitionError as exc:
                self._illegal(exp_id, exc, cause, idx=idx)
                return False
            self.conn.execute("update tasks set state = ?, updated_at = ?, reason = coalesce(?, reason) where experiment_id = ? and idx = ?",
                              [new.value, self.clock(), reason, exp_id, idx])
            self.event(exp_id, "task.state", cause, idx=idx, old=old.value, new=new.value)
            self._roll_up(exp_id, cause)
            return True

    def update_task(self, exp_id: str, idx: int, **fields: Any) -> None:
        """Progress columns (step, loss, heartbeat); the state goes through ``set_task_state``."""
        self.update_tasks([(exp_id, idx, fields)])

    def update_tasks(self, updates: list[tuple[str, int, dict]]) -> None:
        """``update_task`` for many tasks: one statement per set of columns."""
        now = self.clock()
        groups: dict[tuple[str, ...], list[tuple]] = {}
        for exp_id, idx, fields in updates:
            assert "state" not in fields, "task states change through set_task_state"
            groups.setdefault((*fields, "updated_at"), []).append((*fields.values(), now, exp_id, idx))
        with self.tx():
            for cols, rows in groups.items():
                sets = ", ".join(f'"{c}" = ?' for c in cols)  # our own column names, never a file's
                self.conn.executemany(f"update tasks set {sets} where experiment_id = ? and idx = ?", rows)

    def set_goodput(self, exp_id: str, idx: int, goodput: float | None, at: float, fault_costs: str | None = None) -> None:
        """The task's goodput (and its faults' cost by kind, JSON) as added up ``at``; the row's
        updated_at stays (it tells when the task itself last changed, which is what makes the
        figure stale)."""
        with self.tx():
            self.conn.execute("update tasks set goodput = ?, goodput_at = ?, fault_costs = ? where experiment_id = ? and idx = ?",
                              [goodput, at, fault_costs, exp_id, idx])

    def _roll_up(self, exp_id: str, cause: str) -> None:
        exp = self.experiment(exp_id)
        rows = self.conn.execute("select state from tasks where experiment_id = ?", [exp_id]).fetchall()
        new = states.experiment_state(TaskState(r[0]) for r in rows)
        if new.value != exp["state"]:
            self.conn.execute("update experiments set state = ?, updated_at = ? where id = ?", [new.value, self.clock(), exp_id])
            self.event(exp_id, "experiment.state", cause, old=exp["state"], new=new.value)
