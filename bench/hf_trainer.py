"""Fine-tuning throughput: tokens/s of `orchestrate submit` (model kind hf, LoRA) against the
Hugging Face Trainer launched with `torchrun`, on the same model, rows, LoRA settings,
engine (DDP, then DeepSpeed ZeRO-2), micro-batch and step count, 2 processes on gloo, in
the same run, interleaved; and each orchestrate rank's peak memory against `orchestrate plan`.

    python bench/hf_trainer.py [--steps 12] [--warmup 4] [--repeats 2] [--json]

The model is the converted SmolLM2-135M-Instruct folder (`scripts/smollm2-to-hf`), the data
the chat task's train.jsonl (`python -m train_entry.examples.chat_task write`), packed into
rows of max_length tokens. The Trainer is given, per rank and per step, exactly the rows
orchestrate's sampler gives that rank at that step (train_entry.hf.chat's examples, packing
and collate), with the labels unshifted again so that the model's own shifted loss is the
same loss. Start-up (imports, model load, engine set-up) is excluded from both: tokens/s is
taken over steps warmup+1..steps from wall-clock stamps at step ends on rank 0 (orchestrate:
the `time` of its metrics lines, logged at exactly those steps; the Trainer: a
TrainerCallback's time.time() in on_step_end). Peak memory is each rank's VmHWM (max RSS),
read from /proc while the run goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, machine, measure, python, stats  # noqa: E402

MODEL = Path("~/.cache/orchestrate/models/SmolLM2-135M-Instruct").expanduser()
DATA = Path("~/.cache/orchestrate/data/orders/train.jsonl").expanduser()
ENGINES = {"ddp": {"kind": "ddp"}, "zero2": {"kind": "deepspeed", "stage": 2}}
MAX_LENGTH, MICRO_BATCH, LR, SEED = 128, 2, 2.0e-3, 0
LORA = {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def spec(engine: dict, steps: int, warmup: int) -> str:
    """configs/smollm2-lora-chat.yaml without the eval split, evaluation, checkpoints and
    export (not what is measured), LoRA dropout 0, metrics at exactly the measured steps."""
    s = {
        "name": "bench-hf-trainer",
        "seed": SEED,
        "model": {"kind": "hf", "path": str(MODEL), "lora": LORA},
        "data": {"kind": "jsonl", "path": str(DATA), "format": "chat", "max_length": MAX_LENGTH, "packing": True},
        "engine": engine,
        "optimizer": {"lr": LR},
        "schedule": {"name": "cosine", "warmup_steps": 5},
        "batch": {"micro_batch_size": MICRO_BATCH},
        "steps": steps,
        "checkpoint": {"every_steps": None},
        "resources": {"tasks_per_node": 2, "time": "00:30:00"},
        "logging": {"every_steps": warmup},
    }
    return json.dumps(s)  # JSON is YAML


# ---------------------------------------------------------------- peak RSS per rank, from /proc


class PeakRSS:
    """VmHWM of every python descendant of ``root``, polled; the last value seen is the peak."""

    def __init__(self, root: int, interval: float = 0.5):
        self.root, self.interval, self.peaks, self.cmd = root, interval, {}, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _children(self, pid: int) -> list[int]:
        out = []
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                out += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            todo, seen = [self.root], set()
            while todo:
                pid = todo.pop()
                if pid in seen:
                    continue
                seen.add(pid)
                todo += self._children(pid)
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                for line in status.splitlines():
                    if line.startswith("VmHWM:"):
                        self.peaks[pid] = max(self.peaks.get(pid, 0), int(line.split()[1]) * 1024)
                        self.cmd[pid] = cmd
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _ranks(peak: PeakRSS, largest: int = 2) -> list[int]:
    """The ranks' peaks: the ``largest`` processes (the launcher, the node agent and the
    watcher are a fraction of a rank, which holds the model)."""
    return sorted(peak.peaks.values(), reverse=True)[:largest]


def run_child(argv: list[str], env: dict, timeout: float = 1200) -> tuple[str, list[int]]:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=err, env=env)
        peak = PeakRSS(proc.pid)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise SystemExit(f"{' '.join(argv[:6])} ran past {timeout:.0f} s") from None
        finally:
            peak.stop()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if rc != 0:
        raise SystemExit(f"{' '.join(argv[:6])} failed ({rc}): {stderr[-3000:]}{stdout[-2000:]}")
    return stdout, _ranks(peak)


# ---------------------------------------------------------------- orchestrate


def ours(engine: str, steps: int, warmup: int, home: Path) -> dict:
    spec_path = home / f"{engine}.yaml"
    spec_path.write_text(spec(ENGINES[engine], steps, warmup))
    env = {**os.environ, "ORCHESTRATE_HOME": str(home)}
    stdout, peaks = run_child([python(), "-m", "orchestrator", "submit", str(spec_path), "--executor", "local", "--wait", "--json"], env)
    tdir = Path(json.loads(stdout[stdout.index("{"):])["experiments"][0]["run_dir"]) / "tasks" / "0"
    times, losses = {}, {}
    for line in (tdir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        times[m["step"]], losses[m["step"]] = m["time"], m["loss"]
    cfg = json.loads((tdir / "task.json").read_text())
    return {"step_s": (times[steps] - times[warmup]) / (steps - warmup), "rank_peak_rss": peaks, "first_loss": losses[1],
            "deepspeed_config": cfg.get("deepspeed_config"), "threads": cfg["resources"]["cpus_per_task"]}


def plan(engine: str, steps: int, warmup: int, home: Path) -> dict | str:
    """`orchestrate plan`'s prediction for the same spec (bytes per rank), or why there is none."""
    spec_path = home / f"{engine}.yaml"
    spec_path.write_text(spec(ENGINES[engine], steps, warmup))
    out = subprocess.run([python(), "-m", "orchestrator", "plan", str(spec_path), "--json"], cwd=REPO, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "ORCHESTRATE_HOME": str(home)})
    if out.returncode != 0:
        return f"orchestrate plan failed: {(out.stderr or out.stdout).strip()[-300:]}"
    p = json.loads(out.stdout)
    want = {"ddp": "ddp", "zero2": "zero2"}[engine]
    for e in p["engines"]:
        if e["name"] == want:
            return {"peak": e["peak"], "model_states": e["model_states"], "activations": e["activations"]}
    return f"orchestrate plan has no {want} row"


