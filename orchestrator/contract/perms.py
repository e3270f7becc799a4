"""Who may read what a run writes: the owner only, unless the spec shares with the group.

Specs carry ``env`` values (tokens) and rank logs echo them, so every process of a
run — the CLI, the watcher, the node agent and the ranks it starts — runs under a
umask that keeps others out, set at start-up before it creates anything. ``mkstemp``
ignores the umask (always 0600), so atomic writes take their mode from here too.
"""

from __future__ import annotations

import os

PRIVATE_UMASK = 0o077  # files 0600, folders 0700
GROUP_UMASK = 0o027  # files 0640, folders 0750: the group reads, never writes


def umask_for(share_with_group: bool) -> int:
    return GROUP_UMASK if share_with_group else PRIVATE_UMASK


def apply(share_with_group: bool = False) -> int:
    """Set this process's umask (inherited by everything it starts); returns the old one."""
    return os.umask(umask_for(share_with_group))


def current_umask() -> int:
    try:  # Linux >= 4.7 shows it without changing it
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(PRIVATE_UMASK)  # elsewhere: set and put back
    os.umask(old)
    return old


def file_mode() -> int:
    """The mode a new regular file gets under this process's umask."""
    return 0o666 & ~current_umask()
