"""Sharded checkpoint -> full weights, streaming: tensors are read in small batches and
written one at a time.

Readers (what a checkpoint holds, and the tensors of one batch): ``dcp`` (DDP, FSDP2)
and ``zero`` (DeepSpeed ZeRO-0/1/2/3); ``writers`` plans the shards and writes them.

The safetensors writer streams too (the header is known from the plan), so peak memory
is about one read batch (``READ_BATCH_BYTES``, less with a smaller ``--max-shard-size``)
plus the largest tensor, never the model; ``--format torch`` holds one output shard,
since ``torch.save`` wants the whole dict. Compare ``dcp_to_torch_save`` (everything,
optimizer included) and ``zero_to_fp32`` (ZeRO-1/2: the merged flat groups; ZeRO-3:
every mapped page it touched).

Output is the Hugging Face layout: ``model.safetensors``, or ``model-0000i-of-0000n.safetensors``
plus ``model.safetensors.index.json`` (``pytorch_model*.bin`` for ``--format torch``), and
``consolidated.json`` (source, step, dtype). It is written into a temporary folder beside
``out``, each file fsynced, and renamed into place at the end, so nothing in ``out`` ever
looks complete when it is not.

A checkpoint of a ``model: {kind: hf}`` run (it holds ``hf.json``) becomes a Hugging Face
folder instead (``hf``): the model folder of a full fine-tune, or ``adapter/`` (PEFT) and,
with ``export.merge_lora``, ``merged/`` for LoRA and QLoRA.

Compute-node side too: the job's final step runs ``python -m train_entry.consolidate``.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from orchestrator import contract
from train_entry.consolidate.dcp import DcpReader
from train_entry.consolidate import trainer as trainer_export
from train_entry.consolidate.items import ConsolidateError, Item
from train_entry.consolidate.writers import SafetensorsWriter, TorchWriter, index_name, plan_shards, shard_names
from train_entry.consolidate.zero import ZeroReader

__all__ = [
    "DTYPES", "FORMATS", "READ_BATCH_BYTES", "RECORD", "ConsolidateError", "DcpReader", "Item", "SafetensorsWriter",
    "TorchWriter", "ZeroReader", "consolidate", "index_name", "open_reader", "plan_shards", "shard_names", "torch_dtype",
    "write_items",
]

DTYPES = ("fp32", "bf16", "fp16")
FORMATS = ("safetensors", "torch")
RECORD = contract.WEIGHTS_RECORD  # written last into the output: what it was made from
READ_BATCH_BYTES = 128 * 1024**2  # read (and keep mapped) at most this much at a time


def open_reader(folder: Path, manifest: dict):
    fmt = manifest.get("state_format")
    if fmt == "dcp":
        return DcpReader(_inside(folder, folder / "dcp"))
    if fmt == "deepspeed":
        src = _inside(folder, folder / "deepspeed")
        tags = [d for d in src.iterdir() if d.is_dir() and not d.is_symlink()] if src.is_dir() else []
        if len(tags) != 1:
            raise ConsolidateError(f"{folder / 'deepspeed'}: expected one tag folder, found {len(tags)}")
        return ZeroReader(tags[0])
    raise ConsolidateError(f"{folder}: consolidating {fmt!r} checkpoints is not supported (DCP and DeepSpeed are)")


def _inside(folder: Path, sub: Path) -> Path:
    """``sub``, a folder the reader reads, if it is one of the checkpoint's own, not a link out of it."""
    if sub.is_symlink() or not os.path.realpath(sub).startswith(os.path.realpath(folder) + os.sep):
        raise ConsolidateError(f"{sub} is a symbolic link or leads out of the checkpoint folder; not read")
    return sub


def consolidate(folder: str | os.PathLike, out: str | os.PathLike, dtype: str = "fp32", fmt: str = "safetensors",
                max_shard_bytes: int = contract.MAX_SHARD_BYTES, hf: bool | None = None, base: str | os.PathLike | None = None) -> dict:
    """Write the model weights of one committed checkpoint to ``out``; returns a summary.

    ``hf``: write a Hugging Face folder (``consolidate.hf``); None: when the checkpoint holds
    ``hf.json``. ``base``: the base model folder, when it is no longer where ``hf.json`` says."""
    folder, out = Path(folder), Path(out)
    manifest = _checked_source(folder, out, dtype, fmt)
    started = time.time()
    export, reader = _exporter(folder, manifest, fmt, hf, base)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if export is not None:
            summary = export.write(reader, tmp, dtype, max_shard_bytes)
        else:
            summary = _write_all(reader, tmp, dtype, fmt, max_shard_bytes)
        # write_s: reading and writing the tensors, after the checks (the benchmark's rate)
        summary.update(source=str(folder.resolve()), step=manifest.get("step"), engine=manifest.get("engine"),
                       write_s=round(time.time() - started, 3))
        contract.atomic_write_json(tmp / RECORD, summary)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {**summary, "out": str(out), "seconds": round(time.time() - started, 2)}


