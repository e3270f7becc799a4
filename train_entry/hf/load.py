"""The tokenizer and the model of ``model: {kind: hf}``, from a local folder only.

The model is loaded in the spec's dtype with the KV cache off (a cache built in training
lets packed examples attend to each other), put in training mode, and given LoRA
adapters whose initial values depend on the seed and their names alone
(``weights.adapter_init``), so every rank, engine and launch starts from the same model.
The weights are read without a second host copy where ``weights`` can (memory-mapped under
DDP and ZeRO-1/2, each rank its rows under FSDP2); under DeepSpeed ZeRO-3 they are
partitioned as they load (``HfDeepSpeedConfig``); QLoRA and GGUF go through
``from_pretrained``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from orchestrator.contract import thaw
from train_entry.errors import UserCodeError
from train_entry.hf import quiet, weights

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def keep_bitsandbytes_out(mcfg: Mapping[str, Any]) -> None:
    """peft imports bitsandbytes whenever it is installed: a second of a core at every rank's
    start, and its CPU backend tries to fetch a kernel from the hub. A model that is not 4-bit
    never calls it, so it stays out: a None in ``sys.modules`` fails the import, and
    ``importlib.util.find_spec`` (how peft and transformers ask) answers that it is absent.
    Not for QLoRA, nor for a folder whose config.json says its weights are quantised."""
    if mcfg.get("qlora") or "bitsandbytes" in sys.modules:
        return
    cfg = Path(mcfg["path"]) / "config.json"
    try:
        quantised = "quantization_config" in json.loads(cfg.read_text())
    except (OSError, ValueError):
        quantised = cfg.exists()  # unreadable: let the load say what is wrong, with bitsandbytes at hand
    if not quantised:
        sys.modules["bitsandbytes"] = None


def _transformers():
    quiet.drop_bitsandbytes_kernel_warning()  # before peft imports bitsandbytes
    try:
        import transformers
    except ImportError:
        raise UserCodeError("model.kind hf needs transformers and peft on the compute nodes: pip install 'orchestrate[hf]'") from None
    transformers.logging.set_verbosity_error()  # per-rank load chatter; errors still raise
    transformers.logging.disable_progress_bar()  # a bar per rank, drawn with \r into the rank's log
    return transformers


def source_kwargs(mcfg: Mapping[str, Any]) -> dict:
    kw: dict[str, Any] = {"local_files_only": True}
    if mcfg.get("gguf_file"):
        kw["gguf_file"] = mcfg["gguf_file"]
    return kw


def load_tokenizer(mcfg: Mapping[str, Any]):
    keep_bitsandbytes_out(mcfg)  # the first load of a rank: before anything imports peft
    tf = _transformers()
    try:
        tok = tf.AutoTokenizer.from_pretrained(mcfg["path"], **source_kwargs(mcfg))
    except (OSError, ValueError) as exc:
        raise UserCodeError(f"model.path: cannot load a tokenizer from '{mcfg['path']}': {exc}") from None
    if getattr(tok, "chat_template", None) is None:
        raise UserCodeError(f"model.path: the tokenizer in '{mcfg['path']}' has no chat template (data kind jsonl renders with it)")
    return tok


def pad_id(tok) -> int:
    for v in (tok.pad_token_id, tok.eos_token_id, 0):
        if v is not None:
            return int(v)
    return 0


def _quantization(q: Mapping[str, Any]):
    tf = _transformers()
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise UserCodeError("model.qlora needs bitsandbytes on the compute nodes: pip install 'orchestrate[qlora]'") from None
    return tf.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q["quant_type"],
        bnb_4bit_use_double_quant=q["double_quant"],
        bnb_4bit_compute_dtype=DTYPES[q["compute_dtype"]],
    )


def weights_route(mcfg: Mapping[str, Any], engine: Mapping[str, Any], deepspeed_config: Mapping[str, Any] | None = None) -> str | None:
    """How the weights are read (``weights``): "sharded" under FSDP2, "partitioned" under
    ZeRO-3, "mapped" under DDP and ZeRO-1/2; None (``from_pretrained``) for QLoRA, a GGUF
    file, ``model.load: from_pretrained``, and ZeRO-3 with parameters on NVMe or ZeRO++'s
    secondary or quantised copies."""
    if mcfg.get("qlora") or mcfg.get("gguf_file") or mcfg.get("load") == "from_pretrained":
        return None
    if engine["kind"] == "fsdp":
        return "sharded"
    if engine["kind"] == "deepspeed" and engine.get("stage") == 3:
        zero = (deepspeed_config or {}).get("zero_optimization", {})
        on_nvme = (zero.get("offload_param") or {}).get("device") == "nvme"
        zero_pp = (zero.get("zero_hpz_partition_size") or 1) > 1 or zero.get("zero_quantized_weights") \
            or zero.get("zero_quantized_nontrainable_weights")
        return None if on_nvme or zero_pp else "partitioned"  # their pieces are not plain local tensors
    return "mapped"


@dataclass
class Loaded:
    model: Any
    keep: Any = None  # what must outlive loading (ZeRO-3's HfDeepSpeedConfig)
    fill: Callable[..., None] | None = None  # FSDP2: the engine calls it once it has sharded the empty model
    how: str = "from_pretrained"  # said in rank 0's log


def load_model(mcfg: Mapping[str, Any], seed: int, deepspeed_config: Mapping[str, Any] | None,
               engine: Mapping[str, Any]) -> Loaded:
    """The model to train (a peft model with adapters, or the whole model)."""
    tf = _transformers()
    kw = dict(source_kwargs(mcfg), dtype=DTYPES[mcfg["dtype"]], attn_implementation=mcfg["attn_implementation"])
    route = weights_route(mcfg, engine, deepspeed_config)
    loaded = None
    if route:
        try:
            loaded = _from_files(tf, mcfg, kw, route, seed, deepspeed_config)
        except weights.Unsupported as exc:
            why = f"from_pretrained ({exc})"
    if loaded is None:
        loaded = _from_pretrained(tf, mcfg, kw, deepspeed_config)
        loaded.model = _adapt(loaded.model, mcfg, seed)
        if route:
            loaded.how = why
        weights.init_adapters(loaded.model, seed)
    loaded.model.config.use_cache = False
    loaded.model.train()
    return loaded


def _from_files(tf, mcfg, kw, route: str, seed: int, deepspeed_config) -> Loaded:
    def build(partitioned: bool):
        try:
            return weights.empty_model(tf, mcfg["path"], kw, partitioned=partitioned)
        except (OSError, ValueError) as exc:
            raise UserCodeError(f"model.path: cannot build a causal LM from '{mcfg['path']}/config.json': {exc}") from None

    bare = build(False)
    plan = weights.Plan.of(mcfg["path"], bare)  # before zero.Init's collectives: every rank decides alike
    keep = None
    if route == "partitioned":
        keep = _zero3(deepspeed_config)
        bare = build(True)
        plan.partitions(bare)
    elif route == "mapped":
        plan.mapped(bare, kw["dtype"])
    before = {id(p): n for n, p in bare.named_parameters(remove_duplicate=False)} if route == "sharded" else {}
    model = _adapt(bare, mcfg, seed)
    if route == "sharded":  # its plan is read again after wrapping, under the wrapped names
        plan.rename(model, before)
        weights.check_adapters(model, plan)
        return Loaded(model, fill=lambda m, device: plan.fill(m, device, seed),
                      how="sharded: each rank reads only the rows of its shard from the safetensors files")
    weights.init_adapters(model, seed)
    if route == "partitioned":
        return Loaded(model, keep=keep, how="partitioned: each rank reads only its ZeRO-3 piece from the safetensors files")
    return Loaded(model, how="mapped: views of the safetensors files' pages, shared by the node's ranks")


def _zero3(deepspeed_config):
    """DeepSpeed's ZeRO-3 config, made visible to transformers (``HfDeepSpeedConfig``): models
    it builds or loads while this lives are partitioned as they are made (``zero.Init``)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    import deepspeed
    from torch import distributed as dist
    from transformers.integrations import HfDeepSpeedConfig

    from train_entry.engines.deepspeed import skip_unneeded_op_builds

    skip_unneeded_op_builds(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    # DeepSpeed's view of the process group we made: its config checks the batch against the world size
    deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
    return HfDeepSpeedConfig(thaw(deepspeed_config))


def _from_pretrained(tf, mcfg, kw, deepspeed_config) -> Loaded:
    qlora = mcfg.get("qlora")
    if qlora:
        kw["quantization_config"] = _quantization(qlora)
    zero = (deepspeed_config or {}).get("zero_optimization", {})
    keep = _zero3(deepspeed_config) if zero.get("stage") == 3 and not qlora else None  # weights partitioned as read
    try:
        model = tf.AutoModelForCausalLM.from_pretrained(mcfg["path"], **kw)
    except (OSError, ValueError) as exc:
        raise UserCodeError(f"model.path: cannot load a causal LM from '{mcfg['path']}': {exc}") from None
    if qlora:
        import peft

        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return Loaded(model, keep=keep)


def _adapt(model, mcfg: Mapping[str, Any], seed: int):
    """The model with LoRA adapters, when the spec asks for them (their values: ``weights.adapter_init``)."""
    adapter = mcfg.get("qlora") or mcfg.get("lora")
    if not adapter:
        return model
    import peft

    torch.manual_seed(seed)  # anything peft draws: the same on every rank and launch
    lora = peft.LoraConfig(r=adapter["r"], lora_alpha=adapter["alpha"], lora_dropout=adapter["dropout"],
                           target_modules=list(adapter["target_modules"]), task_type="CAUSAL_LM")
    try:
        with quiet.peft_deprecation_off():
            return peft.get_peft_model(model, lora)
    except ValueError as exc:  # a target module the model does not have
        raise UserCodeError(f"model.lora.target_modules: {exc}") from None


def fingerprint(mcfg: Mapping[str, Any]) -> dict:
    """What identifies the base model: config.json's hash and the weight files' names and
    sizes (hashing gigabytes at every launch would cost minutes)."""
    folder = Path(mcfg["path"])
    out: dict[str, Any] = {}
    cfg = folder / "config.json"
    if cfg.is_file():
        out["config_sha256"] = hashlib.sha256(cfg.read_bytes()).hexdigest()
    weights = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf")) if folder.is_dir() else []
    out["weights"] = {p.name: p.stat().st_size for p in weights}
    return out


def export_record(mcfg: Mapping[str, Any], model) -> dict:
    """``hf.json`` in every checkpoint: how to turn its tensors back into a model folder."""
    adapter = mcfg.get("qlora") or mcfg.get("lora")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {
        "format": 1,
        "base": {"path": str(Path(mcfg["path"]).resolve()), "gguf_file": mcfg.get("gguf_file"), **fingerprint(mcfg)},
        "model_type": getattr(base.config, "model_type", None),
        "tie_word_embeddings": bool(getattr(base.config, "tie_word_embeddings", False)),
        "adapter": None if not adapter else {
            "r": adapter["r"], "alpha": adapter["alpha"], "dropout": adapter["dropout"],
            "target_modules": list(adapter["target_modules"]), "qlora": bool(mcfg.get("qlora")),
        },
        "merge_lora": bool((mcfg.get("export") or {}).get("merge_lora")),
        "dtype": mcfg["dtype"],
    }


def describe(model) -> str:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    def numel(p) -> int:  # ZeRO-3 partitions, and 4-bit weights packed two to a byte, hide the true count
        shape = getattr(getattr(p, "quant_state", None), "shape", None)
        return math.prod(shape) if shape is not None else getattr(p, "ds_numel", p.numel())

    total = sum(numel(p) for p in model.parameters())
    return f"{trainable:,} trainable parameters of {total:,}"


__all__ = ["Loaded", "describe", "export_record", "fingerprint", "load_model", "load_tokenizer", "pad_id", "weights_route"]
