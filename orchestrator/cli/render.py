"""Ledger rows -> what users read: the status document (read from the ledger, at a
given time), and tables and event lines (pure functions of that document and rows).

Whatever comes from the ledger may be of a damaged type (an older version stored what
a bad record said) or hostile text (a trainer's event cause): the document coerces each
value to its type or None, and everything printed goes through ``printable`` (control
characters escaped, long text cut) into rich ``Text`` (never read as markup).
"""

from __future__ import annotations

import json
import math
import re
import time
import unicodedata
from typing import TYPE_CHECKING, Any

from rich.cells import cell_len
from rich.console import Group
from rich.text import Text

from orchestrator.contract.safe_read import cut
from orchestrator.evaluate import policy
from orchestrator.ledger import Ledger
from orchestrator.ledger.names import watch_lease
from orchestrator.ledger.values import as_text

if TYPE_CHECKING:
    from rich.table import Table  # imported where a table is made: status of a sweep needs none

MESSAGE_MAX = 500  # an event's cause, a task's reason
VALUE_MAX = 200  # any other value in a table cell

# C0 and C1 controls, and the format characters that reorder or hide text (bidi overrides)
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u00ad\u061c\u115f\u1160\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff\ufff9-\ufffb\ud800-\udfff]")


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def printable(value: Any, limit: int = MESSAGE_MAX) -> str:
    """One line of terminal-safe text: control and invisible format characters escaped
    (ESC, CR, newline, bidi overrides), cut to ``limit`` characters."""
    text = cut(as_text(value), limit)
    text = _UNSAFE.sub(_escape, text)
    if not text.isprintable():  # other format characters (Cf) the pattern does not list
        text = "".join(ch if ch.isprintable() or unicodedata.category(ch) != "Cf" else f"\\u{ord(ch):04x}" for ch in text)
    return text


def _number(value: Any) -> float | int | None:
    """A finite number, or None (a damaged value never reaches a format spec)."""
    if type(value) is int:
        return value
    if type(value) is float and math.isfinite(value):
        return value
    return None


def _str(value: Any) -> str | None:
    return None if value is None else as_text(value)


def _params(raw: Any) -> dict:
    try:
        params = json.loads(raw or "{}")
    except (TypeError, ValueError, RecursionError):
        return {"params": as_text(raw)}
    return params if isinstance(params, dict) else {"params": params}


def _fault_costs(raw: Any) -> dict:
    """kind -> count, per_fault_s, queued_per_fault_s; what is not of that shape is left out."""
    try:
        costs = json.loads(raw or "{}")
    except (TypeError, ValueError, RecursionError):
        return {}
    if not isinstance(costs, dict):
        return {}
    keys = ("count", "per_fault_s", "queued_per_fault_s")
    return {as_text(k): {f: _number(v.get(f)) for f in keys} for k, v in list(costs.items())[:50] if isinstance(v, dict)}


def _nodes(last: dict, task: dict) -> list[str]:
    nodes = _str(last.get("nodes")) or _str(task.get("nodes")) or ""
    return [n for n in nodes.split(",") if n]


def evaluations_document(rows: list[dict]) -> dict | None:
    """A task's evaluations of checkpoints: counts by state, the latest result, the best
    step by each metric (higher is better; ties: the later step, as keep_best keeps); None
    when it has none."""
    if not rows:
        return None
    done = [r for r in rows if r["state"] == "DONE" and isinstance(r.get("metrics"), dict)]
    counts = {state.lower(): sum(r["state"] == state for r in rows) for state in ("PENDING", "RUNNING", "DONE", "FAILED", "SKIPPED")}
    best = {}
    for name in sorted({k for r in done for k in r["metrics"]}):
        top = policy.best(done, name, "max", 1)
        if top:
            best[name] = {"step": top[0]["step"], "value": top[0]["metrics"][name]}
    latest = max(done, key=lambda r: r["step"], default=None)
    return {**counts, "latest": latest and {"step": latest["step"], "metrics": latest["metrics"]}, "best": best}


def task_document(t: dict, mine: list[dict], now: float, preparing: dict | None = None, evals: list[dict] | None = None) -> dict:
    """One task of the status document; every value of its type, or None. ``preparing``:
    the task's newest data-preparation progress event, said as its reason until it trains."""
    last = mine[-1] if mine else {}
    ended = last.get("state") not in (None, "PENDING", "RUNNING", "COMPLETED")
    heartbeat_at = _number(t.get("heartbeat_at"))
    return {
        "index": t["idx"],
        "params": _params(t.get("params")),
        "state": _str(t.get("state")),
        "attempts": len(mine),
        "restarts": sum(_number(a.get("restarts")) or 0 for a in mine),
        "step": _number(t.get("step")),
        "loss": _number(t.get("loss")),
        "eval_loss": _number(t.get("eval_loss")),
        "throughput": _number(t.get("throughput")),
        "goodput": _number(t.get("goodput")),  # productive / allocated time, as the watcher last added it up
        "heartbeat_age_s": round(now - heartbeat_at, 1) if heartbeat_at else None,
        "hang_timeout_s": _number(t.get("hang_timeout_s")),  # steady training's, as the watcher applies it
        "fault_costs": _fault_costs(t.get("fault_costs")),  # by kind, added up with the goodput
        "nodes": _nodes(last, t),
        "job_id": _str(last.get("job_id")),
        "checkpoint": _str(t.get("checkpoint")),
        "reason": _str(_reason(t, mine, last if ended else {}, preparing)),
        "failure": _str(last.get("failure")) if ended else None,
        "evaluations": evaluations_document(evals or []),  # eval.checkpoints
    }


