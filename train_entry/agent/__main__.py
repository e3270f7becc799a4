"""``python -m train_entry.agent TASK_DIR``: the node agent of one launch (local executor)."""

import sys

from orchestrator.contract import ExitCode

from train_entry.agent.node import node_main

if len(sys.argv) != 2:
    print("usage: python -m train_entry.agent TASK_DIR", file=sys.stderr)
    sys.exit(ExitCode.USER_ERROR)
sys.exit(node_main(sys.argv[1]))
