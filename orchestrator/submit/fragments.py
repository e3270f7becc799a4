"""Shell fragments for the batch script, kept as files in ``templates/sbatch``.

``common.sh`` is always included; the spec names any others
(``resources.setup_templates``). ``{{key}}`` placeholders are filled in from the
plan; everything else is left to the shell.
"""

from __future__ import annotations

import importlib.resources
import os
import re
from pathlib import Path

from orchestrator.contract import envvars
from orchestrator.errors import UserError

COMMON = "common"
_PLACEHOLDER = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def templates_dir() -> Path:
    """$ORCHESTRATE_TEMPLATES, else the installed package's templates.

    The top-level ``templates/`` folder is installed as the package
    ``orchestrator.templates`` (pyproject.toml); running from a checkout that was never
    installed, it is that folder."""
    if env := os.environ.get(envvars.TEMPLATES):
        return Path(env)
    try:
        return Path(str(importlib.resources.files("orchestrator.templates")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "templates"


def available() -> list[str]:
    """Names of the optional fragments (``common`` is always used, never named)."""
    d = templates_dir() / "sbatch"
    return sorted(p.stem for p in d.glob("*.sh") if p.stem != COMMON) if d.is_dir() else []


def render(name: str, values: dict[str, str]) -> list[str]:
    path = templates_dir() / "sbatch" / f"{name}.sh"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        raise UserError(f"setup template '{name}' not found ({path}); available: {', '.join(available()) or 'none'}") from None

    def fill(m: re.Match) -> str:
        key = m.group(1)
        if key not in values:
            raise UserError(f"{path}: unknown placeholder {{{{{key}}}}}; known: {', '.join(sorted(values))}")
        return values[key]

    return [f"# --- {name}.sh"] + _PLACEHOLDER.sub(fill, text).rstrip("\n").splitlines()
