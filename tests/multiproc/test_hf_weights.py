"""A model's weights read without a second host copy (train_entry/hf/weights.py): under DDP
every weight is a view of the safetensors file's private map, equal to what
``from_pretrained`` gives; under FSDP2 the model is built empty, sharded, and each rank reads
only its rows, the gathered model equal to the unsharded one, adapters included; what the
files cannot give goes through ``from_pretrained`` and says why."""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, free_port

LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
DDP = {"kind": "ddp"}


def mcfg(path, lora=None, **kw):
    return {"path": str(path), "dtype": "fp32", "attn_implementation": "eager", "qlora": None, "gguf_file": None, "lora": lora, **kw}


def reference(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)


def mapping_of(t: torch.Tensor) -> tuple[str, str]:
    """(file, permissions) of the memory mapping a tensor's data lies in ("" for anonymous memory)."""
    ptr = t.data_ptr()
    for line in open("/proc/self/maps"):
        parts = line.split()
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= ptr < hi:
            return (parts[5] if len(parts) > 5 else ""), parts[1]
    raise AssertionError("not mapped at all")


def base_name(name: str) -> str:
    return name.removeprefix("base_model.model.").replace(".base_layer", "")


def test_under_ddp_every_weight_is_a_view_of_the_file_equal_to_from_pretrained(tiny_model):
    from train_entry.hf import load, weights

    loaded = load.load_model(mcfg(tiny_model, LORA), 7, None, DDP)
    assert loaded.how.startswith("mapped") and loaded.fill is None
    model, ref = loaded.model, reference(tiny_model).state_dict()
    state = model.state_dict()
    base = {base_name(k): v for k, v in state.items() if "lora_" not in k}
    assert base.keys() == ref.keys() and all(torch.equal(base[k], ref[k]) for k in ref)
    file = str(tiny_model / "model.safetensors")
    for name, p in model.named_parameters():
        if "lora_" in name:
            assert mapping_of(p)[0] != file and p.requires_grad
            assert torch.equal(p, weights.adapter_init(name, tuple(p.shape), 7)), name
        else:  # the file's pages, privately mapped (copy-on-write), not a copy
            assert mapping_of(p) == (file, "rw-p") and not p.requires_grad, name
    base_model = model.get_base_model()
    assert base_model.lm_head.weight is base_model.model.embed_tokens.weight  # tied as the folder says
    # the map is private: a write is this process's page, never the file's
    before = (tiny_model / "model.safetensors").read_bytes()
    with torch.no_grad():
        base_model.model.norm.weight.add_(1.0)
    assert (tiny_model / "model.safetensors").read_bytes() == before
    # a full fine-tune: the same values, every weight trainable
    full = load.load_model(mcfg(tiny_model), 7, None, DDP).model
    assert all(p.requires_grad for p in full.parameters())
    assert all(torch.equal(v, ref[k]) for k, v in full.state_dict().items())


def test_adapters_start_the_same_on_every_path(tiny_model):
    from train_entry.hf import load

    mapped = load.load_model(mcfg(tiny_model, LORA), 7, None, DDP)
    pretrained = load.load_model(mcfg(tiny_model, LORA, load="from_pretrained"), 7, None, DDP)
    assert pretrained.how == "from_pretrained"
    a, b = mapped.model.state_dict(), pretrained.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = load.load_model(mcfg(tiny_model, LORA), 8, None, DDP).model.state_dict()
    lora_a = [k for k in a if ".lora_A." in k]
    assert lora_a and not any(torch.equal(a[k], other[k]) for k in lora_a)  # the seed decides


