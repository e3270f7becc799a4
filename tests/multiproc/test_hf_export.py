"""A checkpoint of a `model: {kind: hf}` run becomes a Hugging Face folder that loads
(train_entry.consolidate.hf): the job's final step writes it into the task's weights/.

One experiment trains the tiny model (tests/hf/tiny.py) six ways at once: a full fine-tune
on each of DDP, FSDP2, ZeRO-2 and ZeRO-3 (two of them with activation checkpointing, whose
wrappers DeepSpeed keeps in its names), and LoRA and QLoRA with merge_lora. The exported weights are
compared with the checkpoint as torch's and DeepSpeed's own tools read it.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from conftest import REPO, cli, write
from orchestrator import contract

sys.path.insert(0, str(REPO / "tests" / "hf"))
import tiny  # noqa: E402

torch = pytest.importorskip("torch")
if not __import__("os").environ.get("CI"):  # CI installs the hf extra, so there it must run
    pytest.importorskip("transformers")
    pytest.importorskip("peft")

SPEC = """\
name: hf-export
model: {{kind: hf, path: {model}}}
data: {{kind: jsonl, path: {data}, max_length: 48}}
engine: {{kind: ddp}}
optimizer: {{lr: 1.0e-2}}
batch: {{micro_batch_size: 2}}
steps: 3
checkpoint: {{consolidate: {{}}}}
resources: {{tasks_per_node: 2}}
logging: {{every_steps: 1}}
sweep:
  points:
    - {{engine: {{kind: ddp}}}}
    - {{engine: {{kind: fsdp, activation_checkpointing: true}}}}
    - {{engine: {{kind: deepspeed, stage: 2, activation_checkpointing: true}}}}
    - {{engine: {{kind: deepspeed, stage: 3}}}}
    - {{model.lora: {{r: 4, alpha: 8, target_modules: [q_proj, v_proj, down_proj]}}, model.export: {{merge_lora: true}}}}
    - {{model.qlora: {{r: 4, alpha: 8, target_modules: [q_proj, v_proj, down_proj], compute_dtype: fp32}},
       model.export: {{merge_lora: true}}}}
"""
FULL = {0: "ddp", 1: "fsdp", 2: "zero2", 3: "zero3"}
LORA, QLORA = 4, 5
PROMPT = [[1, 70, 80, 90, 100, 2, 1, 110]]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The experiment's task folders, by task index (trained and exported by the job)."""
    base = tmp_path_factory.mktemp("hfexport")
    model = tiny.make_model(base / "model")
    data = tiny.make_chat_data(base / "train.jsonl", n=32)
    spec = write(base / "exp.yaml", SPEC.format(model=model, data=data))
    home = base / "home"
    out = cli("submit", str(spec), "--executor", "local", "--wait", "--json", home=home, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    exp = json.loads(out.stdout)["experiments"][0]
    assert [t["state"] for t in exp["tasks"]] == ["COMPLETED"] * 6, exp["tasks"]
    return {"model": model, "home": home, "tasks": {t["index"]: contract.task_dir(exp["run_dir"], t["index"]) for t in exp["tasks"]}}


def _final_checkpoint(tdir: Path) -> Path:
    return contract.committed_checkpoints(tdir)[0][1]


def _reference(ckpt: Path, tmp: Path) -> dict:
    """The trained model's tensors as torch (DCP) or DeepSpeed (ZeRO) reads the checkpoint."""
    if (ckpt / "dcp").is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(str(ckpt / "dcp"), str(tmp / "whole.pt"))
        return torch.load(tmp / "whole.pt", weights_only=False)["model"]
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    (tag,) = [d.name for d in (ckpt / "deepspeed").iterdir() if d.is_dir()]
    sd = get_fp32_state_dict_from_zero_checkpoint(str(ckpt / "deepspeed"), tag=tag)
    return {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in sd.items()}


def _load(folder: Path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, dtype=torch.float32)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    return model.eval()


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(PROMPT)).logits


