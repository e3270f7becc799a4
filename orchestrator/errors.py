"""Errors meant for users: the CLI prints them without a traceback and exits non-zero."""

from __future__ import annotations

from dataclasses import dataclass


class UserError(Exception):
    """A problem the user can fix; the message says what and how."""

    exit_code = 2


@dataclass(frozen=True)
class SpecIssue:
    path: str  # dotted field path, "" for the whole document
    line: int | None  # 1-based line in the spec file, None when not from the file
    message: str
    source: str = ""  # file name, or "--set" for a command-line override

    def render(self) -> str:
        where = self.source or "<spec>"
        if self.line is not None:
            where = f"{where}:{self.line}"
        field = f" {self.path}:" if self.path else ""
        return f"{where}:{field} {self.message}"


SHOWN_ISSUES = 50  # of a SpecError's message; all of them stay in ``issues``


class SpecError(UserError):
    """Every problem found in one spec, each with its field path and line."""

    def __init__(self, issues: list[SpecIssue], what: str = "the experiment spec"):
        self.issues = sorted(issues, key=lambda i: (i.line is None, i.line or 0, i.path))
        n = len(self.issues)
        head = f"{n} error{'s' if n != 1 else ''} in {what}"
        shown = [i.render() for i in self.issues[:SHOWN_ISSUES]]
        if n > SHOWN_ISSUES:  # a list of 10,000 bad values: the first ones say what is wrong
            shown.append(f"... and {n - SHOWN_ISSUES} more")
        super().__init__(head + "\n" + "\n".join("  " + line for line in shown))


class SchedulerError(UserError):
    """The scheduler refused or failed a request (message carries its own words)."""

    exit_code = 3
