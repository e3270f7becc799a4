"""The base model folder of a Hugging Face export, only ever read: its config (from
``config.json``, or from the GGUF file), the model's names and tied weights (the model
built on the meta device: no memory, no weights read), the files copied into the output
(``generation_config.json``, the tokenizer and its chat template), and its safetensors
weights, one tensor at a time, for merging LoRA into them.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from orchestrator import contract
from train_entry.consolidate.hfrecord import Record
from train_entry.consolidate.items import ConsolidateError, Item, make_item

TORCH_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # config.json's dtype
# what a tokenizer is made of in a model folder (whichever of them it has); with a GGUF
# base the tokenizer comes from the GGUF file and is saved instead
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
    "chat_template.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
    "sentencepiece.bpe.model",
)
TOKENIZER_GLOBS = ("*.tiktoken", "additional_chat_templates/*.jinja")
GENERATION_CONFIG = "generation_config.json"
ST_INDEX = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024**2


def transformers():
    try:
        import transformers as tf
    except ImportError:
        raise ConsolidateError("the Hugging Face export needs transformers and peft: pip install 'orchestrate[hf]'") from None
    tf.logging.set_verbosity_error()
    return tf


@dataclass
class ModelFacts:
    """What the model class says about its tensors, from the model built on the meta device."""

    keys: list[str]  # the state dict's keys, in order (tied aliases included)
    tied: dict[str, str]  # alias -> the tensor it shares (save_pretrained leaves the alias out)
    shapes: dict[str, tuple[int, ...]]
    modules: dict[str, str]  # module name -> "linear", "conv1d", "embedding" or its class name
    buffers: frozenset[str] = frozenset()  # the state dict's keys that are buffers, not parameters
    architecture: str | None = None  # the model class, e.g. LlamaForCausalLM

    def tied_to(self, name: str) -> str | None:
        """Another name for the same tensor, if ``name`` is tied (either way)."""
        if name in self.tied:
            return self.tied[name]
        return next((alias for alias, src in self.tied.items() if src == name), None)


class Base:
    def __init__(self, rec: Record):
        self.rec, self.folder = rec, rec.base
        self.config = self._config()  # the dict written as config.json (without the dtype, set per export)
        if rec.model_type and self.config.get("model_type") not in (None, rec.model_type):
            raise ConsolidateError(f"{self.folder}: a {self.config.get('model_type')} model, the checkpoint was trained "
                                   f"on a {rec.model_type} model")

    def _config(self) -> dict:
        tf = transformers()
        kw = {"gguf_file": self.rec.gguf_file} if self.rec.gguf_file else {}
        try:
            self.hf_config = tf.AutoConfig.from_pretrained(str(self.folder), local_files_only=True, **kw)
        except Exception as exc:  # noqa: BLE001 - a bad config.json or GGUF file raises many kinds
            where = self.folder / (self.rec.gguf_file or "config.json")
            raise ConsolidateError(f"{where}: cannot read the model's config: {exc}") from None
        cfg = self.hf_config.to_dict() if self.rec.gguf_file else contract.read_json(self.folder / "config.json")
        if not isinstance(cfg, dict):
            raise ConsolidateError(f"{self.folder / 'config.json'}: not a JSON object")
        self.quantized = "quantization_config" in cfg or getattr(self.hf_config, "quantization_config", None) is not None
        cfg.pop("quantization_config", None)  # the exported weights are full precision
        if getattr(self.hf_config, "quantization_config", None) is not None:
            del self.hf_config.quantization_config  # nor is the model built below quantized
        return cfg

    def config_json(self, dtype: str, architecture: str | None = None) -> dict:
        cfg = dict(self.config, dtype=TORCH_DTYPE_NAMES[dtype])
        if not cfg.get("architectures") and architecture:  # a GGUF file's config has none; save_pretrained writes it
            cfg["architectures"] = [architecture]
        if "torch_dtype" in cfg:  # transformers < 4.56 names it so
            cfg["torch_dtype"] = TORCH_DTYPE_NAMES[dtype]
        return cfg

    def facts(self) -> ModelFacts:
        """The model class's names, shapes and tied weights; nothing is allocated (meta device)."""
        import torch

        tf = transformers()
        try:
            with torch.device("meta"):
                model = tf.AutoModelForCausalLM.from_config(self.hf_config)
        except Exception as exc:  # noqa: BLE001 - an unknown architecture, custom code, a bad config
            raise ConsolidateError(f"{self.folder}: cannot build its model class from the config: {exc}") from None
        seen: dict[int, str] = {}
        tied: dict[str, str] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                tied[name] = seen[id(p)]
            else:
                seen[id(p)] = name
        state = model.state_dict()
        modules = {}
        for name, m in model.named_modules():
            kind = type(m).__name__
            if isinstance(m, torch.nn.Embedding):
                kind = "embedding"
            elif isinstance(m, torch.nn.Linear):
                kind = "linear"
            elif kind == "Conv1D":  # transformers' GPT-2 style layer: the weight is (in, out)
                kind = "conv1d"
            modules[name] = kind
        params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        return ModelFacts(list(state), tied, {k: tuple(v.shape) for k, v in state.items()}, modules,
                          frozenset(k for k in state if k not in params), type(model).__name__)

    def write_files(self, dst: Path, dtype: str, architecture: str | None = None) -> list[str]:
        """config.json, generation_config.json and the tokenizer into ``dst``; their names."""
        (dst / "config.json").write_text(json.dumps(self.config_json(dtype, architecture), indent=2, sort_keys=True) + "\n")
        written = ["config.json"]
        if (self.folder / GENERATION_CONFIG).is_file():
            _copy(self.folder / GENERATION_CONFIG, dst / GENERATION_CONFIG)
            written.append(GENERATION_CONFIG)
        return written + self.write_tokenizer(dst)

    def write_tokenizer(self, dst: Path) -> list[str]:
        found = [] if self.rec.gguf_file else [self.folder / n for n in TOKENIZER_FILES if (self.folder / n).is_file()]
        if not self.rec.gguf_file:
            for pattern in TOKENIZER_GLOBS:
                found += sorted(p for p in self.folder.glob(pattern) if p.is_file())
        if found:
            for src in found:
                rel = src.relative_to(self.folder)
                (dst / rel).parent.mkdir(parents=True, exist_ok=True)
                _copy(src, dst / rel)
            return [str(p.relative_to(self.folder)) for p in found]
        tf = transformers()  # GGUF: the tokenizer the run trained with is the one in the GGUF file
        kw = {"gguf_file": self.rec.gguf_file} if self.rec.gguf_file else {}
        try:
            tok = tf.AutoTokenizer.from_pretrained(str(self.folder), local_files_only=True, **kw)
            before = set(os.listdir(dst))
            tok.save_pretrained(str(dst))
        except Exception as exc:  # noqa: BLE001 - tokenizer loading raises many kinds
            raise ConsolidateError(f"{self.folder}: cannot load its tokenizer: {exc}") from None
        return sorted(set(os.listdir(dst)) - before)


