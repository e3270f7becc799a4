"""A checkpoint of a ``model: {kind: hf}`` run -> a Hugging Face folder that loads.

``hf.json`` in the checkpoint (``hfrecord``: validated, untrusted) names the base folder;
the tensors come from the same readers and go through the same streaming writer as
every consolidation (``write_items``), renamed on the way (``hfnames``).

- Full fine-tune: the folder itself is the model: ``config.json`` (the base's, or the
  GGUF file's, without ``quantization_config``, its ``dtype`` the one written),
  ``generation_config.json`` if the base has one, the tokenizer files with the chat
  template, and the weights under the model's own names (``model.safetensors`` or shards
  with an index), a tied ``lm_head.weight`` left out as ``save_pretrained`` does. Every
  tensor the model class has must be there and nothing else (checked against the model
  built on the meta device), so ``from_pretrained`` reports nothing missing or unexpected.
- LoRA / QLoRA: ``adapter/`` is a PEFT adapter folder (``adapter_config.json`` from peft's
  ``LoraConfig``, ``adapter_model.safetensors`` under peft's saved names, the tokenizer).
  With ``export.merge_lora`` also ``merged/``, a full model folder: the base's
  safetensors streamed a tensor at a time, each adapted weight ``W + (alpha / r) B A``
  computed in fp32 and written in the dtype asked for. QLoRA trained against the 4-bit
  quantised base; the merge adds the adapters to the base as stored in its folder (full
  precision), as ``merge_and_unload`` on a full-precision base would.

Memory: one read batch of the checkpoint, or one base tensor plus its fp32 copy and one
adapter pair, at a time; the model built to check names lives on the meta device.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from train_entry.consolidate import hfnames, hfrecord
from train_entry.consolidate.hfbase import Base, BaseWeights, ModelFacts, fsync_tree, transformers
from train_entry.consolidate.items import ConsolidateError, Item

ADAPTER_DIR = "adapter"
MERGED_DIR = "merged"
ADAPTER_STEM = "adapter_model"  # adapter_model.safetensors, as peft names it
ONE_FILE = 1 << 62  # peft writes an adapter as one file


def prepare(folder: Path, manifest: dict, base: str | os.PathLike | None = None) -> "Export":
    """Everything checked that can be before a tensor is read: the record, the base folder,
    its config and model class."""
    rec = hfrecord.read(folder, manifest, base)
    return Export(rec)


class Export:
    def __init__(self, rec: hfrecord.Record):
        self.rec = rec
        self.base = Base(rec)
        self.facts = self.base.facts()
        if rec.merge_lora and rec.gguf_file:
            raise ConsolidateError(f"{rec.path}: merge_lora with a GGUF base ({rec.gguf_file}): merging streams the base's "
                                   "safetensors weights; export without merging (the adapter folder) instead")
        if rec.merge_lora and self.base.quantized:
            raise ConsolidateError(f"{rec.base}: its weights are quantised (quantization_config): there is no full-precision "
                                   "weight to merge the adapters into")

    def write(self, reader, dst: Path, dtype: str, max_shard_bytes: int) -> dict:
        from train_entry.consolidate import torch_dtype

        out = torch_dtype(dtype)
        items = reader.items(out)
        if not items:
            raise ConsolidateError(f"{reader.src}: no model tensors in this checkpoint")
        if self.rec.adapter is None:
            summary = self._full(reader, items, dst, dtype, max_shard_bytes)
        else:
            summary = self._lora(reader, items, dst, dtype, out, max_shard_bytes)
        fsync_tree(dst)
        return summary

    # ------------------------------------------------------------ full fine-tune

    def _full(self, reader, items: list[Item], dst: Path, dtype: str, max_shard_bytes: int) -> dict:
        names = hfnames.full_model_names([it.name for it in items], self.facts.keys, self.facts.tied)
        by_name = {it.name: it for it in items}
        planned = [replace(by_name[src], name=name) for src, name in names.items()]
        _check_shapes(planned, self.facts, reader.src)
        summary = write_items(reader, planned, dst, max_shard_bytes)
        other = self.base.write_files(dst, dtype, self.facts.architecture)
        return {**summary, "dtype": dtype, "hf": "full", "other_files": other}

    # ------------------------------------------------------------ LoRA and QLoRA

    def _lora(self, reader, items: list[Item], dst: Path, dtype: str, out, max_shard_bytes: int) -> dict:
        pairs = self._adapter_pairs(items, reader.src)
        merge = self._merge_plan(pairs) if self.rec.merge_lora else None  # its problems said before anything is written
        adir = dst / ADAPTER_DIR
        adir.mkdir()
        planned = [replace(it, name=t.saved) for pair in pairs.values() for t, it in pair.values()]
        adapter = write_items(reader, planned, adir, ONE_FILE, stem=ADAPTER_STEM)
        self._adapter_config(adir, pairs)
        self.base.write_tokenizer(adir)
        files = [f"{ADAPTER_DIR}/{f}" for f in adapter["files"]]
        summary = {"tensors": adapter["tensors"], "bytes": adapter["bytes"], "adapter_tensors": adapter["tensors"]}
        if merge is not None:
            mdir = dst / MERGED_DIR
            mdir.mkdir()
            base, targets = merge
            merged = write_items(MergedReader(base, reader, targets, self.rec.adapter.scale), base.items(out), mdir, max_shard_bytes)
            self.base.write_files(mdir, dtype, self.facts.architecture)
            files += [f"{MERGED_DIR}/{f}" for f in merged["files"]]
            summary.update(tensors=summary["tensors"] + merged["tensors"], bytes=summary["bytes"] + merged["bytes"],
                           merged_tensors=merged["tensors"], merged_adapted=len(targets))
        return {**summary, "files": files, "format": "safetensors", "dtype": dtype,
                "hf": "adapter+merged" if self.rec.merge_lora else "adapter"}

    def _adapter_pairs(self, items: list[Item], src) -> dict[str, dict[str, tuple[hfnames.AdapterTensor, Item]]]:
        """module -> {"A": (name, item), "B": ...}, every one checked against the model."""
        a = self.rec.adapter
        pairs: dict[str, dict[str, tuple[hfnames.AdapterTensor, Item]]] = {}
        for it in items:
            t = hfnames.adapter_tensor(it.name)
            if t is None and hfnames.clean(it.name).removeprefix(hfnames.PEFT_PREFIX) in self.facts.buffers:
                continue  # a buffer of the base model (saved with the adapters); the base folder has it
            if t is None:
                raise ConsolidateError(f"{src}: {it.name} is not a LoRA adapter tensor; hf.json says this is a LoRA "
                                       "checkpoint, which holds only the adapters")
            if not hfnames.targeted(t.module, a.target_modules):
                raise ConsolidateError(f"{src}: {it.name}: {t.module} is not one of the target modules in hf.json "
                                       f"({', '.join(a.target_modules)})")
            kind = self.facts.modules.get(t.module)
            if kind not in ("linear", "conv1d", "embedding") or (kind == "embedding") != t.embedding:
                raise ConsolidateError(f"{src}: {it.name}: the model has no {'embedding' if t.embedding else 'linear'} "
                                       f"layer {t.module} (found: {kind or 'nothing'})")
            if t.part in pairs.setdefault(t.module, {}):
                raise ConsolidateError(f"{src}: the adapter {t.saved} is there twice")
            pairs[t.module][t.part] = (t, it)
        for module, pair in pairs.items():
            if set(pair) != {"A", "B"}:
                raise ConsolidateError(f"{src}: {module} has lora_{'A' if 'B' in pair else 'B'} without its other half")
            (ta, ia), (_, ib) = pair["A"], pair["B"]
            w = self.facts.shapes.get(ta.weight)
            rows, cols = ib.shape[0] if len(ib.shape) == 2 else -1, ia.shape[1] if len(ia.shape) == 2 else -1
            if self.facts.modules[module] != "linear":
                rows, cols = cols, rows  # stored (in, out): Conv1D's weight, an embedding's (num, dim)
            if len(ia.shape) != 2 or len(ib.shape) != 2 or ia.shape[0] != a.r or ib.shape[1] != a.r or w != (rows, cols):
                raise ConsolidateError(f"{src}: {module}: adapters {ia.shape} and {ib.shape} do not fit a weight of "
                                       f"{w} with r = {a.r}")
        return pairs

    def _adapter_config(self, adir: Path, pairs) -> None:
        from train_entry.hf import quiet

        quiet.drop_bitsandbytes_kernel_warning()  # peft imports bitsandbytes; nothing here is 4-bit
        import peft

        a = self.rec.adapter
        fan_in_fan_out = any(self.facts.modules[m] == "conv1d" for m in pairs)
        config = peft.LoraConfig(
            r=a.r, lora_alpha=a.alpha, lora_dropout=a.dropout, target_modules=list(a.target_modules), task_type="CAUSAL_LM",
            base_model_name_or_path=str(self.rec.base), fan_in_fan_out=fan_in_fan_out, inference_mode=True,
        )
        config.save_pretrained(str(adir))

    def _merge_plan(self, pairs) -> tuple[BaseWeights, dict[str, tuple[Item, Item, bool]]]:
        """The base's weights, and for each adapted one its adapters (A, B, transposed?)."""
        base = BaseWeights(self.rec.base)
        targets = {}
        for module, pair in pairs.items():
            t, ia = pair["A"]
            if t.weight not in base.tensors:
                raise ConsolidateError(f"{self.rec.base}: no tensor {t.weight} in its safetensors to merge {module}'s "
                                       "adapters into (the folder names its weights differently from the model class)")
            tied = self.facts.tied_to(t.weight)
            if tied:
                raise ConsolidateError(f"{module}: its weight is tied to {tied}; merging would change both, unlike the "
                                       f"trained model; use the adapter folder ({ADAPTER_DIR}/)")
            targets[t.weight] = (ia, pair["B"][1], self.facts.modules[module] != "linear")
        return base, targets


