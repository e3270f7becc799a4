"""The built-in model and data, and loading the user's entry point.

Every workload reaches the loop as the same triple: a model, a map-style dataset
of (input, target) pairs, and a loss function.
"""

from __future__ import annotations

import importlib
import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

from orchestrator.contract import thaw
from train_entry.errors import UserCodeError, call_users, users


@dataclass
class Workload:
    model: nn.Module
    dataset: Any
    loss: Callable[[Any, Any], torch.Tensor]
    tokens_per_sample: int = 1  # throughput unit: tokens for language models, else samples
    eval_dataset: Any = None  # the held-out split, evaluated every ``eval.every_steps``
    loss_sum: Callable[[Any, Any], tuple] | None = None  # (loss sum, target count) of a batch, for evaluation
    export: dict | None = None  # hf.json, written into every checkpoint (how to export it)
    keep: Any = None  # what must outlive loading (ZeRO-3's HfDeepSpeedConfig)
    fill: Callable[..., None] | None = None  # a model built empty: fill(model, device) once the engine sharded it
    trainable_only: bool = False  # frozen weights come from the model folder again: not checkpointed


# ---------------------------------------------------------------- data


def markov_corpus(vocab: int, branching: int, num_tokens: int, seed: int) -> torch.Tensor:
    """A corpus from a fixed random order-2 Markov chain: each token pair has
    ``branching`` equally likely successors, so the loss can fall from ln(vocab)
    towards ln(branching). Deterministic in ``seed``; pure Python is ~0.1 s."""
    rng = random.Random(seed)
    succ = [rng.sample(range(vocab), min(branching, vocab)) for _ in range(vocab * vocab)]
    k = len(succ[0])
    out = [rng.randrange(vocab), rng.randrange(vocab)]
    choices = [rng.randrange(k) for _ in range(num_tokens)]
    for i in range(num_tokens - 2):
        out.append(succ[out[-2] * vocab + out[-1]][choices[i]])
    return torch.tensor(out, dtype=torch.long)


class TokenChunks(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens -> (input, next-token target)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        self.tokens = tokens
        self.seq_len = seq_len
        self.n = (len(tokens) - 1) // seq_len
        if self.n < 1:
            raise UserCodeError(f"the data has {len(tokens)} tokens, fewer than one sequence of {seq_len + 1}")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        s = i * self.seq_len
        chunk = self.tokens[s : s + self.seq_len + 1]
        return chunk[:-1], chunk[1:]


# ---------------------------------------------------------------- model


class Block(nn.Module):
    def __init__(self, d: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, d_model: int, n_layer: int, n_head: int, dropout: float = 0.0):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


# ---------------------------------------------------------------- building


def build_workload(mcfg: Mapping[str, Any], dcfg: Mapping[str, Any]) -> Workload:
    """The model, data and loss named by a task's ``model`` and ``data`` sections."""
    if mcfg["kind"] == "hf":
        raise ValueError("kind hf is built by train_entry.hf.build, which needs the whole task config")
    if mcfg["kind"] == "entrypoint":
        return _entrypoint(mcfg["entrypoint"], thaw(mcfg["kwargs"]))
    if dcfg["kind"] == "text":
        try:
            with open(dcfg["path"], "rb") as fh:
                tokens = torch.tensor(list(fh.read()), dtype=torch.long)
        except OSError as exc:
            raise UserCodeError(f"data.path: cannot read '{dcfg['path']}': {exc}") from None
        vocab = 256
    else:
        vocab = dcfg["vocab_size"]
        tokens = markov_corpus(vocab, dcfg["branching"], dcfg["num_tokens"], dcfg["seed"])
    dataset = TokenChunks(tokens, mcfg["seq_len"])
    model = GPT(vocab, mcfg["seq_len"], mcfg["d_model"], mcfg["n_layer"], mcfg["n_head"], mcfg["dropout"])
    return Workload(model, dataset, lm_loss, tokens_per_sample=mcfg["seq_len"])


# ---------------------------------------------------------------- the user's entry point
# Every call into the user's code goes through ``errors.users``: what it raises is theirs,
# what the trainer around it raises is ours (see ``errors``).


def _entrypoint(ref: str, kwargs: dict) -> Workload:
    module_name, _, fn_name = ref.partition(":")
    try:
        fn = getattr(call_users(importlib.import_module, module_name), fn_name)
    except (ImportError, AttributeError) as exc:
        raise UserCodeError(f"model.entrypoint: cannot load '{ref}': {exc}") from None
    out = call_users(fn, **kwargs)
    if not isinstance(out, dict) or not {"model", "dataset", "loss"} <= set(out):
        raise UserCodeError(f"model.entrypoint '{ref}' must return a dict with model, dataset and loss")
    try:
        tokens_per_sample = int(out.get("tokens_per_sample", 1))
    except (TypeError, ValueError):
        raise UserCodeError(f"model.entrypoint '{ref}': tokens_per_sample must be an integer") from None
    model = out["model"]
    if not isinstance(model, nn.Module):
        raise UserCodeError(f"model.entrypoint '{ref}': model must be a torch.nn.Module, not {type(model).__name__}")
    # an instance attribute, so state dict keys stay as the user's (no wrapping module)
    model.forward = users(model.forward)
    return Workload(model, UsersDataset(out["dataset"]), _users_loss(out["loss"], ref), tokens_per_sample)


class UsersDataset:
    """The user's dataset, as the sampler uses it."""

    def __init__(self, inner: Any):
        self.inner = inner

    def __len__(self) -> int:
        return call_users(len, self.inner)

    def __getitem__(self, i: int) -> Any:
        return call_users(self.inner.__getitem__, i)

    def collate(self, items: list) -> Any:
        """Stack the user's items into a batch: what cannot be stacked is the items' fault."""
        from torch.utils.data import default_collate

        batch = call_users(default_collate, items)
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise UserCodeError("the dataset of model.entrypoint must give (inputs, targets) pairs")
        return batch


def _users_loss(fn: Callable, ref: str) -> Callable:
    def loss(output: Any, target: Any) -> torch.Tensor:
        value = call_users(fn, output, target)
        # what backward needs: else the engine would raise, and the user's mistake look like ours
        if not (torch.is_tensor(value) and value.numel() == 1):
            what = f"a tensor of shape {tuple(value.shape)}" if torch.is_tensor(value) else type(value).__name__
            raise UserCodeError(f"the loss of model.entrypoint '{ref}' must return a one-element tensor, not {what}")
        return value

    return loss
