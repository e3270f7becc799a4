"""The ledger's leases: which watcher acts for an experiment (``watch:<id>``), or for
every live one (``watch:*``); an owner's lease lives until its expiry unless renewed."""

from __future__ import annotations

from orchestrator.ledger.core import LedgerCore


class Leases(LedgerCore):
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
