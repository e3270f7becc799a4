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


def test_host_memory_to_load_the_weights_follows_how_each_engine_reads_them():
    from dataclasses import replace

    shape = gpt_shape(BIG["vocab"], BIG["seq_len"], BIG["d"], BIG["layers"], BIG["heads"])
    model = shape.params * 4
    one_tensor = shape.largest_layer * 4
    est = by_name(shape, Setting(2, 8, None, 1, 1, "bf16"))
    # DDP and ZeRO-1/2 map the files: the node's ranks share the pages of one copy
    assert est["ddp"].host_load == est["zero2"].host_load == model and est["ddp"].host_load_shared
    # FSDP2 full: a 16th of the model and of one tensor; hybrid shards within the node only
    assert est["fsdp-full"].host_load == (model + one_tensor) // 16 and not est["fsdp-full"].host_load_shared
    assert est["fsdp-hybrid"].host_load == (model + one_tensor) // 8
    # ZeRO-3 partitions as it reads: its partition plus one tensor whole
    assert est["zero3"].host_load == model // 16 + one_tensor
    # QLoRA loads through from_pretrained: the 4-bit base whole on every rank
    q = by_name(replace(shape, method="qlora", trainable=10**6, quantized=shape.params, quant_bits=4.0), Setting(1, 8, None, 1, 1, "bf16"))
    assert q["ddp"].host_load == shape.params // 2 and not q["ddp"].host_load_shared


def test_plan_command_text_and_json(home):
    big = ["--set", "model.d_model=4096", "--set", "model.n_layer=32", "--set", "model.n_head=32", "--set", "model.seq_len=2048",
           "--set", "data.vocab_size=32000", "--set", "batch.micro_batch_size=1", "--set", "engine.precision=bf16",
           "--set", "resources.tasks_per_node=8"]
    out = cli("plan", "configs/smoke.yaml", *big, "--gpu-memory", "40G", "--nodes", "4", "--json", home=home)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["setting"]["world_size"] == 32 and doc["spec_engine"] == "ddp"
    assert doc["recommendation"]["name"] == "zero3" and "cheapest that fits" in doc["recommendation"]["reason"]
    text = cli("plan", "configs/smoke.yaml", *big, "--gpu-memory", "40G", home=home)
    assert text.returncode == 0 and "recommended: " in text.stdout and "zero3-offload-all" in text.stdout
    assert "read the weights" not in text.stdout  # the built-in model reads none
    assert all(e["host_load"] > 0 for e in doc["engines"])
    bad = cli("plan", "configs/smoke.yaml", "--gpu-memory", "lots", home=home)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --gpu-memory") and "Traceback" not in bad.stderr
    assert not (home / "ledger.db").exists()  # planning records nothing


# ---------------------------------------------------------------- model kind hf


def _hf_libs():
    if not os.environ.get("CI"):  # CI installs the hf extra, so there it must run
        pytest.importorskip("transformers")
        pytest.importorskip("peft")


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    import sys

    from conftest import REPO

    _hf_libs()
    sys.path.insert(0, str(REPO / "tests" / "hf"))
    import tiny

    base = tmp_path_factory.mktemp("tiny")
    return {tie: tiny.make_model(base / f"tie-{tie}", layers=3, tie=tie) for tie in (True, False)}


@pytest.mark.parametrize("tie", [True, False])
def test_hf_shape_from_the_config_is_the_loaded_models(tiny_models, tie):
    import torch
    from transformers import AutoModelForCausalLM

    from orchestrator.submit import hf_shape

    real = AutoModelForCausalLM.from_pretrained(tiny_models[tie])
    shape = hf_shape.shape_of_model(hf_shape.meta_model(tiny_models[tie]))
    assert shape.params == sum(p.numel() for p in real.parameters())  # tied embeddings once
    assert shape.largest_layer == max(sum(p.numel() for p in m.parameters(recurse=False)) for m in real.modules())
    assert shape.unit == sum(p.numel() for p in real.model.layers[0].parameters())
    linear = {n: m for n, m in real.named_modules() if isinstance(m, torch.nn.Linear)}
    assert shape.linear == {n: (m.in_features, m.out_features) for n, m in linear.items()}
    assert shape.quantizable == sum(m.weight.numel() for n, m in linear.items() if n != "lm_head")
    assert (shape.layers, shape.d_model, shape.n_head, shape.max_positions) == (3, 64, 4, 1024)


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["gate_proj", "up_proj", "down_proj", "lm_head"],
                                     ["self_attn.o_proj", "embed_tokens"]])