# ---------------------------------------------------------------- the Trainer


def trainer(engine: str, steps: int, warmup: int, ds_config: dict | None, threads: int, home: Path) -> dict:
    result = home / f"trainer-{engine}.json"
    argv = [python(), "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
            str(Path(__file__).resolve()), "--trainer-rank", json.dumps(
                {"engine": engine, "steps": steps, "warmup": warmup, "ds_config": ds_config, "result": str(result)})]
    # torchrun would set OMP_NUM_THREADS=1 itself; orchestrate's ranks get resources.cpus_per_task
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if ds_config:
        env["DS_ACCELERATOR"] = "cpu"
    _, peaks = run_child(argv, env)
    r = json.loads(result.read_text())
    if bool(ds_config) != r["deepspeed"]:
        raise SystemExit(f"the Trainer ran {r['wrapper']}, not {engine}")
    return {"step_s": (r["times"][steps - 1] - r["times"][warmup - 1]) / (steps - warmup), "rank_peak_rss": peaks,
            "first_loss": r["first_loss"], "wrapper": r["wrapper"]}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_rank(raw: str) -> None:
    """One rank of the Trainer run: the rows this rank sees under orchestrate, in its order."""
    a = json.loads(raw)
    steps, ds_config = a["steps"], a["ds_config"]
    import torch

    if ds_config:
        from train_entry.engines.deepspeed import skip_unneeded_op_builds

        skip_unneeded_op_builds(torch.device("cpu"))  # as the notes say: else DeepSpeed JIT-compiles its shm op (135 s)
    import peft
    import transformers
    from torch.utils.data import DataLoader

    transformers.logging.set_verbosity_error()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    batches, collate = _orchestrate_rows(steps, rank, world, Path(a["result"]).parent / "cache" / "data")  # orchestrate's default under this home

    class Stamps(transformers.TrainerCallback):
        def __init__(self):
            self.times = []

            self.first_loss = None

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.time())

        def on_log(self, args, state, control, logs=None, **kw):
            if self.first_loss is None and logs and "loss" in logs:
                self.first_loss = logs["loss"]

    stamps = Stamps()
    args = _training_args(Path(a["result"]).with_suffix(".out"), steps, ds_config)
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL, local_files_only=True, dtype=torch.float32,
                                                              attn_implementation="sdpa")
    model.config.use_cache = False
    torch.manual_seed(SEED)  # as orchestrate: the adapters' initial values the same on every rank
    model = peft.get_peft_model(model, peft.LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                                                        target_modules=LORA["target_modules"], task_type="CAUSAL_LM"))

    class Fixed(transformers.Trainer):
        def get_train_dataloader(self):  # exactly orchestrate's rows, no resharding or shuffling
            return DataLoader(batches, batch_size=1, shuffle=False, collate_fn=collate)

    t = Fixed(model=model, args=args, callbacks=[stamps])
    t.train()
    if rank == 0:
        Path(a["result"]).write_text(json.dumps({"times": stamps.times, "first_loss": stamps.first_loss,
                                                 "deepspeed": t.is_deepspeed_enabled, "wrapper": type(t.model_wrapped).__name__}))


