"""Fine-tuning a Hugging Face model (model kind hf, data kind jsonl) on every engine.

The model is a tiny random Llama with a byte-level tokenizer (tests/hf/tiny.py), so each
run takes seconds; the real pretrained model is tested in test_quickstart.py.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import REPO, cli, write
from orchestrator import contract
from orchestrator.ledger import Ledger

sys.path.insert(0, str(REPO / "tests" / "hf"))
import tiny  # noqa: E402

import torch  # noqa: E402


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> Path:
    return tiny.make_chat_data(tmp_path_factory.mktemp("data") / "train.jsonl", n=64)


# ---------------------------------------------------------------- data: packing (masking: tests/unit/test_dataprep.py)


def _examples(cache, n=6):
    from train_entry.dataprep import ranks

    tok = tiny.tokenizer()
    path = tiny.make_chat_data(Path(tempfile.mkdtemp()) / "d.jsonl", n=n, seed=3)
    return tok, ranks.find_or_prepare(ranks.Source([str(path)], "chat"), tok, str(cache), ranks.Unwatched(), lambda line: None)


def test_packed_rows_give_each_example_the_loss_it_has_alone(tiny_model, tmp_path):
    """Position ids restart per example and no example attends to another: the per-token
    losses of a packed row are those of each example run alone."""
    import numpy as np
    from transformers import AutoModelForCausalLM

    from train_entry.dataprep import store

    tok, ex = _examples(tmp_path / "cache", n=8)
    idx = store.usable(ex, np.arange(len(ex)), 128)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model.config.use_cache = False
    model.eval()
    packed, rows = store.Packed(ex, idx, 128, tok.pad_token_id), store.Rows(ex, idx, 128, tok.pad_token_id)
    assert len(packed) < len(idx)  # several examples share a row
    with torch.no_grad():
        alone = []
        for e in idx.tolist():
            inputs, labels = rows.collate([e])
            logits = model(**inputs).logits
            alone.append(torch.nn.functional.cross_entropy(logits[0].float(), labels[0], ignore_index=-100, reduction="none"))
        together = []
        for r in range(len(packed)):
            inputs, labels = packed.collate([packed[r]])
            assert "attention_mask" not in inputs
            logits = model(**inputs).logits
            per_token = torch.nn.functional.cross_entropy(logits[0].float(), labels[0], ignore_index=-100, reduction="none")
            at = 0
            for e in packed[r]:
                k = len(ex.tokens(e, 128)[0])
                together.append(per_token[at : at + k])
                at += k
    assert len(together) == len(alone)
    for a, b in zip(alone, together):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


def test_the_examples_batched_answers_are_the_one_at_a_time_answers(tiny_model):
    from train_entry.examples import chat_task

    model, tok = chat_task.load(str(tiny_model))
    prompts = [r["messages"][:-1] for r in chat_task.records(7, seed=0, heldout=True)]  # prompts of different lengths
    assert chat_task.answers(model, tok, prompts, max_new_tokens=8, batch=4) == chat_task.answers(model, tok, prompts, 8, batch=1)
    assert tok.padding_side == tiny.tokenizer().padding_side  # put back as found


def test_only_the_bitsandbytes_kernel_message_is_dropped():
    import logging

    from train_entry.hf import quiet

    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    logger = logging.getLogger(quiet.BNB_CPU_LOGGER)
    logger.addHandler(handler)
    try:
        quiet.drop_bitsandbytes_kernel_warning()
        quiet.drop_bitsandbytes_kernel_warning()  # repeatable: one filter
        logger.warning("%s: %s. Please make sure you already `pip install kernels`", quiet.BNB_KERNEL_MESSAGE, "No module named 'kernels'")
        logger.warning("something else went wrong")
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in seen] == ["something else went wrong"] and len(logger.filters) == 1


def test_bitsandbytes_stays_out_of_a_rank_whose_model_is_not_4_bit(tiny_model, tmp_path):
    """peft imports it whenever installed (a second of a core per rank): kept out unless
    QLoRA, or a folder whose weights are quantised, needs it; what peft asks then says absent."""
    import importlib.util
    import shutil

    from train_entry.hf import load

    quantised = shutil.copytree(tiny_model, tmp_path / "quantised")
    cfg = json.loads((quantised / "config.json").read_text())
    (quantised / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"load_in_4bit": True}}))
    before = sys.modules.pop("bitsandbytes", None)
    try:
        for mcfg, kept_out in [({"path": str(tiny_model), "qlora": {"r": 4}}, False), ({"path": str(quantised)}, False),
                               ({"path": str(tiny_model)}, True)]:
            sys.modules.pop("bitsandbytes", None)
            load.load_tokenizer(mcfg)
            assert ("bitsandbytes" in sys.modules) == kept_out and sys.modules.get("bitsandbytes") is None, mcfg
            assert (importlib.util.find_spec("bitsandbytes") is None) == kept_out, mcfg
    finally:
        sys.modules.pop("bitsandbytes", None)
        if before is not None:
            sys.modules["bitsandbytes"] = before


# ---------------------------------------------------------------- training on every engine

SPEC = """\
name: hf-resume
model: {{kind: hf, path: {model}, {adapter}}}
data: {{kind: {kind}, path: {data}, max_length: 48, packing: {packing}, eval_fraction: 0.25}}
eval: {{every_steps: 4, max_batches: 2}}
engine: {engine}
optimizer: {{lr: 1.0e-2}}
batch: {{micro_batch_size: 2, grad_accum: 2}}
steps: 12
checkpoint: {{every_steps: 3, keep_last: 2}}
resources: {{tasks_per_node: 2}}
logging: {{every_steps: 1}}
heartbeat: {{interval_s: 0.5}}
sweep: {{grid: {{env.RUN: [plain, interrupted]}}}}
"""

# the adapter-only checkpoint's three layouts: replicated (DDP), DCP shards (FSDP2), partitioned
# (ZeRO-3); ZeRO-2 keeps its parameters whole as DDP does, and its partitioned optimizer is
# resumed for every model in test_resume
ENGINES = {
    "ddp": "{kind: ddp}",
    "fsdp": "{kind: fsdp}",
    "zero3": "{kind: deepspeed, stage: 3}",
}


@pytest.mark.multiproc
@pytest.mark.parametrize("engine", list(ENGINES))
def test_lora_interrupted_and_resumed_matches_the_uninterrupted_run_bitwise(home, tmp_path, tiny_model, chat_data, engine):
    from test_resume import run_and_interrupt

    spec = write(tmp_path / "exp.yaml", SPEC.format(model=tiny_model, data=chat_data, kind="jsonl", engine=ENGINES[engine],
                                                    adapter="lora: {r: 4, alpha: 8, dropout: 0.1}", packing="true")
                 # 12 steps of this model take about 2 s: each sleeps 0.4 s more, so that the signal
                 # sent after step 6 comes well before the last (the losses do not change)
                 + "env: {ORCHESTRATE_FAULT_SLOW_STEP_S: '0.4'}\n")
    exp = run_and_interrupt(home, spec, 6)
    assert exp["state"] == "COMPLETED", exp
    ledger = Ledger.open(home / "ledger.db")
    plain = {m["step"]: (m["loss"], m["eval_loss"]) for m in ledger.metrics(exp["id"], 0)}
    resumed = {m["step"]: (m["loss"], m["eval_loss"]) for m in ledger.metrics(exp["id"], 1)}
    assert sorted(plain) == sorted(resumed) == list(range(1, 13))
    assert resumed == plain, [(s, plain[s], resumed[s]) for s in plain if plain[s] != resumed[s]]
    assert [s for s, (_, e) in plain.items() if e is not None] == [4, 8, 12]
    assert plain[12][0] < plain[1][0] and plain[12][1] < plain[4][1]  # the loss and the eval loss fall
    assert [a["state"] for a in ledger.attempts(exp["id"], 1)] == ["REQUEUED", "COMPLETED"]
    verified = [e["cause"] for e in ledger.events(exp["id"]) if e["idx"] == 1 and e["kind"] == "checkpoint.verified"]
    assert len(verified) == 1 and "bitwise, same world size" in verified[0], verified  # adapters' fingerprint, and the loss
    # the data was tokenized once: by one task while the other waited (or found it done), and the
    # requeued launch reused it
    data = [(e["idx"], e["kind"]) for e in ledger.events(exp["id"]) if e["kind"] in ("data.prepared", "data.waited", "data.reused")]
    assert [k for _, k in data].count("data.prepared") == 1 and [k for i, k in data if i == 1][-1] == "data.reused", data
    assert len([k for i, k in data if i == 1]) == 2, data  # each launch of the interrupted task said which
    # LoRA checkpoints hold the adapters only: the frozen base comes from the model folder
    _, ckpt = contract.committed_checkpoints(contract.task_dir(exp["run_dir"], 1))[0]
    assert json.loads((ckpt / "hf.json").read_text())["adapter"]["r"] == 4
    size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    base = (tiny_model / "model.safetensors").stat().st_size
    assert size < base, (size, base)


@pytest.mark.multiproc
def test_full_fine_tune_and_qlora_train_with_the_eval_loss_in_status(home, tmp_path, tiny_model, chat_data):
    """... on records in two Parquet files named by a glob (the compute side reads what submit expanded)."""
    import datasets

    rows = [json.loads(line) for line in chat_data.read_text().splitlines()]
    for i, part in enumerate((rows[:40], rows[40:])):
        datasets.Dataset.from_list(part).to_parquet(str(tmp_path / f"train-{i}.parquet"))
    spec = write(tmp_path / "exp.yaml", SPEC.format(model=tiny_model, data="train-*.parquet", kind="parquet", engine="{kind: ddp}",
                                                    adapter="lora: null", packing="false"))
    out = cli("submit", str(spec), "--executor", "local", "--set", 'sweep={grid: {model.qlora: [null, {r: 4, alpha: 8, compute_dtype: fp32}]}}', "--wait", "--json", home=home)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    exp = json.loads(out.stdout)["experiments"][0]
    ledger = Ledger.open(home / "ledger.db")
    for task in exp["tasks"]:
        assert task["state"] == "COMPLETED" and task["eval_loss"] is not None, task
        losses = [m["loss"] for m in ledger.metrics(exp["id"], task["index"])]
        assert losses[-1] < losses[0] - 0.1, losses
    log = cli("logs", "hf-resume", "--task", "1", "--rank", "0", home=home).stdout
    assert "trainable parameters of" in log
    assert f"{tmp_path / 'train-0.parquet'} and 1 more: {len(rows) - len(rows) // 4} records" in log, log[-3000:]
