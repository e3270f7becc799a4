"""The `orchestrate` command: parse, run one command, turn errors into exit codes.

Each command's module is imported only when that command runs, so that
`orchestrate status` on a login node never pays for what `plan` or
`ckpt consolidate` import (tests/unit/test_architecture.py checks the read commands).
"""

from __future__ import annotations

import importlib
import logging
import os
import sqlite3
import sys

from orchestrator.cli.parser import build_parser
from orchestrator.errors import UserError

# command -> "module:function", imported at dispatch
COMMANDS = {
    "validate": "orchestrator.cli.spec_cmds:cmd_validate",
    "schema": "orchestrator.cli.spec_cmds:cmd_schema",
    "plan": "orchestrator.cli.spec_cmds:cmd_plan",
    "submit": "orchestrator.cli.submit_cmd:cmd_submit",
    "status": "orchestrator.cli.read_cmds:cmd_status",
    "logs": "orchestrator.cli.read_cmds:cmd_logs",
    "events": "orchestrator.cli.read_cmds:cmd_events",
    "report": "orchestrator.cli.report_cmd:cmd_report",
    "cancel": "orchestrator.cli.control_cmds:cmd_cancel",
    "watch": "orchestrator.cli.control_cmds:cmd_watch",
    "ckpt": "orchestrator.cli.ckpt_cmd:cmd_ckpt",
    "data": "orchestrator.cli.data_cmd:cmd_data",
}


def handler(command: str):
    """The function that runs ``command``, its module imported now."""
    module, _, function = COMMANDS[command].partition(":")
    return getattr(importlib.import_module(module), function)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="warning: %(message)s")
    args = build_parser().parse_args(argv)
    old_umask = os.umask(0o077)  # the ledger and run folders are the user's alone (contract.perms)
    try:
        return handler(args.command)(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except (OSError, sqlite3.Error) as exc:
        from orchestrator.ledger import storage_trouble

        trouble = storage_trouble(exc)
        if trouble is None:
            raise
        print(f"error: {trouble}; nothing half-written was kept. Free space there and run the command again", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    finally:
        os.umask(old_umask)
