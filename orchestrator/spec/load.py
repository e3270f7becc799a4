"""Loading a spec file: read the YAML (keeping line numbers), apply `--set` overrides,
validate into a `Spec` with every problem reported at once; and the resolved dump.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from orchestrator.errors import SpecError, SpecIssue, UserError
from orchestrator.spec import shown, yamlsrc
from orchestrator.spec.experiment import Spec
from orchestrator.spec.issues import issues_from
from orchestrator.spec.layers import Layer, layered


def load_spec(path: str | Path, overrides: list[str] = (), defaults: Sequence[Layer] = ()) -> tuple["Spec", dict[str, Any], dict]:
    """Read a spec file, lay it over the ``defaults`` files' layers (read by
    ``defaults.read_layers``, lowest first), apply the overrides and validate.

    Returns the validated Spec, the raw mapping (layered, after overrides) and the line
    map (which also records the overrides and what each defaults file gave). Raises
    SpecError listing every problem.
    """
    path = Path(path)
    source = str(path)
    text = read_text(path)
    raw, lines = yamlsrc.load_with_lines(text, source)
    if raw is None:
        raise SpecError([SpecIssue("", 1, "the spec is empty; at least `name` and `steps` are required", source)])
    if not isinstance(raw, dict):
        raise SpecError([SpecIssue("", 1, f"the spec must be a mapping of fields, not a {type(raw).__name__}", source)])
    if defaults:
        raw, lines.defaults = layered(defaults, raw)
    apply_overrides(raw, overrides, lines)
    spec = validate(raw, lines, source)
    return spec, raw, lines


def read_text(path: Path, what: str = "spec file") -> str:
    """The spec file's (or a defaults file's) text, read no further than the size bound
    (a device or a huge file is refused, not read to the end)."""
    try:
        with open(path, "rb") as f:
            data = f.read(yamlsrc.MAX_BYTES + 1)
    except FileNotFoundError:
        raise UserError(f"{what} '{path}' does not exist") from None
    except OSError as exc:
        raise UserError(f"cannot read {what} '{path}': {exc}") from None
    if len(data) > yamlsrc.MAX_BYTES:
        raise SpecError([SpecIssue("", None, f"the file is larger than {yamlsrc.MAX_BYTES} bytes (1 MiB); a spec is a "
                                   "short hand-written file: put data in files it names", str(path))])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise SpecError([SpecIssue("", line, f"not UTF-8 text (byte 0x{data[exc.start]:02x}); save the file as UTF-8",
                                   str(path))]) from None


def apply_overrides(raw: dict, overrides: list[str], lines: dict | None = None) -> dict[tuple, str]:
    """Apply `key.path=value` overrides in place (values parsed as YAML, within the
    loader's bounds); returns their paths, each with its item, also recorded in
    ``lines.overrides`` so that errors about them name `--set`. Raises SpecError naming
    every bad item."""
    done: dict[tuple, str] = {}
    issues: list[SpecIssue] = []
    for item in overrides:
        try:
            path, value = parse_override(item)
            for earlier, other in done.items():
                if earlier != path and (earlier[: len(path)] == path or path[: len(earlier)] == earlier):
                    raise ValueError(f"conflicts with --set {shown.shown_item(other)}: one sets a field inside the "
                                     "other; give one of them")
            set_path(raw, path, value)
        except ValueError as exc:
            issues.append(SpecIssue(_key_of(item), None, f"{exc} (in --set {shown.shown_item(item)})", "--set"))
            continue
        done[path] = item
        if lines is not None:
            for p in [p for p in lines if p[: len(path)] == path]:
                del lines[p]  # what the file had there is gone
    if issues:
        raise SpecError(issues)
    if lines is not None and hasattr(lines, "overrides"):
        lines.overrides.update(done)
    return done


def parse_override(item: str) -> tuple[tuple, Any]:
    """(path, value) of one `key.path=value` item; ValueError says what is wrong with it."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ValueError("not of the form key.path=value")
    if not key.isprintable():
        raise ValueError("the field path has a control or non-printable character; use names joined by dots")
    path = tuple(part.strip() for part in key.strip().split("."))
    if not all(path):
        raise ValueError(f"{shown.shorten(key.strip())} has an empty field name; use dots only between names")
    if len(path) >= yamlsrc.MAX_DEPTH:
        raise ValueError(f"{len(path)} levels of fields; at most {yamlsrc.MAX_DEPTH - 1}")
    if not value.strip():
        return path, ""
    try:
        return path, yamlsrc.parse_value(value, yamlsrc.MAX_DEPTH - len(path))
    except yaml.YAMLError as exc:
        raise ValueError(f"value refused: {exc.problem}") from None


def _key_of(item: str) -> str:
    """The field an item names, for its issue (cut: the item may be anything)."""
    key = item.partition("=")[0].strip()
    if "://" in key:  # `notify.webhook:https://...`: a URL, maybe a secret one, is no field's name
        return ""
    return key if len(key) <= 80 and key.isprintable() else ""


def set_path(raw: dict, path: tuple, value: Any) -> None:
    """Set ``raw[path[0]][path[1]]... = value``, making missing (or null) mappings on the way.

    Raises ValueError where the path runs through a value that is not a mapping (a list,
    a number): replacing it silently would lose what the spec said there."""
    problem = path_conflict(raw, path)
    if problem:
        raise ValueError(problem)
    cur = raw
    for part in path[:-1]:
        if cur.get(part) is None:
            cur[part] = {}
        cur = cur[part]
    cur[path[-1]] = value


def path_conflict(raw: dict, path: tuple) -> str | None:
    """Why ``path`` cannot be set in ``raw`` (it runs through a value that is not a
    mapping), or None."""
    cur = raw
    for i, part in enumerate(path[:-1]):
        nxt = cur.get(part)
        if nxt is None:
            return None  # made on the way
        if not isinstance(nxt, dict):
            at = shown.dotted(path[: i + 1])
            what = "a list (fields inside a list cannot be set one by one)" if isinstance(nxt, list) else shown.shorten(nxt)
            return f"'{at}' is {what}, not a mapping, so '{shown.dotted(path)}' cannot be set inside it; set '{at}' as a whole"
        cur = nxt
    return None


def validate(raw: dict, lines: dict, source: str, set_paths=None) -> Spec:
    try:
        return Spec.model_validate(raw)
    except ValidationError as exc:
        raise SpecError(issues_from(exc, raw, lines, source, set_paths)) from None


def dump_resolved(spec: Spec) -> str:
    """The spec with every default filled in, as YAML (saved next to the run)."""
    return yamlsrc.dump(spec.model_dump(mode="json"))
