"""The LoRA fine-tuning example (transformers + peft) trains with DDP and DeepSpeed ZeRO-3."""

import json
import os
import re

import pytest

from conftest import cli
from orchestrator.ledger import Ledger

pytestmark = pytest.mark.multiproc

if not os.environ.get("CI"):  # CI installs the hf extra, so there it must run
    pytest.importorskip("peft")
    pytest.importorskip("transformers")


@pytest.mark.parametrize("engine", ["{kind: ddp}", "{kind: deepspeed, stage: 3}"])
def test_lora_example_trains_only_the_adapters_and_the_loss_falls(home, engine):
    out = cli(
        "submit", "configs/hf-lora.yaml", "--executor", "local", "--set", f"engine={engine}", "--set", "steps=60",
        "--wait", "--json", home=home,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (task,) = json.loads(out.stdout)["experiments"][0]["tasks"]
    assert task["state"] == "COMPLETED" and task["step"] == 60
    losses = [m["loss"] for m in Ledger.open(home / "ledger.db").metrics(json.loads(out.stdout)["experiments"][0]["id"], 0)]
    assert losses[0] - min(losses[-2:]) > 0.04, losses
    log = cli("logs", "hf-lora", "--rank", "0", home=home).stdout
    m = re.search(r"LoRA: ([\d,]+) trainable parameters of ([\d,]+)", log)
    trainable, total = (int(g.replace(",", "")) for g in m.groups())
    # exactly the adapters: r x (in + out) for c_attn (d->3d), c_proj (d->d), c_fc (d->4d), c_proj (4d->d)
    d, layers, r = 64, 2, 16
    assert trainable == layers * r * 16 * d and total > 4 * trainable, (trainable, total)
