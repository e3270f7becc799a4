"""Checkpoints on the compute side: saved, committed, found again and proved on resume.

Nothing is imported here: a caller names the module it uses, so that reading one part
(``safeload`` for ``orchestrate ckpt``, ``direct_io`` for the consolidation) never loads
the rest.
"""
