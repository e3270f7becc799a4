"""Loading a spec file: read the YAML (keeping line numbers), apply `--set` overrides,
validate into a `Spec` with every problem reported at once; and the resolved dump.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from orchestrator.errors import SpecError, SpecIssue, UserError
from orchestrator.spec import yamlsrc
from orchestrator.spec.experiment import Spec
from orchestrator.spec.issues import issues_from


def load_spec(path: str | Path, overrides: list[str] = ()) -> tuple["Spec", dict[str, Any], dict]:
    """Read, override and validate a spec file.

    Returns the validated Spec, the raw mapping (after overrides) and the line map.
    Raises SpecError listing every problem.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"spec file '{path}' does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read spec file '{path}': {exc}") from None
    source = str(path)
    raw, lines = yamlsrc.load_with_lines(text, source)
    if raw is None:
        raise SpecError([SpecIssue("", 1, "the spec is empty; at least `name` and `steps` are required", source)])
    if not isinstance(raw, dict):
        raise SpecError([SpecIssue("", 1, f"the spec must be a mapping of fields, not a {type(raw).__name__}", source)])
    set_paths = apply_overrides(raw, overrides)
    spec = validate(raw, lines, source, set_paths)
    return spec, raw, lines


def apply_overrides(raw: dict, overrides: list[str]) -> set[tuple]:
    """Apply `key.path=value` overrides in place (values parsed as YAML); returns their paths."""
    done = set()
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SpecError([SpecIssue("", None, f"'{item}' is not of the form key.path=value", "--set")])
        path = tuple(key.strip().split("."))
        try:
            parsed = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError:
            parsed = value
        set_path(raw, path, parsed)
        done.add(path)
    return done


def set_path(raw: dict, path: tuple, value: Any) -> None:
    cur = raw
    for part in path[:-1]:
        nxt = cur.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            cur[part] = nxt
        cur = nxt
    cur[path[-1]] = value


def validate(raw: dict, lines: dict, source: str, set_paths: set = frozenset()) -> Spec:
    try:
        return Spec.model_validate(raw)
    except ValidationError as exc:
        raise SpecError(issues_from(exc, raw, lines, source, set_paths)) from None


def dump_resolved(spec: Spec) -> str:
    """The spec with every default filled in, as YAML (saved next to the run)."""
    return yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)
