from __future__ import annotations

from typing import Any


class LedgerRouter:
    """Reads of LedgerEntry go to "default" (a replica, say), writes to "other"."""

    def db_for_read(self, model: Any, **hints: Any) -> str | None:
        return "default" if model._meta.model_name == "ledgerentry" else None

    def db_for_write(self, model: Any, **hints: Any) -> str | None:
        return "other" if model._meta.model_name == "ledgerentry" else None

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        return None
