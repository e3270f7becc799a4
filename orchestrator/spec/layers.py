"""Site and user defaults under the spec (pure): which keys a defaults file may set,
checking one, laying the layers over each other, and where each value came from.

Order, lowest first: built-in defaults < site file < user file < spec file < `--set`.
Mappings merge key by key; a list or a scalar (null included) replaces what is under
it, so a spec can drop a site's partition with `partition: null`. Reading the files is
``defaults``' job; the validation of the layered result is ``load``'s.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from orchestrator.errors import SpecIssue
from orchestrator.spec import shown, yamlsrc
from orchestrator.spec.experiment import Spec
from orchestrator.spec.issues import issues_of
from orchestrator.spec.policies import Heartbeat, Retry
from orchestrator.spec.sections import Resources

Path_ = yamlsrc.Path_

# What a site (or a user for all their experiments) decides, not what one experiment
# does: where jobs go, how nodes are set up, how failures are handled. None: any key
# (`env` holds variable names). A `resources.container`, where the spec has one, too.
ALLOWED: dict[str, tuple[str, ...] | None] = {
    "resources": tuple(
        k
        for k in ("partition", "account", "qos", "constraint", "gpu_memory", "setup_templates", "setup",
                  "srun_args", "sbatch_extra", "share_with_group", "container")
        if k in Resources.model_fields
    ),
    "checkpoint": ("signal", "signal_before_s", "direct_io"),  # direct_io: the filesystem's
    "heartbeat": tuple(Heartbeat.model_fields),
    "retry": tuple(Retry.model_fields),
    "env": None,
}


@dataclass(frozen=True)
class Layer:
    """One defaults file, read: its mapping and the line of each of its paths."""

    layer: str  # "site" or "user"
    file: str  # as shown in messages
    data: dict
    lines: dict
    sha256: str = ""  # of the text read: the file may change after a submission

    def describe(self) -> dict:
        return {"layer": self.layer, "file": self.file, "sha256": self.sha256}


def check(layer: Layer) -> list[SpecIssue]:
    """Every problem of one defaults file: keys it may not set, then values the spec's
    own fields refuse (same types, bounds and checks), each at its line."""
    issues = _key_issues(layer)
    allowed = {
        section: {k: v for k, v in value.items() if ALLOWED[section] is None or k in ALLOWED[section]}
        if isinstance(value, dict) else value
        for section, value in layer.data.items()
        if section in ALLOWED
    }
    # A layer is a partial spec: give it the required fields, and leave the checks across
    # sections (which fail at the root, with no field path) to the layered spec.
    try:
        Spec.model_validate({**allowed, "name": "defaults", "steps": 1})
    except ValidationError as exc:
        errors = [e for e in exc.errors() if e["loc"]]
        issues += issues_of(errors, allowed, layer.lines, layer.file)
    return issues


def _key_issues(layer: Layer) -> list[SpecIssue]:
    def refuse(path: Path_) -> SpecIssue:
        if len(path) == 1:
            allowed = f"it may set {', '.join(ALLOWED)}"
        else:
            allowed = f"under {path[0]} it may set {', '.join(ALLOWED[path[0]])}"
        return SpecIssue(shown.dotted(path), yamlsrc.line_of(layer.lines, path),
                         f"'{shown.dotted(path)}' is not allowed in a defaults file; {allowed}",
                         layer.file)

    issues = []
    for section, value in layer.data.items():
        if section not in ALLOWED:
            issues.append(refuse((section,)))
        elif isinstance(value, dict) and ALLOWED[section] is not None:
            issues.extend(refuse((section, k)) for k in value if k not in ALLOWED[section])
    return issues


def layered(layers: list[Layer], spec: dict) -> tuple[dict, dict[Path_, yamlsrc.Origin]]:
    """The spec's mapping laid over the layers (lowest first), and the origin of each
    path whose value a layer gave and nothing above it replaced. The inputs stay as
    they were."""
    merged: dict = {}
    owner: dict[Path_, int] = {}  # path -> the layer whose key it is (len(layers): the spec)
    for i, data in enumerate([layer.data for layer in layers] + [spec]):
        _merge_into(merged, data, (), i, owner)
    origins = {}
    for i, layer in enumerate(layers):
        for path, line in layer.lines.items():
            if path and _owner_of(owner, path) == i:
                origins[path] = yamlsrc.Origin(layer.layer, layer.file, line)
    return merged, origins


def _merge_into(out: dict, data: dict, path: Path_, i: int, owner: dict[Path_, int]) -> None:
    for key, value in data.items():
        here = path + (key,)
        if not (isinstance(value, dict) and isinstance(out.get(key), dict)):
            # replaced: nothing below it is a lower layer's any more
            for p in [p for p in owner if p[: len(here)] == here]:
                del owner[p]
            out[key] = {} if isinstance(value, dict) else copy.deepcopy(value)
        if isinstance(value, dict):  # key by key, so that each key has its owner
            _merge_into(out[key], value, here, i, owner)
        owner[here] = i


def _owner_of(owner: dict[Path_, int], path: Path_) -> int | None:
    while path:
        if path in owner:
            return owner[path]
        path = path[:-1]
    return None


def explain(raw: dict, lines: dict, spec_file: str) -> list[dict]:
    """Every value that is not a built-in default, with where it came from: `--set`, a
    defaults file or the spec file, and the line. Mappings are opened to their values;
    a list is one value (it replaces as a whole)."""
    rows: list[dict] = []

    def walk(value: Any, path: Path_) -> None:
        if isinstance(value, dict) and value:
            for key, sub in value.items():
                walk(sub, path + (key,))
            return
        item = yamlsrc.override_of(lines, path)
        origin = yamlsrc.default_of(lines, path)
        if item is not None:
            layer, file, line = "--set", f"--set {item}", None
        elif origin is not None:
            layer, file, line = origin
        else:
            layer, file, line = "spec", spec_file, yamlsrc.line_of(lines, path)
        rows.append({"field": shown.dotted(path), "value": json_value(value), "layer": layer, "file": file, "line": line})

    order = list(Spec.model_fields)  # the reference's order, not the first layer's
    for key in sorted(raw, key=lambda k: order.index(k) if k in order else len(order)):
        walk(raw[key], (key,))
    return rows


def json_value(value: Any) -> Any:
    """``value`` as JSON can hold it (a YAML date becomes its text)."""
    return json.loads(json.dumps(value, default=str))