def _copy(src: Path, dst: Path) -> None:
    """A regular file's bytes (a link is followed: hub caches link into their blobs)."""
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        shutil.copyfileobj(fi, fo, 16 * 1024**2)


def fsync_tree(folder: Path) -> None:
    """Every file and folder under ``folder`` on disk (before the rename that makes it visible):
    what peft and the tokenizer write is not fsynced by them."""
    for path in sorted(folder.rglob("*"), key=lambda p: -len(p.parts)) + [folder]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# safetensors' dtype names -> torch's
_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
              "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


class BaseWeights:
    """The base folder's safetensors weights (``model.safetensors``, or the shards its index
    names), read a tensor at a time; the headers are read first for every name, shape and
    dtype. Nothing is unpickled: a base with only ``pytorch_model.bin`` is refused."""

    def __init__(self, folder: Path):
        import torch

        self.src = folder
        index = folder / ST_INDEX
        if index.is_file():
            doc = contract.read_json(index)
            wm = doc.get("weight_map") if isinstance(doc, dict) else None
            if not isinstance(wm, dict) or not all(isinstance(v, str) and "/" not in v and v for v in wm.values()):
                raise ConsolidateError(f"{index}: not a safetensors index (a weight_map of file names)")
            files = sorted(set(wm.values()))
        elif (folder / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise ConsolidateError(f"{folder}: no model.safetensors or {ST_INDEX}: merging reads the base's safetensors "
                                   "weights (never pickles); the adapter folder alone is written without export.merge_lora")
        self.tensors: dict[str, tuple[str, tuple[int, ...], object]] = {}  # name -> (file, shape, torch dtype)
        for f in files:
            for name, (shape, dt) in _header(folder / f).items():
                if name in self.tensors:
                    raise ConsolidateError(f"{folder}: {name} is in both {self.tensors[name][0]} and {f}")
                self.tensors[name] = (f, shape, getattr(torch, _ST_DTYPES[dt]))
        self._open: dict[str, object] = {}

    def items(self, out_dtype) -> list[Item]:
        return [make_item(n, n, shape, dt, out_dtype) for n, (_, shape, dt) in self.tensors.items()]

    def tensor(self, name: str):
        from safetensors import safe_open

        f = self.tensors[name][0]
        try:
            if f not in self._open:
                self._open[f] = safe_open(str(self.src / f), framework="pt", device="cpu")
            return self._open[f].get_tensor(name)
        except Exception as exc:  # noqa: BLE001 - a short or damaged file
            raise ConsolidateError(f"{self.src / f}: cannot read {name}: {exc}") from None

    def release(self) -> None:
        self._open.clear()


def _header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype), in file order, from the header alone."""
    try:
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if not 2 <= n <= MAX_HEADER_BYTES:
                raise ValueError(f"a header of {n} bytes")
            header = json.loads(fh.read(n))
        size = path.stat().st_size
    except (OSError, ValueError) as exc:
        raise ConsolidateError(f"{path}: not a safetensors file ({exc})") from None
    out = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            shape, dt, (lo, hi) = tuple(int(d) for d in meta["shape"]), meta["dtype"], meta["data_offsets"]
            if dt not in _ST_DTYPES or not 0 <= lo <= hi <= size - 8 - n:
                raise ValueError(dt)
        except (KeyError, TypeError, ValueError):
            raise ConsolidateError(f"{path}: {name}: a header entry this reader does not know") from None
        out.append((lo, name, shape, dt))
    return {name: (shape, dt) for _, name, shape, dt in sorted(out)}
