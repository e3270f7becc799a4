"""The ledger: every experiment, task, attempt, heartbeat, metric and event.

Only the login side writes it, and only through this class. Each state change and its
event are written in one transaction, so no reader ever sees one without the other.
Every task and attempt state change is checked against the transition tables in
``orchestrator.states``: an illegal move is never applied; it raises in strict mode
(the tests: ``$ORCHESTRATE_STRICT_TRANSITIONS=1``) and is an event otherwise.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from orchestrator.contract import envvars
from orchestrator.errors import UserError
from orchestrator import states
from orchestrator.states import ActionState, AttemptState, CheckpointState, TaskState, TransitionError
from orchestrator.ledger.migrations import migrate, pending

if TYPE_CHECKING:
    import sqlite_utils

log = logging.getLogger(__name__)

NETWORK_FS = {"nfs", "nfs4", "lustre", "gpfs", "cifs", "smbfs", "smb3", "beegfs", "ceph", "fuse.glusterfs", "glusterfs", "panfs", "fuse.sshfs", "wekafs"}


def ledger_shared(folder: str | os.PathLike) -> tuple[bool, str]:
    """Whether the ledger's folder is one that other hosts see (a network filesystem: then
    a compute node's watcher and the login node share it), and how we know."""
    declared = os.environ.get(envvars.LEDGER_FS, "")
    if declared in ("network", "local"):
        return declared == "network", f"{envvars.LEDGER_FS}={declared}"
    fstype = filesystem_type(folder)
    return fstype in NETWORK_FS, f"a {fstype or 'unknown'} filesystem"


