"""Existing training scripts under orchestrate, with a small change: the Hugging Face
Trainer (``hf_trainer.OrchestrateCallback``) and an Accelerate loop (``accelerate.Lifecycle``).

Both give the script what orchestrate's own trainer has: heartbeats, metrics and events in
the ledger, the checkpoint signal agreed by every rank and turned into save-and-requeue,
checkpoints that count only once committed through the tool's manifest, and resume from
the newest committed one, checked against its fingerprint before the first step.
"""