def test_lora_trainable_count_is_peft_s(tiny_models, targets):
    import peft
    from transformers import AutoModelForCausalLM

    from orchestrator.submit import hf_shape

    real = AutoModelForCausalLM.from_pretrained(tiny_models[False])
    wrapped = peft.get_peft_model(real, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM"))
    expected = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    assert hf_shape.lora_trainable(tiny_models[False], None, 4, 8, targets) == (expected, "peft")
    assert hf_shape.lora_by_shapes(hf_shape.meta_model(tiny_models[False]), 4, targets) == expected  # without peft


def _hf_spec_file(tmp_path, model):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    spec = tmp_path / "hf.yaml"
    spec.write_text(f"name: p\nsteps: 2\nmodel: {{kind: hf, path: {model}}}\ndata: {{kind: jsonl, path: {data}, format: instruction}}\n")
    return spec


def _hf_spec(tmp_path, model, **sets):
    from orchestrator.spec.load import load_spec

    return load_spec(_hf_spec_file(tmp_path, model), [f"{k}={v}" for k, v in sets.items()])[0]


def test_plan_of_an_hf_model_counts_states_for_what_trains(tiny_models, tmp_path):
    from orchestrator.submit import hf_shape
    from orchestrator.submit.memory_inputs import setting_of, shape_of

    model = tiny_models[False]
    P = hf_shape.shape_of_model(hf_shape.meta_model(model)).params

    def ddp(**sets):
        spec = _hf_spec(tmp_path, model, **sets)
        shape = shape_of(spec)
        by = by_name(shape, setting_of(spec))
        return shape, by["ddp"], by

    shape, full, _ = ddp(**{"model.dtype": "bf16"})  # full fine-tune in bf16: weights, grads and moments in bf16
    assert shape.trainable is None and shape.params == P
    assert (full.params, full.grads, full.optimizer) == (2 * P, 2 * P, 4 * P)
    shape, lora, by = ddp(**{"model.lora": "{r: 4, target_modules: [q_proj, v_proj]}"})
    T = shape.trainable
    assert shape.method == "lora" and T == hf_shape.lora_trainable(model, None, 4, 32, ["q_proj", "v_proj"])[0]
    assert (lora.params, lora.grads, lora.optimizer) == (4 * P + 4 * T, 4 * T, 8 * T)  # Adam for the adapters only
    # DeepSpeed (bf16) casts the frozen base to 16 bits; ZeRO-3 partitions it, ZeRO-1 the adapters' states only
    shape, _, by = ddp(**{"model.lora": "{r: 4}", "engine.precision": "bf16", "resources.tasks_per_node": 4})
    T = shape.trainable
    assert by["zero1"].params == 2 * P + 2 * T and by["zero1"].optimizer == 12 * T // 4
    assert by["zero3"].params == 2 * P // 4 + 2 * T // 4
    shape, q, by = ddp(**{"model.qlora": "{r: 4}", "model.dtype": "bf16"})
    assert shape.method == "qlora" and not any(n.startswith("fsdp") for n in by)  # the spec refuses FSDP with QLoRA
    assert shape.quantized == sum(i * o for n, (i, o) in hf_shape.shape_of_model(hf_shape.meta_model(model)).linear.items()
                                  if n != "lm_head")


def test_qlora_base_bytes_are_what_bitsandbytes_stores(tiny_models, tmp_path):
    """The 4-bit accounting (4.5 bits a weight, about 4.13 with double quantisation; fp32
    for the rest after peft's preparation) against a model bitsandbytes quantised."""
    _hf_libs()
    pytest.importorskip("bitsandbytes")
    import peft
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from orchestrator.submit.memory_inputs import setting_of, shape_of

    model = tiny_models[False]
    for dq in (True, False):
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=dq,
                               bnb_4bit_compute_dtype=torch.bfloat16)
        try:
            real = AutoModelForCausalLM.from_pretrained(model, quantization_config=q, dtype=torch.bfloat16, device_map="cpu")
        except (RuntimeError, ImportError, ValueError) as exc:  # no 4-bit backend for this machine
            pytest.skip(f"bitsandbytes cannot quantise here: {exc}")
        real = peft.prepare_model_for_kbit_training(real, use_gradient_checkpointing=False)
        real = peft.get_peft_model(real, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
        measured = 0
        for p in real.parameters():
            measured += p.numel() * p.element_size()
            if type(p).__name__ == "Params4bit":
                qs = p.quant_state
                measured += qs.absmax.numel() * qs.absmax.element_size()
                if qs.nested:
                    measured += qs.state2.absmax.numel() * qs.state2.absmax.element_size()
        spec = _hf_spec(tmp_path, model, **{"model.qlora": f"{{r: 4, target_modules: [q_proj, v_proj], double_quant: {str(dq).lower()}}}",
                                            "model.dtype": "bf16"})
        est = by_name(shape_of(spec), setting_of(spec))["ddp"]
        assert abs(est.params - measured) <= 0.01 * measured, (dq, est.params, measured)


def test_plan_command_for_an_hf_model(home, tiny_models, tmp_path):
    _hf_libs()
    spec = _hf_spec_file(tmp_path, tiny_models[True])
    out = cli("plan", str(spec), "--set", "model.lora={r: 4}", "--gpu-memory", "8G", "--json", home=home)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["model"]["method"] == "lora" and doc["model"]["counted_by"] == "meta, adapters by peft"
    text = cli("plan", str(spec), "--set", "model.lora={r: 4}", "--gpu-memory", "8G", home=home)
    assert text.returncode == 0 and text.stderr == "", text.stderr
    assert "LoRA: trainable " in text.stdout and "frozen, fp32" in text.stdout and "recommended: ddp" in text.stdout
    assert "host memory per rank to read the weights: ddp " in text.stdout and "the node's ranks share their pages" in text.stdout
    engines = {e["name"]: e for e in doc["engines"]}
    ddp, fsdp, world = engines["ddp"], engines["fsdp-full"], doc["setting"]["world_size"]
    assert ddp["host_load_shared"] and not fsdp["host_load_shared"]
    assert fsdp["host_load"] == (ddp["host_load"] + doc["model"]["largest_layer"] * 4) // world
    assert not (home / "ledger.db").exists()
