"""The connection owner every table group of the ledger builds on.

It opens the database, owns the one connection and its transactions, reads rows by
plain SQL (sqlite-utils, made on first use, is for the schema and the writes: a read
command never imports it), writes the event every state change comes with, in the
change's transaction, and guards the transition tables: an illegal move is never
applied; it raises in strict mode (the tests: ``$ORCHESTRATE_STRICT_TRANSITIONS=1``)
and is an event otherwise.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar

from orchestrator.contract import envvars
from orchestrator.ledger import dbfile
from orchestrator.ledger.migrations import migrate, pending
from orchestrator.states import TransitionError

if TYPE_CHECKING:
    import sqlite_utils

log = logging.getLogger(__name__)

_L = TypeVar("_L", bound="LedgerCore")  # open and memory return the composed Ledger


class LedgerCore:
    def __init__(self, conn: sqlite3.Connection, clock: Callable[[], float] = time.time, strict: bool | None = None):
        self.conn = conn
        self._db: "sqlite_utils.Database | None" = None
        self.clock = clock
        self.strict = os.environ.get(envvars.STRICT_TRANSITIONS) == "1" if strict is None else strict
        self.shared, self.where = False, "memory"  # on a filesystem other hosts see (``dbfile.ledger_shared``)
        self.path = ":memory:"  # the database file
        self._savepoints = 0

    # ------------------------------------------------------------ opening

    @classmethod
    def open(cls: type[_L], path: str | os.PathLike, clock: Callable[[], float] = time.time) -> _L:
        conn, shared, where = dbfile.connect(Path(path))
        ledger = cls(conn, clock)
        if pending(conn):
            migrate(ledger.db)
        ledger.shared, ledger.where, ledger.path = shared, where, str(path)
        return ledger

    @classmethod
    def memory(cls: type[_L], clock: Callable[[], float] = time.time, strict: bool | None = None) -> _L:
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

    # ------------------------------------------------------------ transactions

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

    # ------------------------------------------------------------ plain SQL

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

    # ------------------------------------------------------------ the event of every change, and the guard

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

    def _illegal(self, exp_id: str, exc: TransitionError, cause: str, **where: Any) -> None:
        """A move the table forbids: a bug of ours (tests fail on it) or a stale observation."""
        if self.strict:
            raise exc
        log.warning("%s: %s (%s); not applied", exp_id, exc, cause)
        self.event(exp_id, "ledger.illegal_transition", f"{exc}; not applied (cause: {cause})", **where)
