"""The SQLite ledger (sqlite-utils): schema migrations and the store."""

from orchestrator.ledger.store import Ledger, filesystem_type

__all__ = ["Ledger", "filesystem_type"]
