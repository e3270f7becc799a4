"""Shell fragments for the batch script, kept as files in ``templates/sbatch`` (found,
and named to the spec, by ``spec.templates``).

``common.sh`` is always included; the spec names any others
(``resources.setup_templates``). ``{{key}}`` placeholders are filled in from the
plan, each as one shell word (quoted with ``shlex.quote``), so a placeholder stands
where a word can: not inside quotes or a here-document, where the quoting would
show or, in a here-document, ``$(...)`` in a value would run. Everything else is
left to the shell.
"""

from __future__ import annotations

import re
import shlex

from orchestrator.errors import UserError
from orchestrator.spec import slurmtext
from orchestrator.spec.templates import fragment_names, templates_dir

_PLACEHOLDER = re.compile(r"\{\{\s*(\w+)\s*\}\}")
_HEREDOC = re.compile(r"(?<!<)<<-?(?!<)\s*(['\"]?)(\w+)\1")


def render(name: str, values: dict[str, str]) -> list[str]:
    """The fragment's lines, every placeholder replaced by its value as one shell word."""
    if not slurmtext.TEMPLATE_NAME.fullmatch(name):  # a file name in templates/sbatch, never a path
        known = ", ".join(fragment_names()) or "none"
        raise UserError(f"setup template name {slurmtext.shown(name)} is not a file name; available: {known}")
    path = templates_dir() / "sbatch" / f"{name}.sh"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        raise UserError(f"setup template '{name}' not found ({path}); available: {', '.join(fragment_names()) or 'none'}") from None
    _outside_heredocs(text, str(path))
    words = {key: shell_word(key, value) for key, value in values.items()}
    lines = text.rstrip("\n").splitlines()
    return [f"# --- {name}.sh"] + [_fill(line, words, f"{path}:{n}") for n, line in enumerate(lines, 1)]


def shell_word(key: str, value: str) -> str:
    """``value`` quoted as one shell word; a control character (a line break would end
    the line and start a command) is refused."""
    try:
        slurmtext.no_control(str(value))
    except ValueError as exc:
        raise UserError(f"cannot put {{{{{key}}}}} in the batch script: {exc}") from None
    return shlex.quote(str(value))


def _fill(line: str, words: dict[str, str], where: str) -> str:
    def fill(m: re.Match) -> str:
        key = m.group(1)
        if key not in words:
            raise UserError(f"{where}: unknown placeholder {{{{{key}}}}}; known: {', '.join(sorted(words))}")
        if quote := _open_quote(line, m.start()):
            raise UserError(
                f"{where}: {{{{{key}}}}} is inside {quote} quotes; placeholders are filled in as quoted shell "
                f"words, so put it outside them (e.g. echo \"run \"{{{{{key}}}}}\" started\")"
            )
        return words[key]

    return _PLACEHOLDER.sub(fill, line)


def _open_quote(line: str, pos: int) -> str | None:
    """The quote character open at ``pos`` of a shell line (bash's rules: no escapes in
    single quotes, backslash escapes elsewhere); None also in a comment, where a
    value (one line, no line breaks) is only text."""
    quote, i = None, 0
    while i < pos:
        ch = line[i]
        if quote == "'":
            quote = None if ch == "'" else quote
        elif ch == "\\":
            i += 1
        elif quote == '"':
            quote = None if ch == '"' else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return None
        i += 1
    return quote


def _outside_heredocs(text: str, where: str) -> None:
    """Refuse a placeholder in a here-document body, where the shell would not see it as a word."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _HEREDOC.search(lines[i])
        i += 1
        if not m:
            continue
        while i < len(lines) and lines[i].strip() != m.group(2):
            if _PLACEHOLDER.search(lines[i]):
                raise UserError(f"{where}:{i + 1}: placeholders cannot stand in a here-document; set a variable before it")
            i += 1