def _reason(t: dict, mine: list[dict], ended_attempt: dict, preparing: dict | None) -> Any:
    reason = t.get("reason") or ended_attempt.get("reason")
    if not reason and not mine and t.get("state") == "PENDING":
        return "waiting for room in the queue"
    if not reason and preparing and t.get("state") == "RUNNING" and _number(t.get("step")) is None:
        return preparing.get("cause")  # "preparing data: N of M records tokenized (P%)"
    return reason


def status_document(ledger: Ledger, experiments: list[dict], now: float | None = None) -> dict:
    """The `status --json` document (its format is documented in docs/reference/status-json.md)."""
    now = time.time() if now is None else now
    out = []
    for exp in experiments:
        attempts: dict[int, list[dict]] = {}
        for a in ledger.attempts(exp["id"]):
            attempts.setdefault(a["idx"], []).append(a)
        preparing = ledger.newest_task_events(exp["id"], "data.progress")
        evals: dict[int, list[dict]] = {}
        for r in ledger.evaluations(exp["id"]):
            evals.setdefault(r["idx"], []).append(r)
        tasks = [task_document(t, attempts.get(t["idx"], []), now, preparing.get(t["idx"]), evals.get(t["idx"]))
                 for t in ledger.tasks(exp["id"])]
        out.append(
            {
                "name": exp["name"],
                "id": exp["id"],
                "state": exp["state"],
                "executor": exp["executor"],
                "created_at": exp["created_at"],
                "run_dir": exp["run_dir"],
                "watcher": (ledger.lease(watch_lease(exp["id"])) or {}).get("owner"),
                "tasks": tasks,
            }
        )
    return {"experiments": out}


_STYLE = {"COMPLETED": "green", "FAILED": "red", "CANCELLED": "yellow", "RUNNING": "cyan", "RECOVERING": "magenta"}


def _fmt(v: Any, spec: str = "", limit: int = VALUE_MAX) -> str:
    if v is None or v == "":
        return "-"
    if spec and _number(v) is not None:
        return format(v, spec)
    return printable(v, limit)


def _cell(v: Any, spec: str = "", limit: int = VALUE_MAX, style: str = "") -> Text:
    return Text(_fmt(v, spec, limit), style=style)


def _state_style(state: Any) -> str:
    return _STYLE.get(state, "white") if isinstance(state, str) else "white"


_COLUMNS = ("task", "params", "state", "att", "rst", "step", "loss", "eval", "thru/s", "goodput", "hb age/hang", "nodes", "checkpoint",
            "reason")
LINES_FROM = 25  # tasks from which a table is one cropped line per task, like squeue


def _row(task: dict) -> list[Text]:
    params = ", ".join(f"{as_text(k)}={as_text(v)}" for k, v in task["params"].items())
    age = task["heartbeat_age_s"]
    return [
        _cell(task["index"]),
        _cell(params),
        _cell(task["state"], style=_state_style(task["state"])),
        _cell(task["attempts"]),
        _cell(task["restarts"]),
        _cell(task["step"]),
        _cell(task["loss"], ".4f"),
        _cell(task["eval_loss"], ".4f"),
        _cell(task["throughput"], ",.0f"),
        Text("-" if _number(task["goodput"]) is None else f"{100 * task['goodput']:.0f}%"),
        Text(_seconds(age) + ("/" + _seconds(task.get("hang_timeout_s")) if _number(task.get("hang_timeout_s")) else "")),
        _cell(",".join(task["nodes"])),
        _cell(task["checkpoint"]),
        _cell(task["reason"], limit=MESSAGE_MAX),
    ]


def _seconds(v: Any) -> str:
    return _fmt(v, ".0f") + ("s" if _number(v) is not None else "")


def _lines(title: Text, rows: list[list[Text]], caption: str | None) -> Group:
    """One line per task, columns as wide as their widest value, each line cropped at the
    terminal's edge: a sweep reads like squeue, in a tenth of the time rich's table takes
    to lay out every cell (0.5 ms a row)."""
    widths = [max(cell_len(c), *(r[j].cell_len for r in rows)) for j, c in enumerate(_COLUMNS)]

    def line(cells: list[Text], style: str = "") -> Text:
        out = Text(style=style, no_wrap=True, overflow="ellipsis", end="")
        for j, c in enumerate(cells):
            if j:
                out.append("  ")
            out.append_text(c)
            if j < len(cells) - 1:
                out.append(" " * (widths[j] - c.cell_len))
        return out

    body = [line([Text(c) for c in _COLUMNS], "bold")] + [line(r) for r in rows]
    parts = [title, Text("\n", no_wrap=True, overflow="ellipsis").join(body)]
    if caption:
        parts.append(Text(caption, style="dim"))
    return Group(*parts)


