"""The loss of a causal LM on labels that are already shifted (``labels[i]`` is the token
after position ``i``, or -100 where no loss falls: prompts, padding, and the boundary of
packed examples). The records become those labels in ``train_entry.dataprep``.
"""

from __future__ import annotations

import torch

from train_entry.dataprep.store import IGNORE


def causal_lm_loss(output, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the target tokens of the batch (labels already shifted)."""
    total, count = token_loss_sum(output, labels)
    return total / count.clamp(min=1)


def token_loss_sum(output, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = output.logits if hasattr(output, "logits") else output
    total = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )
    return total, (labels != IGNORE).sum()
