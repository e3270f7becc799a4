"""The rich console that tables are printed to."""

from __future__ import annotations

import os


def stdout_console():
    """A terminal gets its own width; a pipe or file gets wide enough rows not to wrap."""
    from rich.console import Console  # rich is imported only by the commands that print tables

    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=160)
    return console
