"""Instrumentation of the user's own program (``model.instrument``, on by default for
``kind: command`` and ``kind: script``): each rank starts with ``boot/`` first on its
PYTHONPATH, so that its interpreter (orchestrate's, or another virtual environment's)
imports the bootstrap ``boot/sitecustomize.py`` before the program; the bootstrap adds
orchestrate's callback to every Hugging Face ``Trainer`` the program builds (``hook``).
The program sees its own argv, ``__main__``, working folder and environment."""

from __future__ import annotations

import os
from pathlib import Path

BOOT_DIR = Path(__file__).resolve().parent / "boot"
SAVED_PYTHONPATH = "ORCHESTRATE_INSTRUMENT_PYTHONPATH"  # the bootstrap puts it back


def with_bootstrap(env: dict) -> dict:
    """``env`` for a rank whose interpreter imports the bootstrap first."""
    own = env.get("PYTHONPATH")
    return {**env, SAVED_PYTHONPATH: "-" if own is None else own,
            "PYTHONPATH": str(BOOT_DIR) if not own else str(BOOT_DIR) + os.pathsep + own}
