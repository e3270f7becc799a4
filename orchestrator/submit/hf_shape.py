"""The shape of a ``model: {kind: hf}`` from its config alone, on the login node.

The model is built from ``config.json`` (or a GGUF file's header) on the meta device:
every module and parameter shape, no weights read and no memory used. From it come
the parameter count, the largest layer and decoder block (what ZeRO-3 and FSDP gather),
the linear layers LoRA can target, the parameters LoRA trains and those QLoRA stores in
4 bits. The preflight checks and ``orchestrate plan`` share it; torch and transformers
are imported only when a function here is called.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# bits per weight of bitsandbytes' 4-bit formats: 4 bits, plus one fp32 absmax per block of
# 64 (0.5 bit); double quantisation stores those as 8 bits with one fp32 per 256 blocks
BLOCK = 64
QUANT_BITS = {False: 4 + 32 / BLOCK, True: 4 + 8 / BLOCK + 32 / (BLOCK * 256)}  # 4.5, ~4.127


class Unavailable(Exception):
    """torch or transformers (or gguf, for a GGUF file) is not importable here."""


class ModelError(ValueError):
    """transformers cannot make a causal LM of the folder; the message says why."""


@dataclass(frozen=True)
class HFShape:
    model_class: str
    params: int  # distinct parameters (tied embeddings counted once)
    largest_layer: int  # parameters of the largest single module
    unit: int  # parameters of the largest decoder block
    layers: int | None
    d_model: int | None
    n_head: int | None
    vocab: int | None
    max_positions: int | None
    linear: dict[str, tuple[int, int]]  # module path -> (in, out) of every linear layer
    quantizable: int  # weights QLoRA stores in 4 bits: every linear layer but the output head


@contextlib.contextmanager
def _quiet():
    """No import and load chatter from transformers, peft and bitsandbytes on the terminal."""
    names = ("transformers", "peft", "bitsandbytes", "accelerate", "torch", "deepspeed")
    saved = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.ERROR)
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for n, level in saved.items():
            logging.getLogger(n).setLevel(level)


def _libs():
    try:
        with _quiet():
            import torch
            import transformers
    except ImportError as exc:
        raise Unavailable(f"{exc.name or 'transformers'} is not importable") from None
    transformers.logging.set_verbosity_error()
    return torch, transformers


def meta_model(path: str | Path, gguf_file: str | None = None, attn_implementation: str | None = None):
    """The causal LM of the folder, built from its config on the meta device."""
    torch, tf = _libs()
    kw: dict[str, Any] = {"local_files_only": True}
    if gguf_file:
        kw["gguf_file"] = gguf_file
    with _quiet():
        try:
            config = tf.AutoConfig.from_pretrained(str(path), **kw)
        except ImportError as exc:  # reading a GGUF header needs the gguf package
            raise Unavailable(f"{exc.name or 'gguf'} is not importable ({exc})") from None
        except Exception as exc:  # noqa: BLE001 - whatever the user's files made transformers raise
            raise ModelError(f"transformers {tf.__version__} cannot read the config: {_first_line(exc)}") from None
        extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
        try:
            with torch.device("meta"):
                return tf.AutoModelForCausalLM.from_config(config, **extra)
        except Exception as exc:  # noqa: BLE001
            kind = getattr(config, "model_type", "?")
            raise ModelError(f"transformers {tf.__version__} cannot build a causal LM of model_type '{kind}': {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def linear_layers(model) -> dict[str, tuple[int, int]]:
    """Module path -> (in, out) features of each layer LoRA treats as linear."""
    torch, _ = _libs()
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            out[name] = (m.in_features, m.out_features)
        elif type(m).__name__ == "Conv1D" and hasattr(m, "nf"):  # GPT-2's transposed linear: weight (in, out)
            out[name] = (m.weight.shape[0], m.nf)
    return out


def matches(target: str, name: str) -> bool:
    """peft's rule for a list of target modules: the whole path, or its last parts."""
    return name == target or name.endswith("." + target)


def outline_of(model):
    """The model's shape and every module's path, class and kind: all the checks need, kept
    by ``outlines`` so that the next check of the same config imports nothing."""
    from orchestrator.submit.outlines import Outline

    torch, _ = _libs()
    linear = linear_layers(model)
    modules = tuple((n, type(m).__name__, "linear" if n in linear else "embedding" if isinstance(m, torch.nn.Embedding) else "other")
                    for n, m in model.named_modules() if n)
    shape = asdict(shape_of_model(model))
    shape["linear"] = [[n, i, o] for n, (i, o) in shape["linear"].items()]  # a list: JSON keeps its order
    return Outline(shape, modules)


