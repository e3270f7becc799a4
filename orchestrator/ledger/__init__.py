"""The SQLite ledger (sqlite-utils): schema migrations and the store."""

from .store import Ledger, filesystem_type

__all__ = ["Ledger", "filesystem_type"]
