"""The memory plan's inputs read from a spec: the model's ``Shape`` (counted by formula
for the built-in model, on the meta device for ``kind: hf``, by building an entry-point
model once), the hardware and batch ``Setting``, and which candidate the spec's engine is.
"""

from __future__ import annotations

from orchestrator.submit.memory_plan import CANDIDATES, Setting, Shape, gpt_shape


def shape_of(spec) -> Shape:
    """The built-in model's shape from the spec; an entry point's by building its model once."""
    m = spec.model
    if m.kind == "gpt":
        vocab = 256 if spec.data.kind == "text" else spec.data.vocab_size
        return gpt_shape(vocab, m.seq_len, m.d_model, m.n_layer, m.n_head)
    if m.kind in ("script", "command"):
        from orchestrator.errors import UserError

        raise UserError(f"model.kind {m.kind}: orchestrate plan cannot see the model inside a training {m.kind}")
    if m.kind == "hf":
        return hf_shape_of(spec)
    from train_entry.engines.base import layer_units
    from train_entry.models import build_workload

    model = build_workload(m.model_dump(), spec.data.model_dump()).model
    total = sum(p.numel() for p in model.parameters())
    leaves = [sum(p.numel() for p in mod.parameters(recurse=False)) for mod in model.modules()]
    units = [sum(p.numel() for p in u.parameters()) for u in layer_units(model)]
    return Shape(total, max(leaves, default=total), max(units, default=total))


def hf_shape_of(spec) -> Shape:
    """A ``kind: hf`` model's shape: counted from its config on the meta device, the
    adapters' parameters by peft (or from the targeted layers' shapes without it)."""
    from orchestrator.errors import UserError
    from orchestrator.submit import hf_shape

    m = spec.model
    try:
        hs = hf_shape.shape_of_model(hf_shape.meta_model(m.path, m.gguf_file))
        adapter = m.adapter
        trainable, counted = None, "meta"
        if adapter is not None:
            trainable, how = hf_shape.lora_trainable(m.path, m.gguf_file, adapter.r, adapter.alpha, adapter.target_modules)
            counted = f"meta, adapters by {how}"
    except hf_shape.Unavailable as exc:
        raise UserError(f"model.kind hf: orchestrate plan builds the model from its config and needs torch and "
                        f"transformers here ({exc}): pip install 'orchestrate[hf]'") from None
    except hf_shape.ModelError as exc:
        raise UserError(f"model.path '{m.path}': {exc}") from None
    method = "qlora" if m.qlora is not None else "lora" if m.lora is not None else "full"
    e = hf_shape.torch_dtype_bytes(m.dtype)
    act = None
    if m.qlora is not None:
        act = hf_shape.torch_dtype_bytes(m.qlora.compute_dtype)
    dims = all((hs.layers, hs.d_model, hs.n_head, hs.vocab))  # what the activation estimate needs
    return Shape(
        params=hs.params,
        largest_layer=hs.largest_layer,
        unit=hs.unit,
        layers=hs.layers if dims else None,
        d_model=hs.d_model if dims else None,
        n_head=hs.n_head if dims else None,
        seq_len=spec.data.max_length if dims else None,
        vocab=hs.vocab if dims else None,
        trainable=trainable,
        method=method,
        weight_bytes=e,
        trainable_bytes=e if adapter is None else 4,  # peft keeps adapters in fp32
        quantized=hs.quantizable if method == "qlora" else 0,
        quant_bits=hf_shape.QUANT_BITS[m.qlora.double_quant] if m.qlora is not None else 0.0,
        activation_bytes=act,
        fused_attention=m.attn_implementation == "sdpa",
        counted_by=counted,
    )


def setting_of(spec, nodes: int | None = None, gpus_per_node: int | None = None, gpu_memory: int | None = None) -> Setting:
    from orchestrator.spec.units import parse_memory_mb

    r = spec.resources
    if gpu_memory is None and r.gpu_memory:
        gpu_memory = parse_memory_mb(r.gpu_memory) * 1024**2
    return Setting(
        nodes=nodes or r.nodes,
        gpus_per_node=gpus_per_node or r.tasks_per_node,
        gpu_memory=gpu_memory or None,  # 0 is no size (SLURM's "all of it"): figures only, no recommendation
        micro_batch=spec.batch.micro_batch_size,
        grad_accum=spec.batch.grad_accum,
        precision=spec.engine.precision,
        optimizer=spec.optimizer.name,
    )


def candidate_of(engine) -> str | None:
    """The candidate that a spec's engine is (None for settings the plan does not list)."""
    e = engine.model_dump()
    for c in CANDIDATES:
        if all(e.get(k) == v for k, v in c.engine.items()) and all(
            e.get(k) in (None, "none", False) for k in ("offload_optimizer", "offload_param", "cpu_offload") if k not in c.engine
        ):
            return c.name
    return None
