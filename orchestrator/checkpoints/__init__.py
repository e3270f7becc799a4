"""``orchestrate ckpt``: list, verify and prune a task's checkpoints. The on-disk
format is the contract's (``orchestrator.contract.checkpoint``); consolidation runs
in ``train_entry.consolidate`` so that jobs can run it too."""
