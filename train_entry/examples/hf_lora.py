"""Fine-tune a Hugging Face causal LM with LoRA (peft): an entry point for any engine.

The base model comes from a local folder (``pretrained_dir``, e.g. a checkpoint you
copied to the cluster; never downloaded) or, without one, is built from a small
config, so the example runs anywhere. Only the LoRA adapters train. Needs the
``hf`` extra: ``pip install 'orchestrate[hf]'``.

    model:
      kind: entrypoint
      entrypoint: train_entry.examples.hf_lora:build
      kwargs: {pretrained_dir: /scratch/models/my-llm, lora_r: 16}
"""

from __future__ import annotations

import torch
from torch import nn

from train_entry.errors import UserCodeError
from train_entry.models import TokenChunks, lm_loss, markov_corpus


class LogitsOnly(nn.Module):
    """The loop calls ``model(inputs)`` and wants the logits back."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=input_ids, use_cache=False).logits


def base_model(pretrained_dir: str | None, vocab_size: int, seq_len: int, d_model: int, n_layer: int, n_head: int):
    try:
        import transformers
    except ImportError:
        raise UserCodeError("this example needs transformers and peft: pip install 'orchestrate[hf]'") from None
    if pretrained_dir:
        return transformers.AutoModelForCausalLM.from_pretrained(pretrained_dir, local_files_only=True)
    config = transformers.GPT2Config(
        vocab_size=vocab_size, n_positions=seq_len, n_embd=d_model, n_layer=n_layer, n_head=n_head,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def build(
    pretrained_dir: str | None = None,
    vocab_size: int = 64,
    seq_len: int = 64,
    d_model: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    lora_r: int = 16,
    lora_alpha: int = 16,
    target_modules: list[str] | None = None,
    branching: int = 2,
    num_tokens: int = 100_000,
    data_seed: int = 0,
) -> dict:
    import peft

    model = base_model(pretrained_dir, vocab_size, seq_len, d_model, n_layer, n_head)
    vocab = model.config.vocab_size
    lora = peft.LoraConfig(
        r=lora_r, lora_alpha=lora_alpha, lora_dropout=0.0, target_modules=target_modules or ["c_attn", "c_proj", "c_fc"],
        task_type="CAUSAL_LM",
    )
    model = peft.get_peft_model(model, lora)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    print(f"LoRA: {trainable:,} trainable parameters of {total:,}", flush=True)
    tokens = markov_corpus(min(vocab, 256), branching, num_tokens, data_seed)
    return {
        "model": LogitsOnly(model),
        "dataset": TokenChunks(tokens, seq_len),
        "loss": lm_loss,
        "tokens_per_sample": seq_len,
    }
