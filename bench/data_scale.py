"""Data at scale: chat records prepared once into the memory-mapped cache, against the
per-rank tokenizing every start did before, and against a plain `datasets.map` of the
same records with the same number of processes.

    python bench/data_scale.py [--sizes 10000,100000,1000000] [--before-max 100000] [--e2e] [--restart [--cache DIR]] [--json]

For each size, generated chat records (1-3 turns of realistic length, SmolLM2's tokenizer):
- prepare: `find_or_prepare` into an empty cache, one process per core: seconds and
  records/s; the peer: `datasets.Dataset.from_json(...).map` of the one-record-at-a-time
  encoding (what the trainer did, as a map function) with as many processes;
- a rank's data start, after: rank 0 (key, entry found and checked, split, packing, a
  batch) and any other rank (the entry mapped, split, packing, a batch):
  seconds and peak RSS above the process's baseline, against the tokens x 8 bytes a
  list-of-ints copy would hold at least;
- before (sizes up to --before-max; an hour a rank at 1 M): one rank's tokenizing into
  Python lists as every rank did at every start.
--e2e: on the largest size and the cache prepared above, `orchestrate data prepare`, then
two LoRA fine-tunes of SmolLM2 on 2 ranks (local executor, 2 steps): the data's share of
each one's start-up from the ledger's `data.reused` event.
--restart [--cache DIR]: only this, on the largest size: the set prepared (or found in DIR),
then a LoRA fine-tune of SmolLM2 on 2 ranks whose rank 1 is killed past its first
checkpoint: the in-place restart to its first step against the launch's cold start.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, python, smollm2  # noqa: E402

MODEL = Path("~/.cache/orchestrate/models/SmolLM2-135M-Instruct").expanduser()
DATA_DIR = Path("~/.cache/orchestrate/bench-data").expanduser()
MAX_LENGTH = 512
WORDS = ("the of and to in is that for it as with was on be by at this have from or one had not but what all were when "
         "we there can an your which their said if do will each about how up out them then she many some so these would "
         "other into has more her two like him see time could no make than first been its who now people my made over did "
         "down only way find use may water long little very after words called just where most know get through back "
         "much before go good new write our used me man too any day same right look think also around another came come "
         "work three word must because does part even place well such here take why things help put years different away "
         "again off went old number great tell men say small every found still between name should home big give air line "
         "set own under read last never us left end along while might next sound below saw something thought both few "
         "those always looked show large often together asked house don't world going want school important until form "
         "food keep children feet land side without boy once animals life enough took sometimes four head above kind began "
         "almost live page got earth need far hand high year mother light parts country father let night following picture "
         "being study second eyes soon times story boys since white days ever paper hard near sentence better best across "
         "during today others however sure means knew it's try told young miles sun ways thing whole hear example heard "
         "several change answer room sea against top turned learn point city play toward five using himself usually").split()


def make_data(n: int) -> Path:
    """``n`` chat records, 1-3 turns each, about 330 tokens on average; made once, kept."""
    path = DATA_DIR / f"chat-{n}.jsonl"
    if path.exists():
        return path
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    rng = random.Random(n)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as fh:
        for _ in range(n):
            messages = [{"role": "system", "content": "You are a helpful assistant."}] if rng.random() < 0.3 else []
            for _ in range(rng.choice((1, 1, 2, 2, 3))):
                messages.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(8, 60))) + "?"})
                messages.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(20, 160))) + "."})
            fh.write(json.dumps({"messages": messages}) + "\n")
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------- in a child process each


def _rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _naive_encode(tok, messages):
    """The one-record-at-a-time encoding the trainer did before (and the peer maps)."""
    def ids(msgs, gen):
        out = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen, return_dict=False)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    full = ids(messages, False)
    target = [0] * len(full)
    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            start, end = len(ids(messages[:k], True)), len(ids(messages[: k + 1], False))
            for i in range(start, min(end, len(full))):
                target[i] = 1
    return full, target


def child(task: dict) -> dict:
    import transformers

    transformers.logging.set_verbosity_error()
    import numpy as np

    from train_entry.dataprep import ranks, store

    tok = transformers.AutoTokenizer.from_pretrained(str(MODEL), local_files_only=True)
    base = _rss_mb()
    t0 = time.perf_counter()
    kind = task["kind"]
    if kind == "prepare":
        ex = ranks.find_or_prepare(ranks.Source([task["data"]], "chat"), tok, task["cache"], ranks.Unwatched(), lambda line: None,
                                   task["procs"])
        return {"s": time.perf_counter() - t0, "records": len(ex), "tokens": ex.manifest["counts"]["tokens"]}
    if kind == "peer":
        import datasets

        datasets.disable_progress_bars()
        ds = datasets.Dataset.from_json(task["data"], cache_dir=task["cache"])

        def enc(row):
            full, target = _naive_encode(tok, row["messages"])
            return {"input_ids": full, "target": target}

        out = ds.map(enc, num_proc=task["procs"] if task["procs"] > 1 else None, remove_columns=["messages"],
                     cache_file_name=os.path.join(task["cache"], "peer.arrow"))
        return {"s": time.perf_counter() - t0, "records": len(out)}
    if kind in ("rank0", "rank1"):
        if kind == "rank0":
            ex = ranks.find_or_prepare(ranks.Source([task["data"]], "chat"), tok, task["cache"], ranks.Unwatched(), lambda line: None)
        else:
            entry = store.datacache.entry_dir(task["cache"], task["key"])
            ex = store.Examples(entry)
        n = len(ex)
        held = store.held_out(n, 0.01, 0)
        kept = store.usable(ex, np.setdiff1d(np.arange(n), held), MAX_LENGTH)
        packed = store.Packed(ex, kept, MAX_LENGTH, tok.pad_token_id or 0)
        packed.collate([packed[i] for i in range(8)])
        s = time.perf_counter() - t0
        rng = np.random.default_rng(0)
        for _ in range(50):  # reading a while, as training does: pages come and go
            packed.collate([packed[int(i)] for i in rng.integers(0, len(packed), 8)])
        return {"s": s, "rss_mb": _rss_mb() - base, "rows": len(packed), "key": ex.entry.name}
    if kind == "before":
        from orchestrator.contract import chatdata
        from train_entry.dataprep import sources

        # the trainer before issue 30: every record parsed into Python lists on every rank
        records = [chatdata.to_messages(json.loads(r["text"]), "chat", str(r["line"])) for r in sources.raw_lines([task["data"]])]
        examples = []
        for messages in records:
            full, target = _naive_encode(tok, messages)
            full, target = full[:MAX_LENGTH], target[:MAX_LENGTH]
            labels = [full[i + 1] if target[i + 1] else -100 for i in range(len(full) - 1)] + [-100]
            examples.append((full, labels))
        return {"s": time.perf_counter() - t0, "rss_mb": _rss_mb() - base, "examples": len(examples)}
    raise ValueError(kind)


def run_child(task: dict, timeout: float = 7200) -> dict:
    out = subprocess.run([python(), str(Path(__file__).resolve()), "--child", json.dumps(task)], cwd=REPO, capture_output=True,
                         text=True, timeout=timeout)
    if out.returncode != 0:
        raise SystemExit(f"data_scale: {task['kind']} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- end to end


def _lora_spec(path: Path, name: str, data: Path, cache: str, **fields) -> Path:
    """A LoRA fine-tune of SmolLM2 on 2 ranks, packed rows of MAX_LENGTH, on ``cache``."""
    path.write_text(json.dumps({
        "name": name, "model": {"kind": "hf", "path": str(MODEL), "lora": {"r": 8, "alpha": 16}},
        "data": {"kind": "jsonl", "path": str(data), "max_length": MAX_LENGTH, "packing": True, "cache_dir": cache},
        "batch": {"micro_batch_size": 1}, "resources": {"tasks_per_node": 2}, "logging": {"every_steps": 1}, **fields}))
    return path


def e2e(data: Path, work: Path, cache: str) -> dict:
    """On the cache the preparation above filled (data.cache_dir): what a user's runs do
    after `orchestrate data prepare`."""
    env = {**os.environ, "ORCHESTRATE_HOME": str(work / "home")}
    spec = _lora_spec(work / "lora.yaml", "bench-data-scale", data, cache, steps=2, checkpoint={"every_steps": None})
    t0 = time.perf_counter()
    prep = subprocess.run([python(), "-m", "orchestrator", "data", "prepare", str(spec), "--json"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=7200)
    if prep.returncode != 0:
        raise SystemExit(f"data_scale: data prepare failed:\n{prep.stderr[-3000:]}")
    out = {"prepare_s": time.perf_counter() - t0, "runs": []}
    for _ in range(2):
        t0 = time.perf_counter()
        run = subprocess.run([python(), "-m", "orchestrator", "submit", str(spec), "--executor", "local", "--wait", "--json"],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
        if run.returncode != 0:
            raise SystemExit(f"data_scale: the fine-tune failed:\n{run.stderr[-3000:]}")
        exp = json.loads(run.stdout)["experiments"][0]
        events = json.loads(subprocess.run([python(), "-m", "orchestrator", "events", exp["id"], "--json"], cwd=REPO, env=env,
                                           capture_output=True, text=True, timeout=120).stdout)
        data_events = [e for e in events if e["kind"].startswith("data.")]
        started = [(e.get("data") or {}).get("startup_s") for e in events if e["kind"] == "train.started"]
        out["runs"].append({"wall_s": time.perf_counter() - t0, "data_events": [e["kind"] for e in data_events],
                            "data_s": next(((e.get("data") or {}).get("seconds") for e in data_events), None),
                            "startup_s": next((s for s in started if s), None)})
    return out


def restart(data: Path, work: Path, cache: str) -> dict:
    """A rank killed at this scale, restarted in place (same launch, next generation), timed
    from the trainer's own records against the same launch's cold start: the kill to the
    restarted ranks' first step, split into the data's share (the ledger's data event of
    that generation), start-up and checkpoint load."""
    from orchestrator import contract

    home = work / "home-restart"
    env = {**os.environ, "ORCHESTRATE_HOME": str(home)}
    spec = _lora_spec(work / "restart.yaml", "bench-data-restart", data, cache, steps=100000,
                      checkpoint={"every_steps": 3, "keep_last": 2}, retry={"max_restarts": 2}, heartbeat={"interval_s": 0.5})
    run = subprocess.Popen([python(), "-m", "orchestrator", "submit", str(spec), "--executor", "local", "--wait"], cwd=REPO,
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        tdir = _wait(lambda: next(iter(sorted((home / "runs").glob("*/tasks/0"))), None) if (home / "runs").is_dir() else None,
                     "the run folder", 600)

        def rows() -> list[dict]:
            return contract.read_jsonl_from(contract.metrics_path(tdir), 0)[0]

        def first(where) -> dict | None:
            found = [m for m in rows() if where(m)]
            return min(found, key=lambda m: m["step"]) if found else None

        _wait(lambda: True if max((m["step"] for m in rows()), default=0) >= 5 else None, "step 5 (past the first checkpoint)", 1800)
        victim = contract.read_json(contract.heartbeat_path(tdir, 1))
        launch = victim["launch"]
        start = contract.read_json(contract.start_path(contract.launch_dir(tdir, launch)))
        cold = first(lambda m: m["launch"] == launch and m.get("generation", 0) == 0)["time"] - start["time"]
        t_kill = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        again = _wait(lambda: first(lambda m: m["launch"] == launch and m.get("generation") == 1), "the restart's first step", 1800)
        events = contract.read_jsonl_from(contract.events_path(tdir), 0)[0]

        def of_generation(kind: str, generation: int) -> dict | None:
            return next((e for e in events if e.get("event") == kind and e.get("launch") == launch
                         and e.get("generation", 0) == generation), None)

        cold_data = of_generation("data.reused", 0) or of_generation("data.prepared", 0) or {}
        warm_data = of_generation("data.reused", 1) or {}
        resumed = of_generation("checkpoint.resumed", 1) or {}
        return {"cold_start_s": cold, "restart_s": again["time"] - t_kill, "cold_data_s": cold_data.get("seconds"),
                "restart_data_s": warm_data.get("seconds"), "restart_startup_s": resumed.get("startup_s"),
                "restart_load_s": resumed.get("load_s"), "resumed_step": resumed.get("step")}
    finally:
        subprocess.run([python(), "-m", "orchestrator", "cancel", "bench-data-restart"], cwd=REPO, env=env, capture_output=True,
                       timeout=120)
        try:
            run.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)


def _wait(probe, what: str, timeout: float):
    deadline = time.time() + timeout
    while (got := probe()) is None:
        if time.time() > deadline:
            raise SystemExit(f"data_scale: no {what} after {timeout:.0f} s")
        time.sleep(0.5)
    return got


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--before-max", type=int, default=100000)
    ap.add_argument("--peer-max", type=int, default=100000)
    ap.add_argument("--e2e", action="store_true")
    ap.add_argument("--restart", action="store_true", help="only: kill a rank of a LoRA fine-tune on the largest size")
    ap.add_argument("--cache", help="a cache folder to keep (default: a temporary one per size)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    smollm2()  # the model the fine-tunes and the tokenizer come from, converted once
    procs = len(os.sched_getaffinity(0))
    results = {"procs": procs, "sizes": {}}
    if args.restart:  # the restart figure alone, on a cache prepared first (kept with --cache: prepared once)
        n = max(int(s) for s in args.sizes.split(","))
        data = make_data(n)
        with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
            cache = str(Path(args.cache) if args.cache else Path(tmp) / "cache")
            prep = run_child({"kind": "prepare", "data": str(data), "cache": cache, "procs": procs})
            results["sizes"][str(n)] = {"restart": restart(data, Path(tmp), cache), "prepare": prep}
        print(json.dumps(results) if args.json else render(results))
        return 0
    for n in [int(s) for s in args.sizes.split(",")]:
        data = make_data(n)
        with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
            cache = str(Path(args.cache) if args.cache else Path(tmp) / "cache")
            r: dict = {"bytes": data.stat().st_size}
            r["prepare"] = run_child({"kind": "prepare", "data": str(data), "cache": cache, "procs": procs})
            if n <= args.peer_max:
                r["peer"] = run_child({"kind": "peer", "data": str(data), "cache": str(Path(tmp) / "peer"), "procs": procs})
            r["rank0"] = run_child({"kind": "rank0", "data": str(data), "cache": cache})
            r["rank1"] = run_child({"kind": "rank1", "data": str(data), "cache": cache, "key": r["rank0"]["key"]})
            if n <= args.before_max:
                r["before"] = run_child({"kind": "before", "data": str(data)})
            if args.e2e and n == max(int(s) for s in args.sizes.split(",")):
                r["e2e"] = e2e(data, Path(tmp), cache)

        results["sizes"][str(n)] = r
        print(f"data_scale: {n} done", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(results))
    else:
        print(render(results))
    return 0


def render(res: dict) -> str:
    lines = [f"Processes for preparing: {res['procs']} (one per core).", ""]
    if any("rank0" in r for r in res["sizes"].values()):
        lines += ["| records | JSONL | tokens | prepare | records/s | `datasets.map` peer | ratio | rank 0 data start | other rank | "
                  "rank's data RSS | tokens x 8 B | before: one rank's start | before: RSS |", "|" + "---|" * 13]
    for n, r in res["sizes"].items():
        if "rank0" not in r:
            continue
        p, peer, before = r["prepare"], r.get("peer"), r.get("before")
        ours = p["records"] / p["s"]
        theirs = peer["records"] / peer["s"] if peer else None
        lines.append(
            f"| {int(n):,} | {r['bytes'] / 1e6:,.0f} MB | {p['tokens']:,} | {p['s']:.1f} s | {ours:,.0f} | "
            + (f"{theirs:,.0f}/s | {ours / theirs:.2f}x" if theirs else "- | -")
            + f" | {r['rank0']['s']:.2f} s | {r['rank1']['s']:.2f} s | {max(r['rank0']['rss_mb'], r['rank1']['rss_mb']):,.0f} MB | "
            f"{p['tokens'] * 8 / 1e6:,.0f} MB | "
            + (f"{before['s']:.1f} s | {before['rss_mb']:,.0f} MB |" if before else "- | - |"))
    for n, r in res["sizes"].items():
        if "e2e" in r:
            e = r["e2e"]
            lines += ["", f"End to end at {int(n):,} records, on the cache prepared above: `orchestrate data prepare` "
                      f"{e['prepare_s']:.1f} s (it finds the set prepared); then two LoRA fine-tunes of SmolLM2 on 2 ranks:"]
            for i, run in enumerate(e["runs"], 1):
                lines.append(f"- run {i}: ledger {', '.join(run['data_events'])}; the data's share of the start "
                             f"{run['data_s']:.2f} s of {run['startup_s']:.1f} s to the first step")
    for n, r in res["sizes"].items():
        if "restart" in r:
            x = r["restart"]
            lines += ["", f"A rank killed at {int(n):,} records (LoRA fine-tune of SmolLM2 on 2 ranks, local executor, "
                      f"in place): its launch's cold start {x['cold_start_s']:.1f} s to the first step (the data's share "
                      f"{_s(x['cold_data_s'])}); the kill to the restarted ranks' first step {x['restart_s']:.1f} s "
                      f"({x['restart_s'] / x['cold_start_s']:.2f}x the cold start; the data's share {_s(x['restart_data_s'])}, "
                      f"start-up {_s(x['restart_startup_s'])}, checkpoint load {_s(x['restart_load_s'])}, resumed from "
                      f"step {x['resumed_step']})."]
            if "prepare" in r and "rank0" not in r:  # --restart alone: its own preparation, the table has none
                p = r["prepare"]
                lines.append(f"The records were prepared first, once: {p['s']:.0f} s, {p['records'] / p['s']:,.0f} records/s, "
                             f"{p['tokens']:,} tokens.")
    if not any("rank0" in r for r in res["sizes"].values()):
        return "\n".join(lines)
    lines += ["", "A rank's data start is after the tokenizer is loaded: the key (input digest remembered), the entry found "
              "and checked (rank 0 reads it whole against its digest only if the file changed since it was written), the 1 % "
              "held-out split, packing, one batch. RSS: the peak above the process's own after its imports, after 50 more "
              "random batches (it counts the mapped file's pages the process touched, which the node's ranks share). The "
              "1 M row has no peer and no before: each would take about an hour here (the 10 k row gives their ratios)."]
    return "\n".join(lines)


def _s(value) -> str:
    return "-" if value is None else f"{value:.2f} s"


if __name__ == "__main__":
    sys.exit(main())
