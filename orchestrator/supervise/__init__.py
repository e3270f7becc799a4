"""Supervision: our task and attempt states with their enforced transitions
(``states``), run-folder records into the ledger (``ingest``, ``launches``), what the
records and the scheduler's word mean (``reconcile``, pure), the refresh cycle that
applies it (``refresh``), the recovery policy (``recovery``, pure) and the watcher
that acts on it (``watcher``)."""
