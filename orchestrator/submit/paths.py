"""Paths a spec names, made absolute on the login node (the compute nodes need them so)."""

from __future__ import annotations

from pathlib import Path


def local_path(here: Path, text: str) -> Path:
    """``text`` as an absolute path, relative ones from ``here``; `~user` of an unknown
    user stays as written (then it is no file), not a traceback."""
    path = Path(text)
    try:
        path = path.expanduser()
    except RuntimeError:
        pass
    return (here / path).resolve()
