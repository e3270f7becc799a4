"""Supervision: run-folder records into the ledger (``ingest``; the readers are
``orchestrator.runfolder``'s), what the records and the scheduler's word mean
(``reconcile``, pure), the refresh cycle that applies it (``refresh``), the recovery
policy (``recovery``, pure), the watcher that acts on it (``watcher``) and ``cancel``. Our states and their transition tables are
``orchestrator.states``, below every package that speaks of them."""
