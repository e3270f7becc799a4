"""Pydantic validation errors turned into spec issues that point at the user's text:
the path in the data (not pydantic's location), the YAML line or `--set`, a plain message.
"""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from orchestrator.errors import SpecIssue
from orchestrator.spec import shown, yamlsrc
from orchestrator.spec.experiment import Spec
from orchestrator.spec.strict import FieldError, models_in


# values an error never repeats: whoever reads them can use them (a webhook URL posts to its channel)
SECRET_PATHS = shown.SECRET_PATHS


def issues_from(exc: ValidationError, raw: Any, lines: dict, source: str, set_paths=None) -> list[SpecIssue]:
    """One issue per pydantic error; ``set_paths`` (path -> `--set` item) defaults to the
    overrides the line map records."""
    return issues_of(exc.errors(), raw, lines, source, set_paths)


def issues_of(errors: list[dict], raw: Any, lines: dict, source: str, set_paths=None) -> list[SpecIssue]:
    """``issues_from`` for some of a ValidationError's errors."""
    if set_paths:
        lines = _with_overrides(lines, set_paths)
    issues = []
    for err in errors:
        path = data_path(raw, err["loc"])
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        cause = err.get("ctx", {}).get("error")
        if isinstance(cause, FieldError):
            path = _in_data(raw, err["loc"]) + cause.path
            msg = str(cause)
        if err["type"] == "extra_forbidden":
            valid = valid_keys(raw, path[:-1])
            msg = f"unknown key '{path[-1]}'" + (f"; valid keys: {', '.join(valid)}" if valid else "")
        elif err["type"] == "missing":
            msg = "required field is missing"
        elif err["type"] == "union_tag_invalid":
            path = path + ("kind",)
            ctx = err.get("ctx", {})
            msg = f"unknown kind {ctx.get('tag')!r}; valid kinds: {ctx.get('expected_tags')}"
        if err["type"] not in ("missing", "extra_forbidden", "union_tag_invalid") and "input" in err and not isinstance(err["input"], (dict, list)) \
                and not shown.is_secret(path):
            got = shown.shorten(err["input"])
            if not (isinstance(err["input"], str) and got[:20] in msg):  # a message quoting the text says it
                msg += f" (got {got})"
        issues.append(yamlsrc.issue(lines, path, msg, source))
    return issues


def _with_overrides(lines: dict, set_paths) -> yamlsrc.LineMap:
    out = yamlsrc.LineMap(lines)
    out.overrides.update(getattr(lines, "overrides", {}))
    out.defaults.update(getattr(lines, "defaults", {}))
    for p in set_paths:
        out.overrides.setdefault(tuple(p), set_paths[p] if isinstance(set_paths, dict) else shown.dotted(p))
    return out


def data_path(raw: Any, loc: tuple) -> tuple:
    """Turn a pydantic error location into a path in the data, dropping union tags."""
    out, cur, tagged = [], raw, None
    for i, part in enumerate(loc):
        last = i == len(loc) - 1
        if i and isinstance(cur, dict) and part == cur.get("kind") and part in _TAGS and tagged is not cur:
            tagged = cur  # the union tag after its field: `model.script` is field `script` of kind `script`
        elif isinstance(cur, dict) and part in cur:
            out.append(part)
            cur = cur[part]
        elif isinstance(cur, (list, tuple)) and isinstance(part, int) and part < len(cur):
            out.append(part)
            cur = cur[part]
        elif last or not isinstance(cur, dict):
            out.append(part)
            cur = None
        # else: a union tag that pydantic puts in the location; it is not in the data
    return tuple(out)


def _kinds(model: type[BaseModel], seen: set) -> set[str]:
    """The `kind` tags of every union variant under ``model``."""
    out: set[str] = set()
    for field in model.model_fields.values():
        for sub in models_in(field.annotation):
            if sub not in seen:
                seen.add(sub)
                kind = sub.model_fields.get("kind")
                if kind is not None:
                    out.update(a for a in typing.get_args(kind.annotation) if isinstance(a, str))
                out |= _kinds(sub, seen)
    return out


_TAGS = _kinds(Spec, set())


def _in_data(raw: Any, loc: tuple) -> tuple:
    """The part of a location that is in the data (a model validator's location ends
    with the union tag of its model, which is not)."""
    out, cur = [], raw
    for part in loc:
        if isinstance(cur, dict) and part in cur:
            out.append(part)
            cur = cur[part]
    return tuple(out)


def valid_keys(raw: Any, path: tuple) -> list[str]:
    """Field names of the model found at ``path`` (following `kind` in the data)."""
    model: type[BaseModel] | None = Spec
    cur = raw
    for part in path:
        if model is None or isinstance(part, int):
            return []
        field = model.model_fields.get(part)
        if field is None:
            return []
        cur = cur.get(part) if isinstance(cur, dict) else None
        model = _model_of(field.annotation, cur)
    return sorted(model.model_fields) if model is not None else []


def _model_of(annotation: Any, value: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    args = typing.get_args(annotation)
    candidates = []
    for arg in args:
        m = _model_of(arg, value)
        if m is not None:
            candidates.append(m)
    if not candidates:
        return None
    kind = value.get("kind") if isinstance(value, dict) else None
    for m in candidates:
        field = m.model_fields.get("kind")
        if field is None:
            continue
        if kind is None and isinstance(field.default, str):
            return m  # the variant used when `kind` is left out
        if kind in typing.get_args(field.annotation):
            return m
    return candidates[0]
