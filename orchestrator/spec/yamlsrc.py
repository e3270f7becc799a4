"""YAML loading that remembers where each value came from, within bounds.

Validation errors must name the line of the field they are about, so the loader
returns the data together with a map from field path (a tuple of keys and list
indexes) to its 1-based line. The map also records the `--set` items applied on top,
so that an error about a value one of them wrote names `--set`, not a line of the file.

A spec is a short hand-written file: text far beyond that is a mistake or an attack
(an alias bomb, thousands of nested brackets), refused with an error naming the line
before it costs time, memory or a traceback. The same bounds hold for `--set` values.
Numbers follow YAML 1.2 where YAML 1.1 surprises: `1e-3` is a float (not a string) and
`1:30:00` stays a string (not the base-60 integer 5400, which a time limit is not).
A plain mapping key that YAML 1.1 reads as a boolean (`on`, `yes`) stays the text it is:
no spec key is a boolean, and `notify.on` is a key.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.events import AliasEvent
from yaml.resolver import Resolver

from orchestrator.errors import SpecError, SpecIssue
from orchestrator.spec.shown import dotted, shown_item

Path_ = tuple[Any, ...]

MAX_BYTES = 1 << 20  # of a spec file (or one --set value); a real spec is a few KiB
MAX_DEPTH = 32  # nested mappings and lists; the deepest real spec has about 5 levels
MAX_NODES = 100_000  # values once aliases are expanded; bounds alias bombs and huge lists
MAX_INT_DIGITS = 30  # of an integer literal; no setting needs more (Python refuses > 4300)

# Neither YAML nor a file name, shell line or SLURM option has a use for these
# (YAML 1.1's printable set: tab, line breaks, NEL and the printable planes).
_NOT_PRINTABLE = re.compile("[^\x09\x0a\x0d\x20-\x7e\x85\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


class Refused(yaml.MarkedYAMLError):
    """Text the loader refuses though it is well-formed YAML: past a bound, or of a
    kind a spec has no use for. Unlike a syntax error, a `--set` value never falls back
    to a plain string on it."""


class _Resolver(Resolver):
    """YAML 1.1's implicit types, with YAML 1.2's numbers (see the module docstring)."""


_NUMBERS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
_Resolver.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in pairs if tag not in _NUMBERS]
    for first, pairs in Resolver.yaml_implicit_resolvers.items()
}
_Resolver.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
            |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
            |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
            |[-+]?\.(?:inf|Inf|INF)
            |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)
_Resolver.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)
_RESOLVER = _Resolver()
_BOOL, _STR = "tag:yaml.org,2002:bool", "tag:yaml.org,2002:str"


class _Dumper(yaml.SafeDumper):
    """Quotes a string that either YAML 1.1 or this loader would read as something else
    (`'1e3'`, `'1:30:00'`), so that what it writes reads back the same everywhere."""

    def resolve(self, kind, value, implicit):
        tag = super().resolve(kind, value, implicit)
        if kind is yaml.ScalarNode and implicit[0] and tag == "tag:yaml.org,2002:str":
            tag = _RESOLVER.resolve(kind, value, implicit)
        return tag


def dump(data: Any) -> str:
    """``data`` as YAML that this loader (and any other) reads back as ``data``."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False)


class _Constructor(SafeConstructor):
    def construct_yaml_int(self, node):
        digits = len(node.value.lstrip("+-").replace("_", ""))
        if digits > MAX_INT_DIGITS:
            raise Refused(None, None, f"an integer of {digits} digits; at most {MAX_INT_DIGITS}", node.start_mark)
        return super().construct_yaml_int(node)

    def construct_yaml_binary(self, node):
        raise Refused(None, None, "binary data (!!binary) has no place in a spec", node.start_mark)


_Constructor.add_constructor("tag:yaml.org,2002:int", _Constructor.construct_yaml_int)
_Constructor.add_constructor("tag:yaml.org,2002:binary", _Constructor.construct_yaml_binary)


