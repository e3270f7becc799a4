"""Checkpoints on the compute side: saved, committed, found again and proved on resume.

- ``policy``: when a save is due (steps, time, the checkpoint signal); pure.
- ``checkpointer``: ``Checkpointer``, a save from begin to commit, synchronous or not,
  and the load of a resume; the rest of the package does its parts:
- ``writer``: DCP's file writer, hashing and flushing each shard as it writes it, through
  ``direct_io`` (files written around the page cache);
- ``rng``: every rank's RNG states; ``pending``: a save between its write and its commit;
- ``commit``: files hashed, manifest written last, folder renamed; ``rotation``: the old
  ones deleted;
- ``resume``: the newest committed checkpoint that verifies; ``safeload``: every pickle
  read with allow-lists, never run;
- ``fingerprint`` and ``resume_check``: the loaded state proved to be the one committed;
- ``progress``: a blocking save beats while it advances;
- ``snapshot``: the same saves, every few steps, into the node's memory, for restarts in place.

Nothing is imported here: a caller names the module it uses, so that reading one part
(``safeload`` for ``orchestrate ckpt``, ``direct_io`` for the consolidation) never loads
the rest. The test faults a save can be given are ``train_entry.faults``'.
"""
