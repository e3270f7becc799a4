"""YAML loading that remembers where each value came from.

Validation errors must name the line of the field they are about, so the loader
returns the data together with a map from field path (a tuple of keys and list
indexes) to its 1-based line.
"""

from __future__ import annotations

from typing import Any

import yaml

from orchestrator.errors import SpecError, SpecIssue

Path_ = tuple[Any, ...]


def load_with_lines(text: str, source: str) -> tuple[Any, dict[Path_, int]]:
    """Parse ``text``; raise SpecError for malformed YAML or duplicate keys."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, {}
        data = loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        msg = " ".join(p for p in (exc.context, exc.problem) if p)
        raise SpecError([SpecIssue("", line, f"malformed YAML: {msg}", source)]) from None
    except yaml.YAMLError as exc:
        raise SpecError([SpecIssue("", None, f"malformed YAML: {exc}", source)]) from None
    finally:
        loader.dispose()
    lines: dict[Path_, int] = {(): node.start_mark.line + 1}
    issues: list[SpecIssue] = []
    _walk(node, (), lines, issues, source)
    if issues:
        raise SpecError(issues)
    return data, lines


def _walk(node: yaml.Node, path: Path_, lines: dict, issues: list, source: str) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for knode, vnode in node.value:
            key = knode.value if isinstance(knode, yaml.ScalarNode) else repr(knode.value)
            line = knode.start_mark.line + 1
            if key in seen:
                issues.append(
                    SpecIssue(
                        dotted(path + (key,)),
                        line,
                        f"duplicate key '{key}' (first on line {seen[key]}); keep one",
                        source,
                    )
                )
            seen[key] = line
            lines[path + (key,)] = line
            _walk(vnode, path + (key,), lines, issues, source)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[path + (i,)] = item.start_mark.line + 1
            _walk(item, path + (i,), lines, issues, source)


def line_of(lines: dict[Path_, int], path: Path_) -> int | None:
    """Line of ``path``, or of its nearest ancestor present in the file."""
    path = tuple(path)
    while path:
        if path in lines:
            return lines[path]
        path = path[:-1]
    return lines.get(())


def dotted(path: Path_) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out