def write_items(reader, items: list[Item], dst: Path, max_shard_bytes: int, stem: str | None = None) -> dict:
    from train_entry.consolidate import write_items as write

    return write(reader, items, dst, "safetensors", max_shard_bytes, stem)


def _check_shapes(items: list[Item], facts: ModelFacts, src) -> None:
    for it in items:
        if tuple(it.shape) != facts.shapes[it.name]:
            raise ConsolidateError(f"{src}: {it.name} is {tuple(it.shape)}, the model's is {facts.shapes[it.name]}")


class MergedReader:
    """The base's tensors, each adapted one with its adapters merged in: ``W + scale B A``
    (transposed for Conv1D and embeddings) in fp32. A reader as ``write_items`` wants one:
    tensors are made when asked for, one at a time."""

    def __init__(self, base: BaseWeights, ckpt, targets: dict[str, tuple[Item, Item, bool]], scale: float):
        self.src, self.base, self.ckpt, self.targets, self.scale = base.src, base, ckpt, targets, scale

    def read(self, items: list[Item], what: str) -> "_Merged":
        """The adapters of the batch's adapted weights are read together (one read of a DCP
        checkpoint, not one per weight); the base's tensors when asked for."""
        wanted = [x for it in items if it.key in self.targets for x in self.targets[it.key][:2]]
        return _Merged(self, self.ckpt.read(wanted, what) if wanted else {})

    def release(self) -> None:
        self.base.release()
        self.ckpt.release()

    def tensor(self, key: str, adapters):
        import torch

        w = self.base.tensor(key)
        if key not in self.targets:
            return w
        ia, ib, transpose = self.targets[key]
        delta = adapters[ib.key].float() @ adapters[ia.key].float()
        return w.to(torch.float32, copy=True).add_(delta.T if transpose else delta, alpha=self.scale)


class _Merged:
    def __init__(self, reader: MergedReader, adapters):
        self.reader, self.adapters = reader, adapters

    def __getitem__(self, key: str):
        return self.reader.tensor(key, self.adapters)


__all__ = ["ADAPTER_DIR", "MERGED_DIR", "Export", "MergedReader", "prepare", "transformers"]