def filesystem_type(path: str | os.PathLike) -> str | None:
    """The type of the filesystem holding ``path``, from /proc/mounts (longest mount prefix)."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    best, best_type = "", None
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = parts[1].replace("\\040", " ")
        if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, best_type = mnt, parts[2]
    return best_type


def _private(path: Path) -> None:
    """The ledger holds whole specs, ``env`` values (tokens) included: 0600 whatever the
    umask, and tightened if an older version left it readable (SQLite gives its -wal and
    -shm files the database's mode).

    Never opens a database that exists: closing any descriptor of it drops every POSIX lock
    this process holds on it, those of its other SQLite connections too, and two writers
    then corrupt the file. Only a new file is created here (O_EXCL: nobody has it open)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        pass
    for p in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        try:
            if os.stat(p).st_mode & 0o077:
                os.chmod(p, 0o600)
        except FileNotFoundError:
            pass


class Ledger:
    def __init__(self, conn: sqlite3.Connection, clock: Callable[[], float] = time.time, strict: bool | None = None):
        self.conn = conn
        self._db: "sqlite_utils.Database | None" = None
        self.clock = clock
        self.strict = os.environ.get(envvars.STRICT_TRANSITIONS) == "1" if strict is None else strict
        self.shared, self.where = False, "memory"  # on a filesystem other hosts see (``ledger_shared``)
        self._savepoints = 0

    # ------------------------------------------------------------ opening

    @classmethod
    def open(cls, path: str | os.PathLike, clock: Callable[[], float] = time.time) -> "Ledger":
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            _private(path)
            conn = sqlite3.connect(str(path), timeout=30.0, check_same_thread=False)
        except (OSError, sqlite3.Error) as exc:
            raise UserError(f"cannot open the ledger at '{path}': {exc}; set ORCHESTRATE_HOME to a writable folder") from None
        shared, where = ledger_shared(path.parent)
        conn.execute("PRAGMA busy_timeout = 30000")
        conn.execute("PRAGMA foreign_keys = ON")
        try:
            if shared:
                # WAL needs shared memory between the processes that open the database: never
                # across hosts. A rollback journal works with the filesystem's byte-range locks,
                # and the watcher's lease keeps the writers to one (readers do not refresh)
                conn.execute("PRAGMA journal_mode = DELETE")
                conn.execute("PRAGMA synchronous = FULL")
            elif conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                conn.execute("PRAGMA journal_mode = WAL")  # readers never block the writer
        except sqlite3.OperationalError as exc:  # the other mode, held by a process that has it open
            conn.close()
            mode = "a rollback journal (shared filesystem)" if shared else "WAL (one host)"
            raise UserError(f"cannot open the ledger at '{path}' in {mode} ({where}): {exc}; another process has it open "
                            f"in the other mode: stop it, or set {envvars.LEDGER_FS} alike for every process") from None
        ledger = cls(conn, clock)
        if pending(conn):
            migrate(ledger.db)
        ledger.shared, ledger.where = shared, where
        return ledger

    @classmethod
    def memory(cls, clock: Callable[[], float] = time.time, strict: bool | None = None) -> "Ledger":
        ledger = cls(sqlite3.connect(":memory:"), clock, strict)
        migrate(ledger.db)
        return ledger

    @property
    def db(self) -> "sqlite_utils.Database":
        """sqlite-utils over the same connection, made on first use (schema and writes): its
        import is a fifth of a read command's start-up, and every read is plain SQL."""
        if self._db is None:
            from orchestrator.ledger.sqlite_utils_lean import sqlite_utils

            self._db = sqlite_utils.Database(self.conn)
        return self._db

    def close(self) -> None:
        self.conn.close()

    @contextlib.contextmanager
    def tx(self) -> Iterator[None]:
        """A write transaction that takes the lock up front (no upgrade deadlocks)."""
        conn = self.conn
        if conn.in_transaction:
            yield
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def _select(self, table: str, where: str | None, args: list, order_by: str | None = None) -> list[dict]:
        """Rows as dicts, by plain SQL (sqlite-utils' rows_where and get read the table's
        schema on every call: most of a watcher cycle's time at a thousand tasks). The
        table, the condition and the order are ours, never a file's."""
        sql = f'select * from "{table}"' + (f" where {where}" if where else "") + (f" order by {order_by}" if order_by else "")
        cur = self.conn.execute(sql, args)
        names = [d[0] for d in cur.description]
        return [dict(zip(names, row)) for row in cur.fetchall()]

    def _get(self, table: str, where: str, args: list) -> dict:
        rows = self._select(table, where, args)
        if not rows:
            from orchestrator.ledger.sqlite_utils_lean import sqlite_utils

            raise sqlite_utils.db.NotFoundError(f"{table}: no row where {where} {args}")
        return rows[0]

    @contextlib.contextmanager
    def savepoint(self) -> Iterator[None]:
        """Inside a transaction: a part that is undone alone when it raises (one task's
        refresh in a cycle's transaction), the rest kept."""
        conn = self.conn
        if not conn.in_transaction:
            with self.tx():
                yield
            return
        self._savepoints += 1
        name = f"sp{self._savepoints}"
        conn.execute(f"SAVEPOINT {name}")
        try:
            yield
        except BaseException:
            conn.execute(f"ROLLBACK TO {name}")
            conn.execute(f"RELEASE {name}")
            raise
        conn.execute(f"RELEASE {name}")

    # ------------------------------------------------------------ events

    def event(
        self,
        experiment_id: str,
        kind: str,
        cause: str,
        *,
        idx: int | None = None,
        attempt: int | None = None,
        old: str | None = None,
        new: str | None = None,
        data: dict | None = None,
    ) -> None:
        """``data``: a trainer event's numbers (``records.EVENT_NUMBERS``), kept as JSON."""
        cols, row = "time, experiment_id, idx, attempt, kind, old_state, new_state, cause", [self.clock(), experiment_id, idx, attempt, kind, old, new, cause]
        if data is not None:
            cols, row = cols + ", data", row + [json.dumps(data, allow_nan=False)]
        with self.tx():  # plain SQL: the most frequent write after the ingest's
            self.conn.execute(f"insert into events ({cols}) values ({', '.join('?' * len(row))})", row)

    def has_event_of_kind(self, experiment_id: str, kind: str) -> bool:
        return self.conn.execute("select 1 from events where experiment_id = ? and kind = ? limit 1", [experiment_id, kind]).fetchone() is not None

    def has_event(self, experiment_id: str, kind: str, cause: str, *, idx: int | None = None) -> bool:
        """Whether this exact event was recorded already (events said once, not every refresh)."""
        row = self.conn.execute(
            "select 1 from events where experiment_id = ? and idx is ? and kind = ? and cause = ? limit 1",
            [experiment_id, idx, kind, cause],
        ).fetchone()
        return row is not None

    # ------------------------------------------------------------ experiments and tasks

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

    def tasks(self, exp_id: str) -> list[dict]:
        return self._select("tasks", "experiment_id = ?", [exp_id], order_by="idx")

    def tasks_where(self, where: str, args: list, order_by: str | None = None) -> list[dict]:
        """Tasks by a condition of ours (never a file's)."""
        return self._select("tasks", where, args, order_by=order_by)

    def set_goodput(self, exp_id: str, idx: int, goodput: float | None, at: float) -> None:
        """The task's goodput as added up ``at``; the row's updated_at stays (it tells when
        the task itself last changed, which is what makes the figure stale)."""
        with self.tx():
            self.conn.execute("update tasks set goodput = ?, goodput_at = ? where experiment_id = ? and idx = ?", [goodput, at, exp_id, idx])

    def task_events(self, exp_id: str, idx: int, kind: str) -> list[dict]:
        return self._select("events", "experiment_id = ? and idx = ? and kind = ?", [exp_id, idx, kind], order_by="id")

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

    def _illegal(self, exp_id: str, exc: TransitionError, cause: str, **where: Any) -> None:
        """A move the table forbids: a bug of ours (tests fail on it) or a stale observation."""
        if self.strict:
            raise exc
        log.warning("%s: %s (%s); not applied", exp_id, exc, cause)
        self.event(exp_id, "ledger.illegal_transition", f"{exc}; not applied (cause: {cause})", **where)

    def _roll_up(self, exp_id: str, cause: str) -> None:
        exp = self.experiment(exp_id)
        rows = self.conn.execute("select state from tasks where experiment_id = ?", [exp_id]).fetchall()
        new = states.experiment_state(TaskState(r[0]) for r in rows)
        if new.value != exp["state"]:
            self.conn.execute("update experiments set state = ?, updated_at = ? where id = ?", [new.value, self.clock(), exp_id])
            self.event(exp_id, "experiment.state", cause, old=exp["state"], new=new.value)

    # ------------------------------------------------------------ attempts

    def attempts(self, exp_id: str, idx: int | None = None) -> list[dict]:
        if idx is None:
            return self._select("attempts", "experiment_id = ?", [exp_id], order_by="idx, number")
        return self._select("attempts", "experiment_id = ? and idx = ?", [exp_id, idx], order_by="number")

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

    # ------------------------------------------------------------ heartbeats, metrics, cursors

    def _upsert_many(self, table: str, rows: list[dict], pk: tuple[str, ...]) -> None:
        """Insert or update rows with one prepared statement per set of columns: the ingest's
        hot path (sqlite-utils' upsert reads the table's schema on every call)."""
        groups: dict[tuple[str, ...], list[dict]] = {}
        for r in rows:
            groups.setdefault(tuple(r), []).append(r)
        for cols, group in groups.items():
            names = ", ".join(f'"{c}"' for c in cols)
            sets = ", ".join(f'"{c}" = excluded."{c}"' for c in cols if c not in pk)
            conflict = ", ".join(f'"{c}"' for c in pk)
            sql = (f'insert into "{table}" ({names}) values ({", ".join("?" * len(cols))}) '
                   f"on conflict ({conflict}) do " + (f"update set {sets}" if sets else "nothing"))
            with self.tx():  # no-op inside the caller's transaction
                self.conn.executemany(sql, [tuple(r[c] for c in cols) for r in group])

    def upsert_heartbeats(self, rows: list[dict]) -> None:
        self._upsert_many("heartbeats", rows, ("experiment_id", "idx", "rank"))

    def heartbeats(self, exp_id: str, idx: int) -> list[dict]:
        return self._select("heartbeats", "experiment_id = ? and idx = ?", [exp_id, idx], order_by="rank")

    def add_metrics(self, rows: list[dict]) -> None:
        self._upsert_many("metrics", rows, ("experiment_id", "idx", "step"))

    def metrics(self, exp_id: str, idx: int) -> list[dict]:
        return self._select("metrics", "experiment_id = ? and idx = ?", [exp_id, idx], order_by="step")

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

    # ------------------------------------------------------------ leases and recovery actions

    def acquire_lease(self, name: str, owner: str, ttl_s: float) -> bool:
        """Take or renew the lease ``name`` for ``owner``; False while another owner's is live."""
        now = self.clock()
        with self.tx():
            row = self.conn.execute("select owner, expires_at from leases where name = ?", [name]).fetchone()
            if row and row[0] != owner and row[1] > now:
                return False
            acquired = now if not row or row[0] != owner else None
            fields = {"name": name, "owner": owner, "expires_at": now + ttl_s}
            if acquired is not None:
                fields["acquired_at"] = acquired
            self._upsert_many("leases", [fields], ("name",))
            return True

    def release_lease(self, name: str, owner: str) -> None:
        with self.tx():
            self.conn.execute("delete from leases where name = ? and owner = ?", [name, owner])

    def release_leases(self, owner: str) -> None:
        with self.tx():
            self.conn.execute("delete from leases where owner = ?", [owner])

    def lease(self, name: str) -> dict | None:
        rows = self._select("leases", "name = ? and expires_at > ?", [name, self.clock()])
        return rows[0] if rows else None

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

    def events(self, exp_id: str) -> list[dict]:
        return self._select("events", "experiment_id = ?", [exp_id], order_by="id")

    def events_after(self, exp_id: str, after_id: int, limit: int) -> list[dict]:
        """The experiment's events past ``after_id``, oldest first, at most ``limit``."""
        return self._select("events", "experiment_id = ? and id > ?", [exp_id, after_id], order_by=f"id limit {int(limit)}")

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

    # ------------------------------------------------------------ notifications (the outbox of spec.notify)

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