def _checked_source(folder: Path, out: Path, dtype: str, fmt: str) -> dict:
    """The options, the output folder and the checkpoint checked before anything is read; its manifest."""
    if dtype not in DTYPES:
        raise ConsolidateError(f"--dtype {dtype}: use one of {', '.join(DTYPES)}")
    if fmt not in FORMATS:
        raise ConsolidateError(f"--format {fmt}: use safetensors or torch")
    if out.exists() and any(out.iterdir()):
        raise ConsolidateError(f"--out {out} exists and is not empty; give a new folder")
    if not os.path.lexists(folder / contract.MANIFEST):
        raise ConsolidateError(f"{folder}: no {contract.MANIFEST}: not a committed checkpoint (see `orchestrate ckpt list`)")
    problem = contract.verify_checkpoint(folder)  # the manifest checked, and every file it names inside the folder
    if problem:
        raise ConsolidateError(f"{folder}: {problem}; consolidate an older checkpoint (`orchestrate ckpt list`)")
    manifest = contract.read_manifest(folder)
    from train_entry.checkpoint import safeload  # torch

    # every pickle of it within the allow-lists, the RNG states too: a checkpoint that holds code is not used
    problem = safeload.first_problem(folder, safeload.unpickled_files(manifest))
    if problem:
        raise ConsolidateError(problem)
    return manifest


def _exporter(folder: Path, manifest: dict, fmt: str, hf: bool | None, base: str | os.PathLike | None):
    """(what writes the output, None: the tensors under the checkpoint's own names; what reads
    the checkpoint, None: a Trainer's own folder, copied rather than read)."""
    if hf is None:
        hf = (folder / contract.HF_EXPORT).exists()
    export = None
    if hf:
        from train_entry.consolidate import hf as hf_export  # transformers and peft: only for these checkpoints

        if fmt != "safetensors":
            raise ConsolidateError(f"--format {fmt}: a Hugging Face folder holds safetensors; for {fmt} files under the "
                                   "checkpoint's own names, consolidate without the Hugging Face export (--no-hf)")
        export = hf_export.prepare(folder, manifest, base)  # hf.json and the base folder checked before any tensor
    elif base is not None:
        raise ConsolidateError("--base is the base model folder of a Hugging Face export (--hf)")
    if manifest.get("state_format") == trainer_export.STATE_FORMAT:  # a Trainer's own folder: copied, not read
        return trainer_export.prepare(folder, fmt), None
    return export, open_reader(folder, manifest)


def torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _write_all(reader, dst: Path, dtype: str, fmt: str, max_shard_bytes: int) -> dict:
    items = reader.items(torch_dtype(dtype))
    if not items:
        raise ConsolidateError(f"{reader.src}: no model tensors in this checkpoint")
    return {**write_items(reader, items, dst, fmt, max_shard_bytes), "dtype": dtype}


def write_items(reader, items: list[Item], dst: Path, fmt: str = "safetensors", max_shard_bytes: int = contract.MAX_SHARD_BYTES,
                stem: str | None = None) -> dict:
    """``items`` (``name``: in the output, ``key``: in ``reader``) into ``dst``: every shard in
    plan order, each read in batches of at most ``READ_BATCH_BYTES`` whose rank files are
    released before the next, so peak memory stays one batch. ``reader`` is anything with
    ``read(items, what)`` (a mapping by key) and ``release()``."""
    shards = plan_shards(items, max_shard_bytes)
    names = shard_names(len(shards), fmt, stem)
    weight_map, total = {}, 0
    for shard, fname in zip(shards, names):
        writer = SafetensorsWriter(dst / fname, shard) if fmt == "safetensors" else TorchWriter(dst / fname)
        for batch in plan_shards(shard, min(READ_BATCH_BYTES, max_shard_bytes)):
            group = reader.read(batch, fname)
            for it in batch:
                writer.add(it, group[it.key].to(it.dtype))
                weight_map[it.name] = fname
                total += it.nbytes
            del group
            reader.release()
        writer.close()
    if len(names) > 1:
        contract.atomic_write_json(dst / index_name(fmt), {"metadata": {"total_size": total}, "weight_map": weight_map})
    return {"tensors": len(items), "bytes": total, "files": names, "format": fmt}
