"""The ledger's evaluations of committed checkpoints (``eval.checkpoints``): one row per task
and step, its state, its tries, and its metrics once in. Every change is written with its
event (``eval.*``) in one transaction."""

from __future__ import annotations

import json

from orchestrator.ledger.core import LedgerCore
from orchestrator.states import EvalState

_KEY = "experiment_id = ? and idx = ? and step = ?"


class Evaluations(LedgerCore):
    def plan_evaluation(self, exp_id: str, idx: int, step: int, folder: str, cause: str) -> bool:
        """A committed checkpoint's evaluation is due (PENDING); False if it has a row."""
        with self.tx():
            if self.db["evaluations"].count_where(_KEY, [exp_id, idx, step]):
                return False
            self.db["evaluations"].insert({"experiment_id": exp_id, "idx": idx, "step": step, "folder": folder,
                                           "state": EvalState.PENDING.value, "tries": 0, "created_at": self.clock()})
            self.event(exp_id, "eval.due", cause, idx=idx, data={"step": step})
            return True

    def start_evaluation(self, exp_id: str, idx: int, step: int, pid: int | None, start_ticks: int | None, cause: str,
                         job_id: str | None = None) -> None:
        """RUNNING: its process here (``pid``, ``start_ticks``) or its SLURM job (``job_id``)."""
        with self.tx():
            row = self._get("evaluations", _KEY, [exp_id, idx, step])
            self.db["evaluations"].update((exp_id, idx, step), {
                "state": EvalState.RUNNING.value, "tries": row["tries"] + 1, "pid": pid, "start_ticks": start_ticks,
                "job_id": job_id, "started_at": self.clock()})
            self.event(exp_id, "eval.started", cause, idx=idx, old=row["state"], new=EvalState.RUNNING.value,
                       data={"step": step})

    def end_evaluation(self, exp_id: str, idx: int, step: int, state: EvalState, cause: str, kind: str,
                       result: dict | None = None) -> None:
        """DONE with its ``result`` (metrics, n, seconds), PENDING again (a retry), FAILED or SKIPPED."""
        with self.tx():
            row = self._get("evaluations", _KEY, [exp_id, idx, step])
            fields = {"state": state.value, "reason": cause, "pid": None, "start_ticks": None}  # job_id kept: sacct has it
            if state is not EvalState.PENDING:
                fields["ended_at"] = self.clock()
            if result is not None:
                fields.update(metrics=json.dumps(result["metrics"], sort_keys=True), n=result.get("n"),
                              seconds=result.get("seconds"))
            self.db["evaluations"].update((exp_id, idx, step), fields)
            data = {"step": step, **({"seconds": result["seconds"]} if result and result.get("seconds") is not None else {})}
            self.event(exp_id, kind, cause, idx=idx, old=row["state"], new=state.value, data=data)

    def evaluations(self, exp_id: str, idx: int | None = None) -> list[dict]:
        """Rows in task and step order, ``metrics`` parsed."""
        where, args = "experiment_id = ?", [exp_id]
        if idx is not None:
            where, args = where + " and idx = ?", args + [idx]
        rows = self._select("evaluations", where, args, order_by="idx, step")  # plain SQL: status reads it
        for r in rows:
            r["metrics"] = json.loads(r["metrics"]) if r["metrics"] else None
        return rows

    def evaluations_outstanding(self, exp_ids: list[str]) -> bool:
        """Any evaluation of these experiments due or running (the watcher stays for it)."""
        if not exp_ids:
            return False
        marks = ",".join("?" * len(exp_ids))
        states = [EvalState.PENDING.value, EvalState.RUNNING.value]
        return bool(self.db["evaluations"].count_where(f"experiment_id in ({marks}) and state in (?, ?)", [*exp_ids, *states]))

    def experiments_evaluating(self) -> list[str]:
        """Experiments with an evaluation due or running (ended ones too: the watcher stays for them)."""
        states = [EvalState.PENDING.value, EvalState.RUNNING.value]
        return [r[0] for r in self.conn.execute(
            "select distinct experiment_id from evaluations where state in (?, ?)", states).fetchall()]

    def request_evaluations_stop(self, exp_id: str, idx: int | None, cause: str) -> bool:
        """``orchestrate cancel`` of an experiment whose evaluations outlive its training: the
        watcher stops them (it alone starts and kills them). False if none is due or running."""
        with self.tx():
            where, args = "experiment_id = ? and state in (?, ?)", [exp_id, EvalState.PENDING.value, EvalState.RUNNING.value]
            if idx is not None:
                where, args = where + " and idx = ?", args + [idx]
            if not self.db["evaluations"].count_where(where, args):
                return False
            self.event(exp_id, "eval.stop_requested", cause, idx=idx)
            return True

    def evaluations_stopped(self, exp_id: str) -> set[int | None]:
        """The tasks whose evaluations ``orchestrate cancel`` asked to stop (None: all of the
        experiment's): those due or running stop, and no more are planned."""
        return {r[0] for r in self.conn.execute(
            "select distinct idx from events where experiment_id = ? and kind = 'eval.stop_requested'", [exp_id]).fetchall()}

    def evaluation_jobs(self, exp_ids: list[str]) -> list[dict]:
        """The running evaluations that are SLURM jobs, of these experiments (one poll for them all)."""
        if not exp_ids:
            return []
        marks = ",".join("?" * len(exp_ids))
        return self._select("evaluations", f"experiment_id in ({marks}) and state = ? and job_id is not null",
                            [*exp_ids, EvalState.RUNNING.value])
