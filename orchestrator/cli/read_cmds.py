"""status, events, logs: read the ledger and the run folder.

They run on login nodes, so they import nothing heavy (no torch; tests/unit/test_architecture.py).
"""

from __future__ import annotations

import codecs
import json
import os
import sys
import time

from orchestrator import contract
from orchestrator.contract import safe_read
from orchestrator.cli import render
from orchestrator.cli.console import stdout_console
from orchestrator.errors import UserError
from orchestrator.ledger import access
from orchestrator.ledger.values import json_safe
from orchestrator.supervise import refresh
from orchestrator.states import TaskState


def cmd_status(args) -> int:
    ledger = access.open_ledger(access.home_dir(args.home))
    exps = access.resolve_experiment(ledger, args.experiment)
    if args.experiment and not args.all:
        exps = exps[:1]
    refresh.for_reader(ledger, exps)
    exps = [ledger.experiment(e["id"]) for e in exps]
    doc = render.status_document(ledger, exps)
    if args.json:
        print(json.dumps(json_safe(doc), indent=2))
        return 0
    if not exps:
        print("no experiments yet; start one with `orchestrate submit SPEC`")
        return 0
    stdout_console().print(*render.status_tables(doc))
    return 0


def cmd_events(args) -> int:
    ledger = access.open_ledger(access.home_dir(args.home))
    exp = access.resolve_experiment(ledger, args.experiment)[0]
    refresh.for_reader(ledger, [exp])
    events = ledger.events(exp["id"])
    if args.json:
        for e in events:  # the numbers of a trainer event, as an object (stored as JSON text)
            try:
                e["data"] = json.loads(e["data"]) if isinstance(e.get("data"), str) else None
            except ValueError:
                e["data"] = None
        print(json.dumps(json_safe(events), indent=2))
    else:
        for e in events:
            print(render.event_line(e))
    return 0


def cmd_logs(args) -> int:
    ledger = access.open_ledger(access.home_dir(args.home))
    exp = access.resolve_experiment(ledger, args.experiment)[0]
    tasks = {t["idx"]: t for t in ledger.tasks(exp["id"])}
    if args.task not in tasks:
        raise UserError(f"experiment {exp['id']} has tasks 0..{len(tasks) - 1}, not {args.task}")
    path = contract.log_path(tasks[args.task]["task_dir"], args.rank)
    pos = 0
    while True:
        if path.exists():
            pos = _print_from(path, pos)
        elif not args.follow:
            raise UserError(f"no log for task {args.task} rank {args.rank} yet ({path}); the task may not have started")
        if not args.follow:
            return 0
        refresh.for_reader(ledger, [ledger.experiment(exp["id"])])
        if TaskState(ledger.task(exp["id"], args.task)["state"]).terminal:
            time.sleep(0.2)
            if path.exists() and path.stat().st_size == pos:
                return 0
        time.sleep(1.0)


LOG_CHUNK = 1 << 20


def _print_from(path, pos: int) -> int:
    """Copy a log to stdout from byte ``pos``, a chunk at a time; the position after it.
    The log is the rank's own output, copied as it is; but only from a regular file: a
    FIFO or a link to a device there would hang or flood this command."""
    try:
        fd = safe_read.open_regular(path)
    except safe_read.BadRecord as exc:
        raise UserError(f"not showing {path}: it {exc}") from None
    if fd is None:
        return pos
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    try:
        os.lseek(fd, pos, os.SEEK_SET)
        while chunk := os.read(fd, LOG_CHUNK):
            sys.stdout.write(decoder.decode(chunk))
            pos += len(chunk)
    finally:
        os.close(fd)
    sys.stdout.flush()
    return pos - len(decoder.getstate()[0])  # a character cut at the end: read again next time