class _BoundedComposer(Composer):
    """PyYAML's composer counting depth and nodes (an alias counts as all it expands to).

    An alias of a node still being composed would make a cycle: refused."""

    def _bounds(self, max_depth: int) -> None:
        self._max_depth, self._depth, self._nodes, self._sizes = max_depth, 0, 0, {}

    def _count(self, n: int, mark) -> None:
        self._nodes += n
        if self._nodes > MAX_NODES:
            raise Refused(None, None, f"more than {MAX_NODES} values (aliases expanded); a spec is far smaller", mark)

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, AliasEvent):
            target = self.anchors.get(event.anchor)
            if target is not None:
                size = self._sizes.get(id(target))
                if size is None:
                    raise Refused(None, None, f"alias *{event.anchor} is inside its own anchor &{event.anchor}: "
                                  "a recursive structure", event.start_mark)
                self._count(size, event.start_mark)
            return super().compose_node(parent, index)
        if self._depth >= self._max_depth:
            raise Refused(None, None, f"nested more than {self._max_depth} levels deep", event.start_mark)
        self._depth += 1
        start = self._nodes
        self._count(1, event.start_mark)
        node = super().compose_node(parent, index)
        self._depth -= 1
        self._sizes[id(node)] = self._nodes - start
        return node

    def compose_mapping_node(self, anchor):
        node = super().compose_mapping_node(anchor)
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag == _BOOL and not key.style:  # plain: not quoted
                key.tag = _STR  # a key is a name: `on:` (notify.on) is not YAML 1.1's true
        return node


if getattr(yaml, "__with_libyaml__", False):  # libyaml's events; composing stays in Python, bounded
    from yaml._yaml import CParser as _Events

    class _Loader(_BoundedComposer, _Events, _Constructor, _Resolver):
        def __init__(self, text: str, max_depth: int):
            _Events.__init__(self, text)
            _BoundedComposer.__init__(self)
            _Constructor.__init__(self)
            _Resolver.__init__(self)
            self._bounds(max_depth)

else:  # pragma: no cover - PyYAML without libyaml
    from yaml.parser import Parser
    from yaml.reader import Reader
    from yaml.scanner import Scanner

    class _Loader(Reader, Scanner, Parser, _BoundedComposer, _Constructor, _Resolver):
        def __init__(self, text: str, max_depth: int):
            Reader.__init__(self, text)
            Scanner.__init__(self)
            Parser.__init__(self)
            _BoundedComposer.__init__(self)
            _Constructor.__init__(self)
            _Resolver.__init__(self)
            self._bounds(max_depth)


class Origin(NamedTuple):
    """Where a value the spec file did not give came from: a defaults file and its line."""

    layer: str  # "site" or "user"
    file: str
    line: int | None


