"""The SQLite ledger (sqlite-utils): schema migrations and the store."""

from orchestrator.ledger.dbfile import filesystem_type, storage_trouble
from orchestrator.ledger.store import Ledger

__all__ = ["Ledger", "filesystem_type", "storage_trouble"]
