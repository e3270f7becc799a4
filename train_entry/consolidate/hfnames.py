"""Tensor names between a checkpoint and a Hugging Face folder (pure; no torch).

- A full fine-tune's checkpoint holds the model's own names (``model.layers.0...``); the
  wrappers' parts are taken out (DDP's ``module.``, activation checkpointing's
  ``_checkpoint_wrapped_module.``, which DeepSpeed keeps in its names), and a weight tied
  to another (``lm_head.weight`` to ``model.embed_tokens.weight``) is left out, as
  ``save_pretrained`` leaves it out.
- A LoRA checkpoint holds the adapters under the peft model's names,
  ``base_model.model.<module>.lora_A.default.weight``; peft saves them without the
  adapter's name (``...lora_A.weight``), and merging adds ``B @ A`` to ``<module>.weight``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from train_entry.consolidate.items import ConsolidateError
from train_entry.paramnames import clean  # noqa: F401 - the export's names are the engines' rule

PEFT_PREFIX = "base_model.model."
ADAPTER_NAME = "default"  # the one adapter train_entry.hf.load adds

_LINEAR = re.compile(r"(?P<module>.+)\.lora_(?P<part>[AB])\.(?P<adapter>[^.]+)\.weight")
_EMBEDDING = re.compile(r"(?P<module>.+)\.lora_embedding_(?P<part>[AB])\.(?P<adapter>[^.]+)")


@dataclass(frozen=True)
class AdapterTensor:
    module: str  # the adapted module in the base model, e.g. model.layers.0.self_attn.q_proj
    part: str  # "A" (r x in) or "B" (out x r)
    embedding: bool  # lora_embedding_A/B (an nn.Embedding) rather than lora_A/B (a linear layer)
    saved: str  # the name in peft's adapter_model.safetensors

    @property
    def weight(self) -> str:
        """The base model's tensor this adapter updates."""
        return f"{self.module}.weight"


def adapter_tensor(name: str) -> AdapterTensor | None:
    """What a LoRA checkpoint's tensor is, or None for a name that is no adapter of ours."""
    name = clean(name)
    if not name.startswith(PEFT_PREFIX):
        return None
    rest = name[len(PEFT_PREFIX):]
    for pattern, embedding in ((_LINEAR, False), (_EMBEDDING, True)):
        m = pattern.fullmatch(rest)
        if m and m["adapter"] == ADAPTER_NAME:
            saved = f"{PEFT_PREFIX}{m['module']}." + (f"lora_embedding_{m['part']}" if embedding else f"lora_{m['part']}.weight")
            return AdapterTensor(m["module"], m["part"], embedding, saved)
    return None


def targeted(module: str, target_modules) -> bool:
    """peft's rule for a list of target modules: the module's name, or its last parts."""
    return any(module == t or module.endswith("." + t) for t in target_modules)


def full_model_names(names: list[str], keys: list[str], tied: dict[str, str]) -> dict[str, str]:
    """Checkpoint name -> output name for a full fine-tune, in the model's order.

    ``keys``: the model's state-dict keys (in order); ``tied``: alias -> the tensor it is
    tied to, aliases left out of the output. Every other key must be in the checkpoint and
    nothing else may be: what ``from_pretrained`` would call missing or unexpected is an
    error here, named."""
    by_clean: dict[str, str] = {}
    for n in names:
        c = clean(n)
        if c in by_clean:
            raise ConsolidateError(f"the checkpoint holds {c} twice ({by_clean[c]}, {n})")
        by_clean[c] = n
    wanted = [k for k in keys if k not in tied]
    missing = [k for k in wanted if k not in by_clean]
    unexpected = sorted(c for c in by_clean if c not in set(keys))
    if missing or unexpected:
        parts = [f"{what}: {_some(names)}" for what, names in (("missing", missing), ("not in the model", unexpected)) if names]
        if any(c.startswith(PEFT_PREFIX) for c in unexpected):
            parts.append("a LoRA checkpoint, though its hf.json says it is a full fine-tune")
        raise ConsolidateError("the checkpoint's tensors are not the model's; " + "; ".join(parts))
    return {by_clean[k]: k for k in wanted}


def _some(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")
