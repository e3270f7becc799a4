"""`scripts/gpu-check --device cpu --quick`: the GPU check end to end in its CPU mode, so the
script a lent GPU runs in one call is known to work before one is lent: every case ran (fp16
said not run, with why), the kill -9 twin resumed and matched its uninterrupted peer bit for
bit, the async save and the Trainer's peer were measured, `pytest -m gpu` ran (skipped
without CUDA), and the report has the shape it has on a GPU."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.multiproc


@pytest.mark.timeout(900)
def test_the_gpu_check_runs_end_to_end_in_its_cpu_mode(tmp_path):
    out = subprocess.run([sys.executable, "scripts/gpu-check", "--device", "cpu", "--quick", "--out", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=840)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu-check.json").read_text())
    cases = {c["case"]: c for c in doc["cases"]}
    assert list(cases) == ["gpt-ddp", "gpt-fsdp2", "gpt-zero2", "gpt-zero3", "gpt-ddp-kill9", "gpt-zero2-fp16",
                           "gpt-ddp-2ranks-gloo", "hf-lora-ddp", "hf-trainer-lora", "hf-full-zero3", "pytest -m gpu"]
    trained = [c for c in doc["cases"] if c["engine"]["kind"] not in ("tests",) and c.get("state") != "NOT RUN"]
    for c in trained:
        assert c["state"] == "COMPLETED" and c["ok"] and math.isfinite(c["last_loss"]) and c["tokens_per_s"] != 0, c
    assert all(c["plan_peak_gib"] > 0 for c in trained if c["engine"]["kind"] != "hf-trainer")  # `orchestrate plan` beside each
    kill = cases["gpt-ddp-kill9"]
    assert kill["kill"]["killed_at"] and kill["kill"]["resumed"].startswith("resumed from step") and kill["bitwise"] is True, kill
    assert cases["gpt-zero2-fp16"]["state"] == "NOT RUN" and "GPUs only" in cases["gpt-zero2-fp16"]["error"]
    assert cases["gpt-ddp"]["async_save"]["saves"] >= 1 and cases["gpt-ddp"]["async_save"]["gb_per_s"] > 0
    assert cases["hf-trainer-lora"]["tokens_per_s"] > 0 and cases["hf-trainer-lora"]["ratio"] > 0
    assert cases["pytest -m gpu"]["ok"] and "skipped" in cases["pytest -m gpu"]["tests"]
    md = (tmp_path / "GPU.md").read_text()
    assert md.startswith("# GPU check: cpu") and "| case | engine | state |" in md
    for said in ("**Async save**", "**kill -9 and resume**", "bit for bit: yes", "**orchestrate / Hugging Face Trainer**",
                 "**`pytest -m gpu`**"):
        assert said in md, md
