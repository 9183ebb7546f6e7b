"""The SQLite ledger backend (the embedded default): see ledger.py for the picture."""

from proxy.ledger.sqlite.ledger import SQLiteLedger

__all__ = ["SQLiteLedger"]
