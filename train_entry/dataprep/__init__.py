"""Data prepared once per content and memory-mapped by every rank.

- ``sources``: the input files' digests and raw records;
- ``encode``: records -> token ids and the assistant-token mask, a batch at a time;
- ``build``: one cache entry prepared (``datasets.map`` in several processes) and committed;
- ``store``: an entry opened memory-mapped, and the rows the loop samples (``Rows``, ``Packed``);
- ``ranks``: at a start, rank 0 finds or prepares the entries, the others open what it names.

The cache's layout, manifest and claims are the contract's (``orchestrator.contract.datacache``):
the login side lists and removes entries without importing any of this.
"""