def shape_of_outline(outline) -> HFShape:
    """The shape an outline holds; TypeError, ValueError or KeyError when it holds another thing."""
    d = dict(outline.shape)
    shape = HFShape(**{**d, "linear": {str(n): (int(i), int(o)) for n, i, o in d["linear"]}})
    counts = (shape.params, shape.largest_layer, shape.unit, shape.quantizable)
    optional = (shape.layers, shape.d_model, shape.n_head, shape.vocab, shape.max_positions)
    if not isinstance(shape.model_class, str) or not all(type(v) is int for v in counts) \
            or not all(v is None or type(v) is int for v in optional):
        raise TypeError("not the counts of a model")
    return shape


def target_problems(outline, targets: list[str]) -> list[tuple[int, str]]:
    """(index in targets, what is wrong) for each target LoRA cannot use: one that names no
    module, or one that names a module peft cannot adapt (a block, a norm)."""
    problems = []
    for i, target in enumerate(targets):
        hits = [(n, cls, kind) for n, cls, kind in outline.modules if matches(target, n)]
        if not hits:
            problems.append((i, f"'{target}' is not a module of this model ({outline.shape['model_class']})"))
            continue
        other = sorted({cls for _, cls, kind in hits if kind == "other"})
        if other:
            problems.append((i, f"'{target}' names {', '.join(other)} modules, not linear layers"))
    return problems


def leaf_names(names) -> list[str]:
    """The last part of each module path, in order of first appearance, without repeats."""
    return list(dict.fromkeys(n.rsplit(".", 1)[-1] for n in names))


def _units(model) -> list:
    for m in model.modules():
        if getattr(m, "_no_split_modules", None):
            kinds = set(m._no_split_modules)
            found = [u for u in model.modules() if type(u).__name__ in kinds]
            if found:
                return found
    torch, _ = _libs()
    return [u for m in model.modules() if isinstance(m, torch.nn.ModuleList) for u in m]


def shape_of_model(model) -> HFShape:
    """Counts of a model (on the meta device or not)."""
    params = sum(p.numel() for p in model.parameters())
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=params)
    unit = max((sum(p.numel() for p in u.parameters()) for u in _units(model)), default=params)
    cfg = getattr(model, "config", None)
    text_cfg = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg

    def first(*keys):
        for k in keys:
            v = getattr(text_cfg, k, None)
            if isinstance(v, int) and v > 0:
                return v
        return None

    linear = linear_layers(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_names = {n for n, m in model.named_modules() if m is head}
    quantizable = sum(i * o for n, (i, o) in linear.items() if n not in head_names)
    return HFShape(
        model_class=type(model).__name__,
        params=params,
        largest_layer=largest,
        unit=unit,
        layers=first("num_hidden_layers", "n_layer", "num_layers"),
        d_model=first("hidden_size", "n_embd", "d_model"),
        n_head=first("num_attention_heads", "n_head"),
        vocab=first("vocab_size"),
        max_positions=first("max_position_embeddings", "n_positions"),
        linear=linear,
        quantizable=quantizable,
    )


def lora_by_shapes(model, r: int, targets: list[str]) -> int:
    """Parameters LoRA adds (and trains): r x (in + out) for each targeted linear layer,
    r x (rows + dim) for an embedding."""
    torch, _ = _libs()
    linear = linear_layers(model)
    total = 0
    for name, m in model.named_modules():
        if not name or not any(matches(t, name) for t in targets):
            continue
        if name in linear:
            total += r * sum(linear[name])
        elif isinstance(m, torch.nn.Embedding):
            total += r * (m.num_embeddings + m.embedding_dim)
    return total


def lora_trainable(path: str | Path, gguf_file: str | None, r: int, alpha: float, targets: list[str]) -> tuple[int, str]:
    """Parameters LoRA trains and how they were counted: by peft on a fresh meta model
    when peft is importable (what the trainer will do), else from the layers' shapes."""
    torch, _ = _libs()
    model = meta_model(path, gguf_file)
    try:
        with _quiet():
            import peft
    except ImportError:
        return lora_by_shapes(model, r, targets), "shapes"
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), task_type="CAUSAL_LM")
    try:
        with _quiet(), torch.device("meta"):
            wrapped = peft.get_peft_model(model, config)
    except Exception:  # noqa: BLE001 - the preflight names bad targets; count what the shapes say
        return lora_by_shapes(meta_model(path, gguf_file), r, targets), "shapes"
    return sum(p.numel() for p in wrapped.parameters() if p.requires_grad), "peft"


def torch_dtype_bytes(name: str) -> int:
    return {"fp32": 4, "bf16": 2, "fp16": 2}[name]