class LineMap(dict):
    """Field path -> line in the file; ``overrides`` maps each `--set` path to its item,
    ``defaults`` each path a defaults file gave (and the spec did not) to its Origin."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.overrides: dict[Path_, str] = {}
        self.defaults: dict[Path_, Origin] = {}


def load_with_lines(text: str, source: str, max_depth: int = MAX_DEPTH) -> tuple[Any, LineMap]:
    """Parse ``text``; raise SpecError for malformed YAML, duplicate keys or text past a bound."""
    try:
        data, lines, issues = _parse(text, max_depth, source)
    except yaml.MarkedYAMLError as exc:
        raise SpecError([_issue_of(exc, source)]) from None
    except yaml.YAMLError as exc:
        raise SpecError([SpecIssue("", None, f"malformed YAML: {exc}", source)]) from None
    if issues:
        raise SpecError(issues)
    return data, lines


def parse_value(text: str, max_depth: int) -> Any:
    """A `--set` value: YAML within the bounds; text that is not YAML stays a string.

    Raises Refused for text past a bound, with a non-printable character or a duplicate key."""
    try:
        data, _, issues = _parse(text, max_depth, "--set")
    except Refused:
        raise
    except yaml.YAMLError:
        return text
    if issues:
        first = issues[0]
        raise Refused(None, None, (f"at {first.path}: " if first.path else "") + first.message, None)
    return data


def _parse(text: str, max_depth: int, source: str) -> tuple[Any, LineMap, list[SpecIssue]]:
    """(data, line map, issues); raises Refused or another yaml error."""
    if len(text) > MAX_BYTES:
        raise Refused(None, None, f"{len(text)} characters; at most {MAX_BYTES} (1 MiB): a spec is a short file", None)
    bad = _NOT_PRINTABLE.search(text)
    if bad:
        mark = yaml.Mark(source, bad.start(), text.count("\n", 0, bad.start()), 0, None, None)
        raise Refused(None, None, f"{_char(bad.group())} is not allowed; remove it", mark)
    loader = _Loader(text, max_depth)
    lines, issues = LineMap(), []
    try:
        node = loader.get_single_node()
        if node is None:
            return None, lines, issues
        lines[()] = node.start_mark.line + 1
        _walk(node, (), lines, issues, source)  # before construction, which merges `<<` keys into their mapping
        return _fresh(loader.construct_document(node)), lines, issues
    except RecursionError:  # a chain of merge keys (`<<: *a`) too long for PyYAML's recursion
        raise Refused(None, None, "aliases or merge keys nested too deeply", None) from None
    finally:
        loader.dispose()


def _fresh(value: Any) -> Any:
    """The data as a tree: an aliased mapping or list becomes a copy at each use, so that
    setting a value through one path (`--set`, a sweep) never changes another."""
    if isinstance(value, dict):
        return {k: _fresh(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_fresh(v) for v in value]
    return value


def _char(c: str) -> str:
    name = "a control character" if ord(c) < 0xA0 else "a surrogate" if 0xD800 <= ord(c) <= 0xDFFF else "a non-character"
    return f"character U+{ord(c):04X} ({name})"


def _issue_of(exc: yaml.MarkedYAMLError, source: str) -> SpecIssue:
    mark = exc.problem_mark or exc.context_mark
    line = mark.line + 1 if mark is not None else None
    context = exc.context
    if context and exc.context_mark is not None and exc.problem_mark is not None and exc.context_mark.line != exc.problem_mark.line:
        context += f" (line {exc.context_mark.line + 1}),"  # e.g. where the first of two anchors is
    msg = " ".join(p for p in (context, exc.problem) if p)
    return SpecIssue("", line, msg if isinstance(exc, Refused) else f"malformed YAML: {msg}", source)


def _walk(node: yaml.Node, path: Path_, lines: dict, issues: list, source: str) -> None:
    if isinstance(node, yaml.ScalarNode):
        bad = _NOT_PRINTABLE.search(node.value)  # written as an escape (`"\\x01"`); the text itself was checked
        if bad:
            issues.append(SpecIssue(dotted(path), node.start_mark.line + 1, f"{_char(bad.group())} is not allowed; remove it", source))
    elif isinstance(node, yaml.MappingNode):
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
            _walk(knode, path + (key,), {}, issues, source)
            _walk(vnode, path + (key,), lines, issues, source)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[path + (i,)] = item.start_mark.line + 1
            _walk(item, path + (i,), lines, issues, source)


def line_of(lines: dict[Path_, int], path: Path_) -> int | None:
    """Line of ``path``, or of its nearest ancestor present in the file; None where a
    `--set` item wrote it. (A defaults file's values: ``default_of``.)"""
    path = tuple(path)
    if override_of(lines, path) is not None:
        return None
    while path:
        if path in lines:
            return lines[path]
        path = path[:-1]
    return lines.get(())


def override_of(lines: dict, path: Path_) -> str | None:
    """The `--set` item that wrote ``path``: the one that set it, else the one that set its
    nearest ancestor, else one that created the mapping holding it (a mapping on the item's
    path the file does not have; of those, the one sharing most of ``path``)."""
    path = tuple(path)
    overrides = getattr(lines, "overrides", {})
    for n in range(len(path), 0, -1):
        if path[:n] in overrides:
            return overrides[path[:n]]
    defaults = getattr(lines, "defaults", {})
    best, most = None, 0
    for p, item in overrides.items():
        common = 0
        while common < min(len(p), len(path)) and p[common] == path[common]:
            common += 1
        if common > most and path[:common] not in lines and path[:common] not in defaults:
            best, most = item, common
    return best


def default_of(lines: dict, path: Path_) -> Origin | None:
    """The defaults file (and line) that gave ``path``'s value: the nearest of its
    ancestors that either the spec file or a defaults file has decides; None: the spec."""
    defaults = getattr(lines, "defaults", None)
    path = tuple(path)
    while defaults and path:
        if path in lines:
            return None
        if path in defaults:
            return defaults[path]
        path = path[:-1]
    return None


def issue(lines: dict, path: Path_, message: str, source: str, field: str | None = None) -> SpecIssue:
    """An issue about ``path``: at its line in ``source`` (or in the defaults file that
    gave the value), or on `--set` naming the item; shown as about ``field`` where that
    differs (a sweep task's field, found at its entry)."""
    field = dotted(path) if field is None else field
    item = override_of(lines, path)
    if item is not None:
        return SpecIssue(field, None, f"{message} (from --set {shown_item(item)})", "--set")
    origin = default_of(lines, path)
    if origin is not None:
        return SpecIssue(field, origin.line, f"{message} (a {origin.layer} default)", origin.file)
    return SpecIssue(field, line_of(lines, path), message, source)
