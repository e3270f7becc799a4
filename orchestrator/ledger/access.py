"""Where the ledger lives and how commands find experiments in it."""

from __future__ import annotations

import os
from pathlib import Path

from orchestrator.contract import envvars
from orchestrator.errors import UserError
from orchestrator.ledger.store import Ledger


def home_dir(override: str | None = None) -> Path:
    """The per-user folder of the ledger: --home, else $ORCHESTRATE_HOME, else ~/.orchestrate."""
    return Path(override or os.environ.get(envvars.HOME) or Path.home() / ".orchestrate").expanduser()


def open_ledger(home: Path) -> Ledger:
    return Ledger.open(home / "ledger.db")


def resolve_experiment(ledger: Ledger, ref: str | None) -> list[dict]:
    exps = ledger.find_experiments(ref)
    if ref and not exps:
        known = ", ".join(sorted({e["name"] for e in ledger.find_experiments()})[:10]) or "none yet"
        raise UserError(f"no experiment with id or name '{ref}' (known names: {known}); see `orchestrate status`")
    return exps