def test_what_the_files_cannot_give_goes_through_from_pretrained_and_says_why(tiny_model, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from train_entry.hf import load, weights

    extra = tmp_path / "extra"
    shutil.copytree(tiny_model, extra)
    tensors = load_file(extra / "model.safetensors")
    save_file({**tensors, "stray.weight": torch.zeros(2)}, extra / "model.safetensors", metadata={"format": "pt"})
    loaded = load.load_model(mcfg(extra), 7, None, DDP)
    assert loaded.how.startswith("from_pretrained (the files hold 1 tensor(s) that are not parameters"), loaded.how
    # an index naming a file outside the folder is refused, never followed
    outside = tmp_path / "outside"
    shutil.copytree(tiny_model, outside)
    (outside / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    (outside / weights.INDEX).write_text(json.dumps({"weight_map": {k: "../elsewhere.safetensors" for k in tensors}}))
    with pytest.raises(weights.Unsupported, match="not a file of the folder"):
        weights.files(outside)
    missing = tmp_path / "missing"
    shutil.copytree(tiny_model, missing)
    save_file({k: v for k, v in tensors.items() if "norm" not in k}, missing / "model.safetensors", metadata={"format": "pt"})
    import transformers

    empty = weights.empty_model(transformers, str(missing), {"dtype": torch.float32, "attn_implementation": "eager"})
    with pytest.raises(weights.Unsupported, match="do not hold"):
        weights.Plan.of(missing, empty)
    # a tensor of another shape (a resized vocabulary): refused on every rank alike, from the headers
    resized = tmp_path / "resized"
    shutil.copytree(tiny_model, resized)
    save_file({**tensors, "model.embed_tokens.weight": tensors["model.embed_tokens.weight"][:-3]}, resized / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(weights.Unsupported, match=r"model.embed_tokens.weight is \[256, 64\] in the files, \[259, 64\] in the model"):
        weights.Plan.of(resized, empty)
    assert load.weights_route(mcfg(tiny_model, qlora={"r": 4}), DDP) is None
    assert load.weights_route(mcfg(tiny_model), {"kind": "deepspeed", "stage": 3}) == "partitioned"
    assert load.weights_route(mcfg(tiny_model, load="from_pretrained"), {"kind": "fsdp"}) is None
    nvme = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}
    assert load.weights_route(mcfg(tiny_model), {"kind": "deepspeed", "stage": 3}, nvme) is None  # pieces swapped out
    hpz = {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}
    assert load.weights_route(mcfg(tiny_model), {"kind": "deepspeed", "stage": 3}, hpz) is None
    assert load.weights_route(mcfg(tiny_model), {"kind": "fsdp"}) == "sharded"


def sharded(tmp_path, model, lora: bool, sharding: str) -> dict:
    """Two ranks of tests/workloads/sharded_load.py: the model gathered whole, and what each rank held."""
    out = tmp_path / f"{sharding}-{lora}"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, str(REPO / "tests" / "workloads" / "sharded_load.py"), str(model), str(out),
                               "1" if lora else "0", sharding], env={**env, "RANK": str(r)}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-3000:]
    from safetensors.torch import load_file

    return {"whole": load_file(out / "whole.safetensors"), "ranks": [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]}


@pytest.mark.multiproc
def test_under_fsdp2_each_rank_reads_its_rows_and_the_model_is_the_unsharded_one(tiny_model, tmp_path):
    from train_entry.hf import load

    ref = load.load_model(mcfg(tiny_model, LORA), 7, None, DDP).model
    want = {k: v for k, v in ref.state_dict().items() if k != "base_model.model.lm_head.weight"}  # tied: one parameter
    buffers = {k: v.tolist() for k, v in ref.named_buffers()}
    got = sharded(tmp_path, tiny_model, True, "full")
    assert got["whole"].keys() == want.keys() and all(torch.equal(got["whole"][k], want[k]) for k in want)
    for r in got["ranks"]:
        assert r["built_empty"] and r["how"].startswith("sharded") and r["buffers"] == buffers
    rows = [r["local_shapes"]["base_model.model.model.embed_tokens.weight"][0] for r in got["ranks"]]
    vocab = want["base_model.model.model.embed_tokens.weight"].shape[0]
    assert sum(rows) == vocab and rows[0] > rows[1]  # unequal pieces: 259 rows on 2 ranks


@pytest.mark.multiproc
def test_under_zero3_each_rank_reads_its_piece_and_the_model_is_the_unsharded_one(tiny_model, tmp_path):
    from train_entry.hf import load

    ref = load.load_model(mcfg(tiny_model, LORA), 7, None, DDP).model
    want = {k: v for k, v in ref.state_dict().items() if k != "base_model.model.lm_head.weight"}
    got = sharded(tmp_path, tiny_model, True, "zero3")
    assert got["whole"].keys() == want.keys() and all(torch.equal(got["whole"][k], want[k]) for k in want)
    for r in got["ranks"]:
        assert r["built_empty"] and r["how"].startswith("partitioned"), r["how"]
    vocab, hidden = want["base_model.model.model.embed_tokens.weight"].shape
    pieces = [r["local_shapes"]["base_model.model.model.embed_tokens.weight"][0] for r in got["ranks"]]
    assert pieces == [-(-vocab * hidden // 2)] * 2  # each rank held half the flat tensor, no more
