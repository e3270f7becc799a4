"""Evaluations of committed checkpoints (``eval.checkpoints``), tended by the watcher.

Each cycle, for each task of an experiment that asks for them: every ``every``-th committed
checkpoint is due (a ledger row, PENDING, and a pin, so rotation keeps the checkpoint until
it is evaluated); due ones start in step order, at most ``max_parallel`` at once, each as
its own process (``train_entry.checkpoint_eval``: export, generate, score, the result
written last); a finished one's result goes into the ledger (DONE), one that died without
a result is tried again up to ``retries`` times, one that cannot run as asked FAILED, one
whose checkpoint was gone or damaged SKIPPED. Training never waits for any of it.

``policy``: the decisions, pure. ``process``: starting and watching the processes.
``tend``: one task's part of the watcher's cycle, plan then apply. ``weights``: with
``checkpoint.consolidate.which: best``, the task's weights/ from the best one's export.
"""