def status_tables(doc: dict) -> list:
    """A table per experiment: boxed, with long values folded, or one line per task for
    sweeps of LINES_FROM tasks and more."""
    tables = []
    for exp in doc["experiments"]:
        title = Text.assemble(
            printable(exp["name"], VALUE_MAX), " ", (printable(exp["id"], VALUE_MAX), "dim"), " ",
            (printable(exp["state"], VALUE_MAX), _state_style(exp["state"])), f" ({printable(exp['executor'], VALUE_MAX)})",
        )
        notes = []
        if exp["watcher"] is None and exp["state"] not in ("COMPLETED", "FAILED", "CANCELLED"):
            notes.append("no watcher: hangs and failures are recovered only while `orchestrate watch` runs")
        notes += [_evals_line(task) for task in exp["tasks"][:EVAL_LINES] if task.get("evaluations")]
        caption = "\n".join(notes) or None
        rows = [_row(task) for task in exp["tasks"]]
        if len(rows) >= LINES_FROM:
            tables.append(_lines(title, rows, caption))
            continue
        from rich.table import Table

        t = Table(title=title, title_justify="left", caption=caption)
        for col in _COLUMNS:
            t.add_column(col, overflow="fold")
        for r in rows:
            t.add_row(*r)
        tables.append(t)
    return tables


EVAL_LINES = 8  # tasks whose evaluations the table's caption names (`status --json` has every one)


def _evals_line(task: dict) -> str:
    ev = task["evaluations"]
    parts = [f"task {task['index']} checkpoint evaluations: {ev['done']} done"]
    parts += [f"{ev[k]} {k}" for k in ("running", "pending", "failed", "skipped") if ev[k]]
    line = ", ".join(parts)
    if ev["latest"]:
        numbers = ", ".join(f"{printable(k, 40)} {v:.3g}" for k, v in ev["latest"]["metrics"].items() if _number(v) is not None)
        line += f"; step {ev['latest']['step']}: {numbers}"
        line += "; best: " + ", ".join(f"{printable(k, 40)} {b['value']:.3g} at step {b['step']}" for k, b in ev["best"].items())
    return line


def _when(t: Any) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    except (TypeError, ValueError, OverflowError, OSError):
        return printable(t, 19).ljust(19)


def event_line(e: dict) -> str:
    """One event as one terminal-safe line."""
    idx, attempt = e.get("idx"), e.get("attempt")
    who = "experiment" if idx is None else f"task {printable(idx, 20)}" + (f" attempt {printable(attempt, 20)}" if attempt else "")
    change = f" {printable(e.get('old_state') or '-', 40)} -> {printable(e.get('new_state'), 40)}" if e.get("new_state") else ""
    return f"{_when(e.get('time'))}  {who:<20} {printable(e.get('kind'), 60):<22}{change}  {printable(e.get('cause'))}"


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
    from rich.table import Table

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
    return [t, Text("\n".join(line for line in (verdict, rec["reason"], _host_load(doc)) if line))]


def _host_load(doc: dict) -> str:
    """One line: the host memory a rank holds while it reads the weights, for the spec's
    engine and the recommended one (every engine's is in --json)."""
    from orchestrator.submit.memory_plan import human

    if doc["model"].get("counted_by", "formula") == "formula":
        return ""  # the built-in model: made on each rank, no files to read
    named = [n for n in (doc.get("spec_engine"), doc["recommendation"]["name"]) if n]
    parts = []
    for e in doc["engines"]:
        if e["name"] in named and e["name"] not in [p[0] for p in parts]:
            shared = " (memory-mapped files: the node's ranks share their pages)" if e["host_load_shared"] else ""
            parts.append((e["name"], f"{e['name']} {human(e['host_load'])}{shared}"))
    return "host memory per rank to read the weights: " + "; ".join(p[1] for p in parts) if parts else ""


def sources_table(sources: dict) -> Table:
    """`validate --explain`: each value that is not a built-in default and where it came
    from (``layers.explain``'s rows), under the defaults files that were read."""
    from rich.table import Table

    files = ", ".join(f"{f['layer']} {printable(f['file'], VALUE_MAX)}" for f in sources["layers"]) or "none"
    t = Table(title=f"where each value comes from (defaults files: {files}); every other field has its built-in default",
              title_justify="left")
    for col in ("field", "value", "from", "where"):
        t.add_column(col)
    for row in sources["values"]:
        where = row["file"] if row["line"] is None else f"{row['file']}:{row['line']}"
        value = json.dumps(row["value"], ensure_ascii=False)
        t.add_row(_cell(row["field"]), _cell(value, limit=80), _cell(row["layer"], style=_LAYER_STYLE.get(row["layer"], "")), _cell(where))
    return t


_LAYER_STYLE = {"site": "magenta", "user": "cyan", "--set": "yellow"}
