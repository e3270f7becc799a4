"""Loading a model on 2 ranks: each rank's peak host memory while it reads a ~0.5 B-parameter
model (random weights, fp32 safetensors) into its engine, for DDP (memory-mapped files),
FSDP2 (built empty, sharded, each rank reading its shard's rows) and DeepSpeed ZeRO-3
(built partitioned, each rank reading its flat piece of each tensor), against the same engines loading through `from_pretrained` first
(`model.load: from_pretrained`, what every rank did before), and against the model's bytes.

    python bench/model_load.py [--layers 32] [--cases ddp,fsdp2,...] [--json]

Each rank is a fresh process (gloo, 1 thread) running the trainer's own `load_model` and
`build_engine`, then one LoRA forward and backward pass on 16 tokens, so every weight has
been read. Per rank: the baseline (RSS once torch, transformers, peft and DeepSpeed are
imported and the group joined), the load's peak (VmHWM once the engine holds the weights),
what the load added to the baseline against the model's bytes, and after the step the
proportional set size (PSS: a page the 2 ranks share counts half) and the mapped files'
pages. On CPU the step's gathered parameters are host memory too (on a GPU they are the
device's), so the step's peak is reported apart from the load's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, python  # noqa: E402

MODELS = Path("~/.cache/orchestrate/bench-models").expanduser()
LORA = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
CASES = {  # name: (engine, model.load)
    "ddp": ({"kind": "ddp"}, "auto"),
    "ddp-from_pretrained": ({"kind": "ddp"}, "from_pretrained"),
    "fsdp2": ({"kind": "fsdp", "sharding": "full"}, "auto"),
    "fsdp2-from_pretrained": ({"kind": "fsdp", "sharding": "full"}, "from_pretrained"),
    "zero3": ({"kind": "deepspeed", "stage": 3}, "auto"),
    "zero3-from_pretrained": ({"kind": "deepspeed", "stage": 3}, "from_pretrained"),
}


def make_model(layers: int) -> Path:
    """A Llama of ~0.5 B parameters at 32 layers (hidden 1024, MLP 2816, vocab 32000, untied), random, fp32."""
    out = MODELS / f"llama-h1024-l{layers}"
    if (out / "model.safetensors").exists() or (out / "model.safetensors.index.json").exists():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, max_shard_size="100GB")
    tmp.rename(out)
    return out


def status() -> dict:
    got = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key = line.split(":")[0]
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                got[key] = int(line.split()[1]) * 1024
    with open("/proc/self/smaps_rollup") as fh:
        for line in fh:
            if line.startswith("Pss:"):
                got["Pss"] = int(line.split()[1]) * 1024
    return got


def rank(spec: dict) -> dict:
    """One rank of a case (run in its own process, RANK etc. set)."""
    import torch
    import torch.distributed as dist

    from orchestrator import contract
    from train_entry.engines import build_engine
    from train_entry.hf import load

    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    engine = {"backend": "gloo", "precision": "fp32", "find_unused_parameters": False, "activation_checkpointing": False,
              "sharding": "full", "cpu_offload": False, "wrap": None, **spec["engine"]}
    raw = {"contract": contract.CONTRACT_VERSION, "experiment_id": "b", "index": 0, "steps": 1, "task_dir": spec["out"],
           "engine": engine, "optimizer": {"name": "adamw", "lr": 1e-4, "grad_clip": None}, "resources": {"tasks_per_node": world}}
    ds = None
    if engine["kind"] == "deepspeed":
        ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": world,
              "zero_optimization": {"stage": engine["stage"]}, "zero_allow_untested_optimizer": True}
        raw["deepspeed_config"] = ds
        engine.update(offload_optimizer=None, offload_param=None)
    mcfg = {"path": spec["model"], "dtype": "fp32", "attn_implementation": "sdpa", "qlora": None, "gguf_file": None,
            "lora": LORA, "load": spec["load"]}
    import gc

    import accelerate  # noqa: F401  (the baseline: every library the load uses, imported)
    import peft  # noqa: F401
    import transformers  # noqa: F401

    if engine["kind"] == "deepspeed":
        import deepspeed  # noqa: F401
    gc.collect()
    base = status()
    from train_entry.hf.weights import heap_returned

    with heap_returned():  # as the trainer loads (train_entry/worker.py)
        loaded = load.load_model(mcfg, 0, ds, engine)
        stages = {"loaded": status()}
        eng = build_engine(contract.TaskConfig.from_dict(raw), loaded.model, torch.device("cpu"), trainable_only=True, fill=loaded.fill)
    stages["engine"] = status()
    tokens = torch.arange(16).unsqueeze(0)
    loss = eng.model(input_ids=tokens, labels=tokens).loss
    stages["forward"] = status()
    if engine["kind"] == "deepspeed":
        eng.model.backward(loss)
    else:
        loss.backward()
    end = stages["backward"] = status()
    dist.barrier()
    dist.destroy_process_group()
    load_peak = stages["engine"]["VmHWM"]
    return {"baseline": base["VmRSS"], "peak": load_peak, "added": load_peak - base["VmRSS"], "step_peak": end["VmHWM"],
            "pss_end": end["Pss"],
            "file_end": end["RssFile"] - base["RssFile"], "how": loaded.how,
            "stages": {k: {"rss": v["VmRSS"], "hwm": v["VmHWM"], "file": v["RssFile"]} for k, v in stages.items()}}


def case(name: str, model: Path, tmp: Path) -> list[dict]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    engine, how = CASES[name]
    spec = json.dumps({"engine": engine, "load": how, "model": str(model), "out": str(tmp)})
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "WORLD_SIZE": "2", "TRANSFORMERS_VERBOSITY": "error"}
    procs = [subprocess.Popen([python(), __file__, "--rank", spec], cwd=REPO, env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    got = []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"model_load {name}: a rank failed:\n{err[-3000:]}")
        got.append(json.loads(out.strip().splitlines()[-1]))
    return got


def render(r: dict) -> str:
    gb = lambda n: f"{n / 1e9:.2f}"  # noqa: E731
    size = r["model_bytes"]
    lines = [f"Model: {r['params'] / 1e6:,.0f} M parameters, {gb(size)} GB of fp32 safetensors; LoRA r=8 on q_proj, v_proj; "
             "2 ranks. Per rank (the higher of the two): baseline RSS, the load's peak RSS, what the load added to the "
             "baseline (and that against the model's bytes), the step's peak, and after it the PSS and the mapped files' pages.", "",
             "| engine, load | baseline GB | load peak GB | added GB | added / model | step peak GB | PSS after GB | file pages after GB | how |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, ranks in r["cases"].items():
        worst = max(ranks, key=lambda x: x["added"])
        lines.append(f"| {name} | {gb(worst['baseline'])} | {gb(worst['peak'])} | {gb(worst['added'])} | "
                     f"{worst['added'] / size:.2f}x | {gb(max(x['step_peak'] for x in ranks))} | {gb(max(x['pss_end'] for x in ranks))} | "
                     f"{gb(max(x['file_end'] for x in ranks))} | {worst['how'].split(':')[0].split(' (')[0]} |")
    c = r["cases"]
    if "fsdp2" in c and "fsdp2-from_pretrained" in c:
        a = max(x["added"] for x in c["fsdp2"])
        b = max(x["added"] for x in c["fsdp2-from_pretrained"])
        lines += ["", f"FSDP2: the sharded load adds {a / b:.2f}x what `from_pretrained` first added ({gb(a)} against {gb(b)} GB)."]
    if "zero3" in c and "zero3-from_pretrained" in c:
        a = max(x["added"] for x in c["zero3"])
        b = max(x["added"] for x in c["zero3-from_pretrained"])
        lines += ["", f"ZeRO-3: the partitioned load adds {a / b:.2f}x what `from_pretrained` added ({gb(a)} against {gb(b)} GB)."]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rank", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank:
        print(json.dumps(rank(json.loads(args.rank))))
        return 0
    import tempfile

    model = make_model(args.layers)
    import math

    from train_entry.hf.weights import headers

    params = sum(math.prod(shape) for _, shape in headers(model).values())  # the files' headers, as the load reads them
    result = {"params": params, "model_bytes": sum(f.stat().st_size for f in model.glob("*.safetensors")), "cases": {}}
    for name in args.cases.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            result["cases"][name] = case(name, model, Path(tmp))
        print(f"model_load: {name} done", file=sys.stderr, flush=True)
    print(json.dumps(result) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
