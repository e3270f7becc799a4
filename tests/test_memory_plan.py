"""`orchestrate plan`: memory figures against DeepSpeed's estimators and the real model,
and a recommendation that moves the right way with GPU memory and node count."""

import json
import os

import pytest

from conftest import cli
from orchestrator.submit.memory_plan import CANDIDATES, GIB, Setting, estimate, gpt_shape, plan

BIG = dict(vocab=32000, seq_len=2048, d=4096, layers=32, heads=32)  # a 6.7 B parameter GPT


@pytest.mark.parametrize("dims", [(32, 64, 128, 2, 4), (256, 128, 64, 3, 2), (1000, 32, 96, 1, 3)])
def test_parameter_count_of_the_built_in_model_is_exact(dims):
    from train_entry.models import GPT

    vocab, seq, d, layers, heads = dims
    model = GPT(vocab, seq, d, layers, heads)
    shape = gpt_shape(vocab, seq, d, layers, heads)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.largest_layer == max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    assert shape.unit == sum(p.numel() for p in model.blocks[0].parameters())


def by_name(shape, setting):
    return {c.name: e for c in CANDIDATES if (e := estimate(c, shape, setting)) is not None}


@pytest.mark.parametrize("gpus_per_node, nodes", [(1, 1), (8, 1), (4, 2), (8, 16)])
def test_model_states_agree_with_deepspeeds_estimators(gpus_per_node, nodes):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    shape = gpt_shape(BIG["vocab"], BIG["seq_len"], BIG["d"], BIG["layers"], BIG["heads"])
    est = by_name(shape, Setting(nodes, gpus_per_node, None, 1, 1, "bf16"))
    P, L = shape.params, shape.largest_layer

    def close(ours, theirs):
        assert abs(ours - theirs) <= 0.05 * theirs, (ours, theirs)

    z2 = lambda off: estimate_zero2_model_states_mem_needs(P, gpus_per_node, nodes, cpu_offload=off)  # noqa: E731
    z3 = lambda off, offp: estimate_zero3_model_states_mem_needs(P, L, gpus_per_node, nodes, off, offp)  # noqa: E731
    close(est["zero2"].model_states, z2(False)[1])
    close(est["zero2-offload-optimizer"].model_states, z2(True)[1])
    close(est["zero3"].model_states, z3(False, False)[1])
    close(est["zero3-offload-optimizer"].model_states, z3(True, False)[1])
    close(est["zero3-offload-all"].model_states, z3(True, True)[1])
    # CPU side of ZeRO-3 offload, per node with DeepSpeed's 1.5 buffer factor
    close(est["zero3-offload-optimizer"].offloaded * gpus_per_node * 1.5, z3(True, False)[0])
    close(est["zero3-offload-all"].offloaded * gpus_per_node * 1.5, z3(True, True)[0])


def cost(rec, doc):
    """The planner's own cost order, with communication per byte of the ring (a ring over
    more ranks moves a little more per rank for the same engine)."""
    engines = {e["name"]: e for e in doc["engines"]}
    e, n = engines[rec["name"]], doc["setting"]["world_size"]
    return (e["offload_level"], rec["activation_checkpointing"], round(e["comm_bytes"] * n / (n - 1)))


def test_recommendation_gets_cheaper_with_more_memory_and_more_nodes():
    shape = gpt_shape(BIG["vocab"], BIG["seq_len"], BIG["d"], BIG["layers"], BIG["heads"])
    def never_dearer(settings):
        costs = [cost((doc := plan(shape, st))["recommendation"], doc) for st in settings]
        assert costs == sorted(costs, reverse=True), costs

    for nodes in (1, 2, 4):  # more memory per GPU
        never_dearer([Setting(nodes, 8, mem * GIB, 1, 1, "bf16") for mem in (24, 40, 80, 141)])
    for mem in (16, 24, 40):  # more nodes
        never_dearer([Setting(nodes, 8, mem * GIB, 1, 1, "bf16") for nodes in (1, 2, 4, 8)])
    # the extremes: too little memory is said plainly; plenty needs no sharding of parameters
    tiny = plan(shape, Setting(1, 8, 2 * GIB, 1, 1, "bf16"))["recommendation"]
    assert tiny["name"] is None and "add nodes" in tiny["reason"]
    roomy = plan(shape, Setting(1, 8, 141 * GIB, 1, 1, "bf16"))["recommendation"]
    assert roomy["name"] == "zero1" and not roomy["activation_checkpointing"]
    small = gpt_shape(32, 64, 128, 2, 4)
    assert plan(small, Setting(1, 2, 4 * GIB, 8, 1, "fp32"))["recommendation"]["name"] == "ddp"
    squeezed = plan(shape, Setting(1, 8, 24 * GIB, 1, 1, "bf16"))["recommendation"]
    assert squeezed["name"] in ("zero3", "fsdp-full") and squeezed["activation_checkpointing"], squeezed


def test_plan_command_text_and_json(home):
    big = ["--set", "model.d_model=4096", "--set", "model.n_layer=32", "--set", "model.n_head=32", "--set", "model.seq_len=2048",
           "--set", "data.vocab_size=32000", "--set", "batch.micro_batch_size=1", "--set", "engine.precision=bf16",
           "--set", "resources.tasks_per_node=8"]
    out = cli("plan", "configs/quickstart.yaml", *big, "--gpu-memory", "40G", "--nodes", "4", "--json", home=home)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["setting"]["world_size"] == 32 and doc["spec_engine"] == "ddp"
    assert doc["recommendation"]["name"] == "zero3" and "cheapest that fits" in doc["recommendation"]["reason"]
    text = cli("plan", "configs/quickstart.yaml", *big, "--gpu-memory", "40G", home=home)
    assert text.returncode == 0 and "recommended: " in text.stdout and "zero3-offload-all" in text.stdout
    bad = cli("plan", "configs/quickstart.yaml", "--gpu-memory", "lots", home=home)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --gpu-memory") and "Traceback" not in bad.stderr
    assert not (home / "ledger.db").exists()  # planning records nothing
