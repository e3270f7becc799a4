"""A Hugging Face Trainer checkpoint (``state_format: hf-trainer``, written through
``train_entry.integrations.hf_trainer``) -> the loadable folder it already holds.

The Trainer's ``save_model`` wrote the weights as safetensors in every engine setting that
matters here: a PEFT adapter folder for LoRA (``adapter_config.json`` +
``adapter_model.safetensors``: ``PeftModel.from_pretrained(base, out)``), the model folder for
a full fine-tune (``config.json`` + ``model*.safetensors``: ``from_pretrained(out)``), under
DDP and DeepSpeed ZeRO-1/2 alike. So the export copies those files and the tokenizer's, and
nothing the Trainer pickled (optimizer, scheduler, RNG states, training_args.bin, DeepSpeed's
``global_step*`` shards) is opened or copied. ``--dtype bf16|fp16`` rewrites each weights file
cast (floating-point tensors only), one file at a time.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from orchestrator import contract
from train_entry.consolidate.items import ConsolidateError

STATE_FORMAT = "hf-trainer"
_SKIPPED = {contract.MANIFEST, "trainer_state.json"}  # ours, and the Trainer's progress record
_KEPT_SUFFIXES = (".safetensors", ".json", ".jinja", ".txt", ".model")  # weights, configs, tokenizer, chat template


class TrainerExport:
    def __init__(self, folder: Path, fmt: str):
        if fmt != "safetensors":
            raise ConsolidateError(f"--format {fmt}: a Trainer checkpoint holds safetensors, which are copied as they are")
        self.folder = folder
        self.files = sorted(n for n in contract.read_manifest(folder)["files"]
                            if "/" not in n and n not in _SKIPPED and n.endswith(_KEPT_SUFFIXES))
        names = set(self.files)
        if "adapter_config.json" in names and "adapter_model.safetensors" in names:
            self.kind = "peft_adapter"
        elif "config.json" in names and any(n.startswith("model") and n.endswith(".safetensors") for n in names):
            self.kind = "model"
        else:
            raise ConsolidateError(f"{folder}: no adapter_model.safetensors or model*.safetensors from the Trainer's "
                                   "save_model (a ZeRO-3 run needs stage3_gather_16bit_weights_on_model_save: true)")

    def write(self, _reader, dst: Path, dtype: str, _max_shard_bytes: int) -> dict:
        total, tensors = 0, 0
        for name in self.files:
            src = self.folder / name
            if name.endswith(".safetensors") and dtype != "fp32":
                total += _cast(src, dst / name, dtype)
            else:
                shutil.copyfile(src, dst / name)
                total += src.stat().st_size
            _fsync(dst / name)  # renamed into place later: on disk first
            if name.endswith(".safetensors"):
                tensors += _count(dst / name)
        return {"kind": self.kind, "files": self.files, "bytes": total, "tensors": tensors,
                "dtype": dtype if dtype != "fp32" else "as saved", "format": "safetensors"}


def _fsync(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _count(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:  # the header only
        return len(list(f.keys()))


def _cast(src: Path, dst: Path, dtype: str) -> int:
    from safetensors import safe_open
    from safetensors.torch import save_file

    from train_entry.consolidate import torch_dtype

    want, out, meta = torch_dtype(dtype), {}, None
    with safe_open(str(src), framework="pt") as f:
        meta = f.metadata()
        for key in f.keys():
            t = f.get_tensor(key)
            out[key] = t.to(want) if t.is_floating_point() else t
    save_file(out, str(dst), metadata=meta)
    return dst.stat().st_size


def prepare(folder: Path, fmt: str) -> TrainerExport:
    return TrainerExport(folder, fmt)