def _orchestrate_rows(steps: int, rank: int, world: int, cache: Path):
    """(the row indices orchestrate's sampler gives this rank, step by step; the collate that
    makes them the Trainer's batches, with the labels unshifted again: the model shifts them).
    The rows come from the same prepared cache entry orchestrate's own run used."""
    import numpy as np
    import torch
    import transformers

    from train_entry.data import Sampler
    from train_entry.dataprep import ranks, store
    from train_entry.hf import chat, load

    tok = transformers.AutoTokenizer.from_pretrained(MODEL, local_files_only=True)
    ex = ranks.find_or_prepare(ranks.Source([str(DATA)], "chat"), tok, str(cache), ranks.Unwatched(), lambda line: None)
    packed = store.Packed(ex, store.usable(ex, np.arange(len(ex)), MAX_LENGTH), MAX_LENGTH, load.pad_id(tok))
    sampler = Sampler(len(packed), SEED, MICRO_BATCH, 1, world, rank)
    batches = [sampler.indices(step, 0) for step in range(steps)]

    def collate(idx_lists):
        (idx,) = idx_lists
        inputs, shifted = packed.collate([packed[i] for i in idx])
        labels = torch.full_like(shifted, chat.IGNORE)  # the model shifts again: labels[i+1] is the target of i
        labels[:, 1:] = shifted[:, :-1]
        return {**inputs, "labels": labels}

    return batches, collate


def _training_args(output_dir: Path, steps: int, ds_config: dict | None):
    """The Trainer's settings, orchestrate's own for the same spec."""
    import transformers

    return transformers.TrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=1, max_steps=steps, learning_rate=LR, lr_scheduler_type="cosine", warmup_steps=5,
        weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch", seed=SEED, use_cpu=True, ddp_backend="gloo",
        ddp_find_unused_parameters=False,  # orchestrate's default; a PeftModel otherwise gets True
        average_tokens_across_devices=False,  # orchestrate's loss: each rank's token mean, gradients averaged
        logging_steps=steps, logging_first_step=True, save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0,
        deepspeed=ds_config)


