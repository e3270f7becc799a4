"""Ledger rows -> what users read: the status document (read from the ledger, at a
given time), and tables and event lines (pure functions of that document and rows)."""

from __future__ import annotations

import json
import time
from typing import Any

from rich.table import Table

from orchestrator.ledger import Ledger


def status_document(ledger: Ledger, experiments: list[dict], now: float | None = None) -> dict:
    """The `status --json` document (its format is documented in the README)."""
    now = time.time() if now is None else now
    out = []
    for exp in experiments:
        attempts: dict[int, list[dict]] = {}
        for a in ledger.attempts(exp["id"]):
            attempts.setdefault(a["idx"], []).append(a)
        tasks = []
        for t in ledger.tasks(exp["id"]):
            mine = attempts.get(t["idx"], [])
            last = mine[-1] if mine else {}
            ended = last.get("state") not in (None, "PENDING", "RUNNING", "COMPLETED")
            tasks.append(
                {
                    "index": t["idx"],
                    "params": json.loads(t["params"] or "{}"),
                    "state": t["state"],
                    "attempts": len(mine),
                    "restarts": sum(a.get("restarts") or 0 for a in mine),
                    "step": t["step"],
                    "loss": t["loss"],
                    "eval_loss": t.get("eval_loss"),
                    "throughput": t["throughput"],
                    "heartbeat_age_s": round(now - t["heartbeat_at"], 1) if t["heartbeat_at"] else None,
                    "nodes": (last.get("nodes") or t["nodes"] or "").split(",") if (last.get("nodes") or t["nodes"]) else [],
                    "job_id": last.get("job_id"),
                    "checkpoint": t["checkpoint"],
                    "reason": t["reason"] or (last.get("reason") if ended else None),
                    "failure": last.get("failure") if ended else None,
                }
            )
        out.append(
            {
                "name": exp["name"],
                "id": exp["id"],
                "state": exp["state"],
                "executor": exp["executor"],
                "created_at": exp["created_at"],
                "run_dir": exp["run_dir"],
                "watcher": (ledger.lease(f"watch:{exp['id']}") or {}).get("owner"),
                "tasks": tasks,
            }
        )
    return {"experiments": out}


_STYLE = {"COMPLETED": "green", "FAILED": "red", "CANCELLED": "yellow", "RUNNING": "cyan", "RECOVERING": "magenta"}


def _fmt(v: Any, spec: str = "") -> str:
    if v is None or v == "":
        return "-"
    return format(v, spec) if spec else str(v)


def status_tables(doc: dict) -> list[Table]:
    tables = []
    for exp in doc["experiments"]:
        t = Table(
            title=f"{exp['name']} [dim]{exp['id']}[/] [{_STYLE.get(exp['state'], 'white')}]{exp['state']}[/] ({exp['executor']})",
            title_justify="left",
        )
        if exp["watcher"] is None and exp["state"] not in ("COMPLETED", "FAILED", "CANCELLED"):
            t.caption = "no watcher: hangs and failures are recovered only while `orchestrate watch` runs"
        for col in ("task", "params", "state", "att", "rst", "step", "loss", "eval", "thru/s", "hb age", "nodes", "checkpoint", "reason"):
            t.add_column(col, overflow="fold")
        for task in exp["tasks"]:
            params = ", ".join(f"{k}={v}" for k, v in task["params"].items()) or "-"
            t.add_row(
                str(task["index"]),
                params,
                f"[{_STYLE.get(task['state'], 'white')}]{task['state']}[/]",
                str(task["attempts"]),
                str(task["restarts"]),
                _fmt(task["step"]),
                _fmt(task["loss"], ".4f"),
                _fmt(task["eval_loss"], ".4f"),
                _fmt(task["throughput"], ",.0f"),
                _fmt(task["heartbeat_age_s"], ".0f") + ("s" if task["heartbeat_age_s"] is not None else ""),
                ",".join(task["nodes"]) or "-",
                _fmt(task["checkpoint"]),
                _fmt(task["reason"]),
            )
        tables.append(t)
    return tables


def event_line(e: dict) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["time"]))
    who = "experiment" if e["idx"] is None else f"task {e['idx']}" + (f" attempt {e['attempt']}" if e["attempt"] else "")
    change = f" {e['old_state'] or '-'} -> {e['new_state']}" if e["new_state"] else ""
    return f"{when}  {who:<20} {e['kind']:<22}{change}  {e['cause']}"


def count(n: int) -> str:
    """1.8M, 134.5M, 6.7B: a parameter count for people."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:,.1f}{unit}"
    return str(n)


def memory_plan_tables(doc: dict) -> list:
    """`orchestrate plan` as a table of engines and the recommendation under it."""
    from rich.text import Text

    from orchestrator.submit.memory_plan import human

    s, m, rec = doc["setting"], doc["model"], doc["recommendation"]
    gpu = human(s["gpu_memory"]) if s["gpu_memory"] else "not given"
    what = f"{m['params'] / 1e6:,.1f} M parameters"
    if m.get("method", "full") != "full":  # LoRA / QLoRA: what trains, and how the base is stored
        base = f"{m['quant_bits']:.2f}-bit" if m["method"] == "qlora" else {4: "fp32", 2: "16-bit"}[m["weight_bytes"]]
        total = m["params"] + m["trainable"]
        what = (f"{'QLoRA' if m['method'] == 'qlora' else 'LoRA'}: trainable {count(m['trainable'])} of {count(total)} "
                f"parameters ({100 * m['trainable'] / total:.2f} %; the base's {count(m['params'])} frozen, {base})")
    elif m.get("weight_bytes", 4) != 4:
        what += " in 16-bit"
    title = (
        f"{what}, {s['nodes']} node(s) x {s['gpus_per_node']} GPU(s), "
        f"micro-batch {s['micro_batch']} x {s['grad_accum']} accumulation, {s['precision']}, GPU memory {gpu}"
    )
    t = Table(title=title, title_justify="left")
    for col in ("engine", "params", "grads", "optimizer", "working", "activations", "act. (ckpt)", "peak", "peak (ckpt)", "offloaded", "comm/step"):
        t.add_column(col, justify="left" if col == "engine" else "right")
    for e in doc["engines"]:
        name = e["name"] + (" (spec)" if e["name"] == doc.get("spec_engine") else "")
        t.add_row(
            name,
            *(human(e[k]) for k in ("params", "grads", "optimizer", "working", "activations", "activations_checkpointed", "peak", "peak_checkpointed", "offloaded", "comm_bytes")),
        )
    verdict = f"recommended: {rec['name']}" + (" with activation checkpointing" if rec["activation_checkpointing"] else "") if rec["name"] else "no recommendation"
    return [t, Text(f"{verdict}\n{rec['reason']}")]
