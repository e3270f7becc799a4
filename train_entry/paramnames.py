"""A parameter's own name, without the parts wrappers add to it: one rule for the engines
(which tensors a trainable-only checkpoint keeps) and the export (the names it writes)."""

from __future__ import annotations

# activation checkpointing, FSDP1 and torch.compile insert these; DDP and DeepSpeed prefix "module."
WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def clean(name: str) -> str:
    name = name.removeprefix("module.")
    for part in WRAPPER_PARTS:
        name = name.replace(part, "")
    return name