# ---------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4, help="steps left out of the figure (and the metrics' logging interval)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--trainer-rank", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trainer_rank:
        trainer_rank(args.trainer_rank)
        return 0
    if args.steps % args.warmup:
        ap.error("--steps must be a multiple of --warmup (metrics are logged every --warmup steps)")
    for need in (MODEL / "config.json", DATA):
        if not need.exists():
            raise SystemExit(f"{need} is missing: run scripts/smollm2-to-hf and python -m train_entry.examples.chat_task write "
                             f"{DATA.parent}")
    tokens_per_step = MICRO_BATCH * 1 * 2 * MAX_LENGTH
    res = {"machine": machine(), "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
           "tokens_per_step": tokens_per_step, "engines": {}}
    # what a rank holds before any model: python and the libraries both load (the plan counts none of it)
    res["imports_rss"] = measure([python(), "-c", "import torch, transformers, peft, deepspeed, train_entry.worker, "
                                  "train_entry.hf.chat"], env={**os.environ, "DS_ACCELERATOR": "cpu"})[1]
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        for engine in args.engines.split(","):
            o, t, o_rss, t_rss, loss = [], [], [], [], []
            for _ in range(args.repeats):  # interleaved: drift in the machine hits both alike
                r = ours(engine, args.steps, args.warmup, home)
                o.append(tokens_per_step / r["step_s"])
                o_rss += r["rank_peak_rss"]
                tr = trainer(engine, args.steps, args.warmup, r["deepspeed_config"], r["threads"], home)
                t.append(tokens_per_step / tr["step_s"])
                t_rss += tr["rank_peak_rss"]
                loss.append({"orchestrate": r["first_loss"], "trainer": tr["first_loss"]})
            res["engines"][engine] = {
                "ours_tokens_s": stats(o), "trainer_tokens_s": stats(t),
                "ratio": round(stats(o)["median"] / stats(t)["median"], 3),
                "ours_rank_peak_rss": stats(o_rss), "trainer_rank_peak_rss": stats(t_rss),
                "first_step_loss": loss, "trainer_model": tr["wrapper"],
                "plan": plan(engine, args.steps, args.warmup, home),
            }
    print(json.dumps(res, indent=2) if args.json else render(res))
    return 0


def render(res: dict) -> str:
    def tps(v):
        return f"{v['min']:.0f} / {v['median']:.0f} / {v['max']:.0f}"

    def gb(v):
        return f"{v['min'] / 1e9:.2f} / {v['median'] / 1e9:.2f} / {v['max'] / 1e9:.2f}"

    n = res["repeats"]
    lines = [f"SmolLM2-135M-Instruct, LoRA r 16 on q/k/v/o, packed rows of {MAX_LENGTH} tokens, micro-batch {MICRO_BATCH} "
             f"per rank, 2 ranks on gloo ({res['tokens_per_step']} tokens a step); tokens/s over steps "
             f"{res['warmup'] + 1}..{res['steps']} from wall-clock stamps at step ends on rank 0 (orchestrate: its metrics lines; the "
             "Trainer: a TrainerCallback's on_step_end), so model load and start-up count for neither; min / median / max over "
             f"{n} run{'s' * (n > 1)} each, the two tools alternating:", "",
             "| engine | HF Trainer (torchrun) | **orchestrate** | ratio orchestrate / Trainer |", "|---|---|---|---|"]
    names = {"ddp": "DDP", "zero2": "DeepSpeed ZeRO-2"}
    for name, r in res["engines"].items():
        lines.append(f"| {names[name]} | {tps(r['trainer_tokens_s'])} | {tps(r['ours_tokens_s'])} | **{r['ratio']:.2f}×** |")
    base = res["imports_rss"]
    lines += ["", "Peak memory per rank (max RSS, GB, min / median / max over the ranks) against `orchestrate plan`'s "
              "per-rank peak for the same spec (model states + activations). The plan counts no process baseline: python "
              f"with torch, transformers, peft and DeepSpeed imported holds {base / 1e9:.2f} GB before any model.", "",
              "| engine | HF Trainer | **orchestrate** | `orchestrate plan` peak | measured / planned | "
              "(measured - imports) / planned |", "|---|---|---|---|---|---|"]
    for name, r in res["engines"].items():
        p = r["plan"]
        if isinstance(p, dict):
            med = r["ours_rank_peak_rss"]["median"]
            planned, ratio, net = f"{p['peak'] / 1e9:.2f}", f"{med / p['peak']:.2f}×", f"{(med - base) / p['peak']:.2f}×"
        else:
            planned, ratio, net = f"missing ({p})", "-", "-"
        lines.append(f"| {names[name]} | {gb(r['trainer_rank_peak_rss'])} | {gb(r['ours_rank_peak_rss'])} | {planned} | {ratio} "
                     f"| {net} |")
    lines += ["", "Same rows, same weights: the loss of step 1 (mean over both ranks), orchestrate / Trainer: " + "; ".join(
        f"{names[name]} " + ", ".join(f"{x['orchestrate']:.4f} / {x['trainer']:.4f}" for x in r["first_step_loss"])
        for name, r in res["engines"].items()) + "."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
