"""DCP checkpoints (DDP, FSDP2): torch's own ``FileSystemReader`` and ``dcp.load`` of a
partial state dict read just the tensors asked for, so a batch costs its own size. The
metadata is unpickled only through ``safeload``'s allow-list (a hostile one is refused)."""

from __future__ import annotations

import warnings
from pathlib import Path

from train_entry.consolidate.items import ConsolidateError, Item, make_item

DCP_MODEL_PREFIX = "model."  # trainers save {"model": ..., "optim": ...}; DCP flattens it to "model.<name>"


class DcpReader:
    def __init__(self, src: Path):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from train_entry.checkpoint import safeload

        self.src = src
        try:
            meta = safeload.read_dcp_metadata(src)
        except safeload.CheckpointRefused as exc:
            raise ConsolidateError(str(exc)) from None
        self.stored = {}
        for key, md in meta.state_dict_metadata.items():
            if key.startswith(DCP_MODEL_PREFIX) and isinstance(md, TensorStorageMetadata):
                self.stored[key] = (tuple(md.size), md.properties.dtype)

    def items(self, out_dtype) -> list[Item]:
        return [make_item(k[len(DCP_MODEL_PREFIX):], k, shape, dt, out_dtype) for k, (shape, dt) in self.stored.items()]

    def release(self) -> None:
        pass

    def read(self, items: list[Item], what: str) -> dict:
        import torch
        import torch.distributed.checkpoint as dcp

        from train_entry.checkpoint import safeload

        group = {it.key: torch.empty(it.shape, dtype=self.stored[it.key][1]) for it in items}
        try:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(group, storage_reader=safeload.SafeFileSystemReader(str(self.src)),
                         planner=safeload.SafeLoadPlanner(), no_dist=True)
        except Exception as exc:  # noqa: BLE001 - torch raises many kinds for a damaged file
            raise ConsolidateError(f"{self.src}: cannot read the tensors of {what}: {exc}") from None
        return group
