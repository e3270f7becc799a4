"""Watching one experiment to its end in the foreground (`submit --watch`, `watch EXP`)."""

from __future__ import annotations

import json
import sys

from orchestrator.cli import render
from orchestrator.cli.console import stdout_console
from orchestrator.ledger.values import json_safe
from orchestrator.supervise import loop
from orchestrator.states import TaskState


def follow_experiment(ledger, exp_id: str, as_json: bool, interval: float) -> int:
    """Watch one experiment (this process is its watcher) until it ends; show progress.

    Exit 0 only if it completed, 1 if it ended otherwise, 130 if the watching stopped first.
    """
    _watch_with_progress(ledger, exp_id, interval)
    exp = ledger.experiment(exp_id)
    if not TaskState(exp["state"]).terminal:
        print(f"\nstopped watching; {exp_id} goes on. Watch it again with `orchestrate watch {exp_id}`, "
              f"stop it with `orchestrate cancel {exp_id}`.", file=sys.stderr)
        return 130
    doc = render.status_document(ledger, [exp])
    if as_json:
        print(json.dumps(json_safe(doc), indent=2))
    else:
        stdout_console().print(*render.status_tables(doc))
    return 0 if exp["state"] == TaskState.COMPLETED.value else 1


def _watch_with_progress(ledger, exp_id: str, interval: float) -> None:
    """A live table on a terminal; otherwise each new event as a line on stderr."""
    from rich.console import Console, Group
    from rich.live import Live

    console = Console(stderr=True)
    seen = [0]

    def show_events(ids):
        events = ledger.events(exp_id)
        for e in events[seen[0]:]:
            print(render.event_line(e), file=sys.stderr, flush=True)
        seen[0] = len(events)

    if console.is_terminal:
        with Live(console=console, refresh_per_second=2) as live:
            def show_table(ids):
                live.update(Group(*render.status_tables(render.status_document(ledger, [ledger.experiment(exp_id)]))))

            loop.watch(ledger, [exp_id], interval, on_cycle=show_table)
    else:
        loop.watch(ledger, [exp_id], interval, on_cycle=show_events)
