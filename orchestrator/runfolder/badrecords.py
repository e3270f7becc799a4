"""Run-folder records the login side skips, and the one event that says so.

The readers (``supervise.ingest``, ``launches``) read every record through
``contract.safe_read`` and collect what they skipped as ``Problem``s instead of raising;
``report`` turns each into a ``record.skipped`` event of its task, once: a record that
stays bad (a damaged heartbeat rewritten every few seconds) is not reported again every
refresh.
"""

from __future__ import annotations

import fnmatch
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from orchestrator.contract.safe_read import BadRecord, Schema, read_record
from orchestrator.ledger import Ledger

SKIPPED = "record.skipped"
FILES_MAX = 100_000  # entries of one run-folder directory looked at


@dataclass(frozen=True)
class Problem:
    path: str
    why: str


Problems = list[Problem]


def read(path: str | Path, schema: Schema, problems: Problems) -> dict | None:
    """The checked record at ``path``; None (and a problem) when it is bad, None when absent."""
    try:
        return read_record(path, schema)
    except BadRecord as exc:
        problems.append(Problem(str(path), str(exc)))
        return None


def real_dir(path: str | Path, problems: Problems) -> bool:
    """``path`` is a directory of its own (a link to one is never followed)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return False
    if stat.S_ISDIR(mode):
        return True
    problems.append(Problem(str(path), "is a symbolic link, which is never followed" if stat.S_ISLNK(mode) else "is not a directory"))
    return False


def entries(directory: Path, pattern: str, problems: Problems) -> list[str]:
    """The paths in ``directory`` whose names match ``pattern``, sorted (strings: the ingest
    reads thousands a cycle); a link or a non-file among them is the reader's to refuse.
    Absent, or not a directory of its own: none."""
    if not real_dir(directory, problems):
        return []
    found = []
    try:
        with os.scandir(directory) as it:
            for n, entry in enumerate(it):
                if n >= FILES_MAX:
                    problems.append(Problem(str(directory), f"holds more than {FILES_MAX} entries; only the first were read"))
                    break
                if fnmatch.fnmatchcase(entry.name, pattern):
                    found.append(entry.path)
    except OSError as exc:
        problems.append(Problem(str(directory), f"cannot be listed ({exc.strerror})"))
    return sorted(found)


def relative(path: str, task_dir: str | Path) -> str:
    try:
        return str(Path(path).relative_to(task_dir))
    except ValueError:
        return path


def report(ledger: Ledger, exp_id: str, idx: int, task_dir: str | Path, problems: Problems) -> None:
    """One ``record.skipped`` event per problem the task's history does not already hold."""
    causes = dict.fromkeys(f"{relative(p.path, task_dir)}: {p.why}; skipped" for p in problems)
    new = [c for c in causes if not ledger.has_event(exp_id, SKIPPED, c, idx=idx)]
    if new:
        with ledger.tx():
            for cause in new:
                ledger.event(exp_id, SKIPPED, cause, idx=idx)