# ---------------------------------------------------------------- (a) full fine-tune, every engine


@pytest.mark.multiproc
@pytest.mark.parametrize("task", list(FULL), ids=list(FULL.values()))
def test_full_fine_tune_exports_a_model_folder_with_the_trained_weights(trained, tmp_path, task):
    from transformers import AutoTokenizer

    tdir = trained["tasks"][task]
    weights = contract.weights_dir(tdir)
    assert (weights / "config.json").is_file() and (weights / "generation_config.json").is_file()
    model = _load(weights)
    ref = _reference(_final_checkpoint(tdir), tmp_path)
    got = model.state_dict()
    assert set(got) <= set(ref), set(got) - set(ref)
    for name, tensor in got.items():
        assert torch.equal(tensor, ref[name].float()), name
    base = _load(trained["model"])
    assert not torch.equal(base.model.layers[0].self_attn.q_proj.weight, got["model.layers.0.self_attn.q_proj.weight"])
    # tied as the base is: lm_head is not stored, it is the embedding
    from safetensors import safe_open

    with safe_open(str(weights / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    tok = AutoTokenizer.from_pretrained(weights)
    assert tok.chat_template == tiny.CHAT_TEMPLATE
    events = [json.loads(line) for line in contract.events_path(tdir).read_text().splitlines()]
    assert any(e["event"] == "weights.consolidated" and "Hugging Face model folder" in e["cause"] for e in events)


# ---------------------------------------------------------------- (b) LoRA: adapter and merged


@pytest.mark.multiproc
@pytest.mark.parametrize("task", [LORA, QLORA], ids=["lora", "qlora"])
def test_lora_exports_an_adapter_and_a_merged_model_that_agree(trained, tmp_path, task):
    """QLoRA too: its adapters merge into the base as its folder stores it (full precision),
    which is what the adapter folder on that base computes."""
    import warnings

    from peft import PeftModel
    from safetensors.torch import load_file

    tdir = trained["tasks"][task]
    weights = contract.weights_dir(tdir)
    adapter, merged = weights / "adapter", weights / "merged"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["base_model_name_or_path"] == str(trained["model"])
    assert sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"] and config["task_type"] == "CAUSAL_LM"
    # the adapter's tensors are the checkpoint's, under peft's saved names
    saved = load_file(adapter / "adapter_model.safetensors")
    ref = _reference(_final_checkpoint(tdir), tmp_path)
    assert sorted(saved) == sorted(k.replace(".default", "") for k in ref) and len(saved) == 2 * 3 * 2
    for k, v in ref.items():
        assert torch.equal(saved[k.replace(".default", "")], v), k
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # peft warns of missing or unexpected adapter keys
        with_adapter = PeftModel.from_pretrained(_load(trained["model"]), adapter).eval()
    merged_model = _load(merged)
    base = _logits(_load(trained["model"]))
    a, m = _logits(with_adapter), _logits(merged_model)
    assert (a - m).abs().max() < 1e-4, (a - m).abs().max()
    assert (a - base).abs().max() > 1e-2, (a - base).abs().max()
    # only the adapted weights changed; the rest is the base's, bit for bit
    base_sd, merged_sd = _load(trained["model"]).state_dict(), merged_model.state_dict()
    changed = sorted(k for k in base_sd if not torch.equal(base_sd[k], merged_sd[k]))
    assert changed == sorted(f"model.layers.{i}.{m}.weight" for i in (0, 1)
                             for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")), changed
    for d in (adapter, merged):
        assert json.loads((d / "tokenizer_config.json").read_text()) and (d / "chat_template.jinja").is_file()


# ---------------------------------------------------------------- (c) a damaged hf.json


def _copy_checkpoint(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint ``src`` whose hf.json ``edit`` changed (a dict -> dict, or bytes -> bytes)."""
    shutil.copytree(src, dst)
    raw = (dst / contract.HF_EXPORT).read_bytes()
    (dst / contract.HF_EXPORT).write_bytes(edit(raw))
    return dst


def _rehash(folder: Path) -> None:
    """As if the damage were saved with the checkpoint: the manifest agrees with hf.json."""
    manifest = json.loads((folder / contract.MANIFEST).read_text())
    path = folder / contract.HF_EXPORT
    manifest["files"][contract.HF_EXPORT] = {"size": path.stat().st_size, "sha256": contract.file_sha256(path)}
    (folder / contract.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.multiproc
def test_a_damaged_hf_json_is_a_clear_error(trained, tmp_path):
    src = _final_checkpoint(trained["tasks"][LORA])
    home = trained["home"]

    def consolidate(folder: Path, *extra: str):
        out = cli("ckpt", "consolidate", str(folder), "--out", str(tmp_path / f"out-{folder.name}"), *extra, home=home)
        assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
        assert not (tmp_path / f"out-{folder.name}").exists()  # nothing written, nothing half-written
        return out.stderr.strip()

    # same size, other bytes: the manifest's sha256 says so
    flipped = _copy_checkpoint(src, tmp_path / "flipped", lambda b: b.replace(b'"r":4', b'"r":0'))
    err = consolidate(flipped)
    assert "hf.json" in err and "sha256" in err, err

    def edited(change):
        def edit(raw):
            doc = json.loads(raw)
            change(doc)
            return json.dumps(doc).encode()
        return edit

    # damaged but consistent with its manifest: every field is checked
    cases = {
        "rank": (lambda d: d["adapter"].update(r=0), "adapter.r: 0 is out of range"),
        "targets": (lambda d: d["adapter"].update(target_modules="q_proj; rm -rf /"), "adapter.target_modules: not a list"),
        "not-json": (None, "not JSON"),
        "relative": (lambda d: d["base"].update(path="../model"), "base.path: '../model' is not an absolute path"),
        "moved": (lambda d: d["base"].update(path=str(tmp_path / "nowhere")), "is not there; if it moved, give its new place with --base"),
    }
    for name, (change, message) in cases.items():
        folder = _copy_checkpoint(src, tmp_path / name, (lambda b: b[:-5]) if change is None else edited(change))
        _rehash(folder)
        err = consolidate(folder)
        assert message in err, (name, err)
    # --base: the moved model found again, and checked to be the same one
    other = tiny.make_model(tmp_path / "other-model", hidden=32)
    err = consolidate(tmp_path / "moved", "--base", str(other))
    assert "config.json is not the one this checkpoint was trained from" in err, err
    shutil.copytree(trained["model"], tmp_path / "moved-model")
    out = cli("ckpt", "consolidate", str(tmp_path / "moved"), "--out", str(tmp_path / "found"), "--base",
              str(tmp_path / "moved-model"), home=home)
    assert out.returncode == 0, out.stderr
    assert "PEFT adapter folder" in out.stdout and (tmp_path / "found" / "merged" / "model.safetensors").is_file()
    # --no-hf: the tensors under the checkpoint's own names, as before
    out = cli("ckpt", "consolidate", str(src), "--out", str(tmp_path / "raw"), "--no-hf", home=home)
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "raw" / "config.json").exists() and (tmp_path / "raw" / "model.safetensors").is_file()


# ---------------------------------------------------------------- names and records (no training)


def test_checkpoint_names_map_to_the_model_and_to_peft():
    from train_entry.consolidate import ConsolidateError, hfnames

    keys = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "lm_head.weight"]
    tied = {"lm_head.weight": "model.embed_tokens.weight"}
    names = ["model.embed_tokens.weight", "model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight", "lm_head.weight"]
    assert hfnames.full_model_names(names, keys, tied) == {
        "model.embed_tokens.weight": "model.embed_tokens.weight",
        "model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight": "model.layers.0.mlp.up_proj.weight",
    }
    with pytest.raises(ConsolidateError, match="missing: model.layers.0.mlp.up_proj.weight"):
        hfnames.full_model_names(["model.embed_tokens.weight"], keys, tied)
    with pytest.raises(ConsolidateError, match="not in the model: base_model.model.x.lora_A.default.weight; a LoRA checkpoint"):
        hfnames.full_model_names(names + ["base_model.model.x.lora_A.default.weight"], keys, tied)
    t = hfnames.adapter_tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight")
    assert (t.module, t.part, t.embedding, t.weight) == ("model.layers.0.self_attn.q_proj", "B", False, "model.layers.0.self_attn.q_proj.weight")
    assert t.saved == "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    e = hfnames.adapter_tensor("base_model.model.model.embed_tokens.lora_embedding_A.default")
    assert e.embedding and e.saved == "base_model.model.model.embed_tokens.lora_embedding_A"
    assert hfnames.adapter_tensor("base_model.model.model.norm.weight") is None
    assert hfnames.adapter_tensor("base_model.model.model.layers.0.q_proj.lora_A.other.weight") is None
    assert hfnames.targeted("model.layers.0.self_attn.q_proj", ["q_proj"])
    assert not hfnames.targeted("model.layers.0.self_attn.qq_proj", ["q_proj"])


def test_an_export_record_is_validated_field_by_field(tmp_path):
    from train_entry.consolidate import ConsolidateError, hfrecord

    good = {"format": 1, "base": {"path": str(tmp_path), "gguf_file": None, "config_sha256": None, "weights": {}},
            "model_type": "llama", "tie_word_embeddings": True, "merge_lora": True, "dtype": "bf16",
            "adapter": {"r": 8, "alpha": 16.0, "dropout": 0.05, "target_modules": ["q_proj"], "qlora": True}}
    rec = hfrecord._parse(tmp_path / "hf.json", good)
    assert rec.adapter.scale == 2.0 and rec.base == tmp_path and rec.merge_lora
    bad = [
        ({"format": 2}, "format"), ({"dtype": "int8"}, "dtype"), ({"merge_lora": "yes"}, "merge_lora"),
        ({"base": {**good["base"], "gguf_file": "../x.gguf"}}, "base.gguf_file"),
        ({"base": {**good["base"], "weights": {"a.safetensors": -1}}}, "base.weights"),
        ({"base": {**good["base"], "config_sha256": "abc"}}, "base.config_sha256"),
        ({"adapter": {**good["adapter"], "r": True}}, "adapter.r"),
        ({"adapter": {**good["adapter"], "alpha": float("nan")}}, "adapter.alpha"),
        ({"adapter": {**good["adapter"], "target_modules": []}}, "adapter.target_modules"),
        ({"adapter": None}, "merge_lora: true without an adapter"),
        ({"model_type": "llama; x"}, "model_type"),
    ]
    for change, field in bad:
        with pytest.raises(ConsolidateError, match=field.replace(".", r"\.")):
            hfrecord._parse(tmp_path / "hf.json", {**good, **change})


def test_the_spec_refuses_exports_that_cannot_be_written(tmp_path):
    from orchestrator.errors import SpecError
    from orchestrator.spec.load import load_spec

    base = "name: x\nsteps: 3\nmodel: {{kind: hf, path: {p}{model}}}\ndata: {{kind: jsonl, path: d.jsonl}}\ncheckpoint: {{consolidate: {c}}}\n"
    for model, c, message in [
        ("", "{format: torch}", "checkpoint.consolidate.format"),
        (", gguf_file: m.gguf, lora: {}, export: {merge_lora: true}", "{}", "a GGUF base gets the adapter folder only"),
    ]:
        spec = write(tmp_path / "s.yaml", base.format(p=tmp_path, model=model, c=c))
        with pytest.raises(SpecError, match=message):
            load_spec(spec)
    load_spec(write(tmp_path / "s.yaml", base.format(p=tmp_path, model=", lora: {}, export: {merge_lora: true}", c="{}")))
