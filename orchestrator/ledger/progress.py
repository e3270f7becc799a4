"""What the ingest stores from the files compute nodes write: heartbeats, metrics and
committed checkpoints, and how far into each file it has read (``cursors``)."""

from __future__ import annotations

from orchestrator.ledger.experiments import Experiments
from orchestrator.states import CheckpointState


class Progress(Experiments):  # a new checkpoint is shown on its task
    # ------------------------------------------------------------ heartbeats and metrics

    def upsert_heartbeats(self, rows: list[dict]) -> None:
        self._upsert_many("heartbeats", rows, ("experiment_id", "idx", "rank"))

    def heartbeats(self, exp_id: str, idx: int) -> list[dict]:
        return self._select("heartbeats", "experiment_id = ? and idx = ?", [exp_id, idx], order_by="rank")

    def add_metrics(self, rows: list[dict]) -> None:
        self._upsert_many("metrics", rows, ("experiment_id", "idx", "step"))

    def metrics(self, exp_id: str, idx: int) -> list[dict]:
        return self._select("metrics", "experiment_id = ? and idx = ?", [exp_id, idx], order_by="step")

    # ------------------------------------------------------------ read positions in the files

    def cursor(self, path: str) -> int:
        return self.cursors([path]).get(path, 0)

    def cursors(self, paths: list[str]) -> dict[str, int]:
        """The read positions of ``paths`` that are set (one query per 500)."""
        out: dict[str, int] = {}
        for i in range(0, len(paths), 500):
            part = paths[i:i + 500]
            out.update(self.conn.execute(f"select path, offset from cursors where path in ({', '.join('?' * len(part))})", part).fetchall())
        return out

    def set_cursor(self, path: str, offset: int) -> None:
        self.set_cursors({path: offset})

    def set_cursors(self, offsets: dict[str, int]) -> None:
        self._upsert_many("cursors", [{"path": p, "offset": o} for p, o in offsets.items()], ("path",))

    # ------------------------------------------------------------ checkpoints

    def record_checkpoint(self, exp_id: str, idx: int, step: int, path: str, created_at: float | None) -> None:
        """A checkpoint the trainer committed; the task shows its newest."""
        self.db["checkpoints"].upsert(
            {"experiment_id": exp_id, "idx": idx, "step": step, "path": path, "state": CheckpointState.COMMITTED.value, "created_at": created_at},
            pk=("experiment_id", "idx", "step"),
        )
        shown = str(self.task(exp_id, idx).get("checkpoint") or "").split(" ")[0]
        if not (shown.isascii() and shown.isdigit()) or step >= int(shown):  # a damaged value is replaced, never fatal
            self.update_task(exp_id, idx, checkpoint=str(step))

    def mark_checkpoint(self, exp_id: str, idx: int, step: int, state: CheckpointState) -> None:
        with self.tx():
            self.conn.execute(
                "update checkpoints set state = ? where experiment_id = ? and idx = ? and step = ?",
                [CheckpointState(state).value, exp_id, idx, step],
            )

    def checkpoints(self, exp_id: str, idx: int) -> list[dict]:
        return self._select("checkpoints", "experiment_id = ? and idx = ?", [exp_id, idx], order_by="step")
