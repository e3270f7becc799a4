"""The report's figures, drawn with matplotlib into SVG text (inlined in the HTML: no
file beside it, nothing fetched when it is opened). Artists that a reader (or a test)
looks up carry ids: ``loss-<task>-<pass>``, ``fault-<task>-<n>``, ``resume-<task>-<n>``."""

from __future__ import annotations

import io

COLORS = {
    "productive": "#2e7d32", "startup": "#90a4ae", "checkpoint_load": "#5c6bc0", "checkpoint_blocked": "#fbc02d",
    "eval_consolidation": "#8e24aa", "recomputed": "#e53935", "failure_detection": "#ff7043", "shutdown": "#bdbdbd",
    "unattributed": "#eeeeee", "queued": "#cfd8dc",
}
LABELS = {
    "productive": "productive", "startup": "start-up", "checkpoint_load": "checkpoint load", "checkpoint_blocked": "checkpoint (blocked)",
    "eval_consolidation": "eval and consolidation", "recomputed": "recomputed", "failure_detection": "failure to detection",
    "shutdown": "shutdown", "unattributed": "unattributed", "queued": "queued",
}
TASKS_DRAWN = 24  # curves of at most this many tasks (a sweep's others are in the tables)


def _figure(width: float, height: float):
    import matplotlib

    matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text: smaller, searchable
    matplotlib.rcParams["svg.hashsalt"] = "orchestrate"  # the same report draws the same ids
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    text = buf.getvalue()
    return text[text.index("<svg"):]  # no XML prolog or doctype inside HTML


def _passes(points: list[dict]) -> list[list[dict]]:
    """The metrics lines cut where a new launch or generation begins (a pass over steps)."""
    out: list[list[dict]] = []
    for p in points:
        if not out or (out[-1][-1]["launch"], out[-1][-1]["generation"]) != (p["launch"], p["generation"]):
            out.append([])
        out[-1].append(p)
    return out


def plain(value) -> str:
    """Text from a record or the spec, drawn as it is: matplotlib reads $...$ as math (and
    raises on what it cannot parse)."""
    return str(value).replace("$", r"\$")


def _task_title(t: dict) -> str:
    params = ", ".join(f"{k}={v}" for k, v in t["params"].items())
    return plain(f"task {t['index']}" + (f" ({params})" if params else ""))


def loss_figure(tasks: list[dict], key: str = "loss") -> str:
    """Loss over steps per task, a line per pass (attempt or in-place restart); faults as
    red lines at the last step done, resumes as green dashes at the step resumed from."""
    shown = tasks[:TASKS_DRAWN]
    cols = 1 if len(shown) == 1 else 2
    rows = (len(shown) + cols - 1) // cols
    fig = _figure(6.5 * cols, 3.0 * rows)
    axes = fig.subplots(rows, cols, squeeze=False).flat
    for t, ax in zip(shown, axes):  # shown first: zip must not take an axes it then drops
        passes = _passes(t["points"])
        for n, seg in enumerate(passes):
            xs = [p["step"] for p in seg if p.get(key) is not None]
            ys = [p[key] for p in seg if p.get(key) is not None]
            if xs:
                (line,) = ax.plot(xs, ys, lw=1.2, marker="o" if len(xs) < 3 else None, ms=3,
                                  label=plain(f"{seg[0]['launch']} gen {seg[0]['generation']}"))
                line.set_gid(f"{key}-{t['index']}-{n}")
        evals = [(p["step"], p["eval_loss"]) for p in t["points"] if p.get("eval_loss") is not None]
        if evals and key == "loss":
            sc = ax.scatter(*zip(*evals), s=14, color="black", zorder=3, label="eval loss")
            sc.set_gid(f"eval-{t['index']}")
        for n, f in enumerate(t["faults"]):
            if f.get("step") is not None:
                ax.axvline(f["step"], color="#e53935", lw=1.5).set_gid(f"fault-{t['index']}-{n}")
            if f.get("resumed_step") is not None:
                ax.axvline(f["resumed_step"], color="#2e7d32", lw=1.2, ls="--").set_gid(f"resume-{t['index']}-{n}")
        ax.set_title(_task_title(t), fontsize=9, loc="left")
        ax.set_xlabel("step")
        ax.set_ylabel(key.replace("_", " "))
        ax.grid(alpha=0.3)
        if len(passes) > 1 or evals:
            ax.legend(fontsize=7)
    for ax in list(axes):
        ax.set_visible(False)
    return svg(fig)


def eval_figure(tasks: list[dict], ranking: dict | None) -> str | None:
    """Each evaluation metric against the step per task, the loss beside it (grey, its own
    axis); the best step by the ranking's metric starred."""
    shown = [t for t in tasks[:TASKS_DRAWN] if any(e["state"] == "DONE" for e in t["evaluations"])]
    if not shown:
        return None
    cols = 1 if len(shown) == 1 else 2
    fig = _figure(6.5 * cols, 3.0 * ((len(shown) + cols - 1) // cols))
    axes = list(fig.subplots((len(shown) + cols - 1) // cols, cols, squeeze=False).flat)
    best = {b["task"]: b for b in (ranking or {}).get("tasks", [])}
    for t, ax in zip(shown, axes):
        done = sorted((e for e in t["evaluations"] if e["state"] == "DONE" and e["metrics"]), key=lambda e: e["step"])
        for name in sorted({k for e in done for k in e["metrics"]}):
            pts = [(e["step"], e["metrics"][name]) for e in done if isinstance(e["metrics"].get(name), (int, float))]
            ax.plot(*zip(*pts), marker="o", ms=3, lw=1.2, label=plain(name))[0].set_gid(f"evalm-{t['index']}-{plain(name)}")
        if t["index"] in best:
            b = best[t["index"]]
            ax.scatter([b["step"]], [b["value"]], marker="*", s=120, color="#f9a825", zorder=4,
                       label=plain(f"best {ranking['metric']}")).set_gid(f"best-{t['index']}")
        loss = [(p["step"], p["loss"]) for p in t["points"] if p.get("loss") is not None]
        if loss:
            twin = ax.twinx()
            twin.plot(*zip(*loss), color="#9e9e9e", lw=0.8, alpha=0.7)
            twin.set_ylabel("loss", color="#9e9e9e")
        ax.set_title(_task_title(t), fontsize=9, loc="left")
        ax.set_xlabel("step")
        ax.set_ylabel("metric")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[len(shown):]:
        ax.set_visible(False)
    return svg(fig)


def throughput_figure(tasks: list[dict]) -> str:
    fig = _figure(9, 3.2)
    ax = fig.subplots()
    for t in tasks[:TASKS_DRAWN]:
        pts = [(p["step"], p["throughput"]) for p in t["points"] if p.get("throughput")]
        if pts:
            ax.plot(*zip(*pts), lw=1, label=f"task {t['index']}")[0].set_gid(f"throughput-{t['index']}")
    ax.set_xlabel("step")
    ax.set_ylabel("items/s")
    ax.grid(alpha=0.3)
    if len(tasks) > 1:
        ax.legend(fontsize=7, ncol=4)
    return svg(fig)


def timeline_figure(tasks: list[dict], t0: float) -> str:
    """A row per attempt: queued, then the allocation's segments by category, over wall time."""
    rows = [(t, a) for t in tasks[:TASKS_DRAWN] for a in t["attempts"]]
    fig = _figure(10, 0.45 * max(len(rows), 2) + 1.2)
    ax = fig.subplots()
    seen: set[str] = set()
    labels = []
    for y, (t, a) in enumerate(rows):
        labels.append(plain(f"task {t['index']} #{a['number']}" + (f" {a['nodes']}" if a.get("nodes") else "")))
        spans = []
        if a.get("submitted_at") and a.get("started_at"):
            spans.append((a["submitted_at"], a["started_at"], "queued"))
        spans += [(s["start"], s["end"], s["category"]) for s in t["segments"] if s["launch"] == a.get("launch")]
        # saves drawn over the training they blocked (the segments hold them)
        spans += [(x["time"] - x["blocked_s"], x["time"], "checkpoint_blocked") for x in t["saves"] if x.get("launch") == a.get("launch")]
        for start, end, cat in spans:
            ax.broken_barh([(start - t0, max(end - start, 1e-3))], (y - 0.35, 0.7), color=COLORS[cat],
                           label=None if cat in seen else LABELS[cat])
            seen.add(cat)
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the experiment was submitted")
    ax.grid(axis="x", alpha=0.3)
    if seen:
        ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    return svg(fig)


def goodput_figure(tasks: list[dict], totals: dict) -> str:
    """Stacked bars of each category's share of the allocated time, per task and in all."""
    from orchestrator.report.goodput import CATEGORIES

    bars = [("all", totals)] + [(f"task {t['index']}", t["goodput"]) for t in tasks[:TASKS_DRAWN]]
    fig = _figure(9, 0.4 * len(bars) + 1.4)
    ax = fig.subplots()
    for y, (name, g) in enumerate(bars):
        left = 0.0
        for cat in CATEGORIES:
            share = g["seconds"][cat] / g["allocated_s"] if g["allocated_s"] else 0.0
            if share > 0:
                ax.barh(y, share, left=left, color=COLORS[cat], label=LABELS[cat] if y == 0 else None).patches[0].set_gid(f"share-{y}-{cat}")
                left += share
    ax.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of the allocated time")
    ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    return svg(fig)


def saves_figure(tasks: list[dict]) -> str:
    fig = _figure(9, 3)
    ax = fig.subplots()
    for t in tasks[:TASKS_DRAWN]:
        s = [(x["step"], x["total_s"], x["blocked_s"]) for x in t["saves"] if x.get("step") is not None]
        if s:
            steps, total, blocked = zip(*s)
            ax.scatter(steps, total, s=12, marker="o", label=f"task {t['index']} total")
            ax.scatter(steps, blocked, s=12, marker="x", label=f"task {t['index']} blocked training")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return svg(fig)


def sweep_figure(tasks: list[dict], keys: list[str]) -> str | None:
    """Final loss by each swept parameter (numbers on a log axis when they span decades)."""
    done = [t for t in tasks if t.get("final_loss") is not None]
    if len(done) < 2 or not keys:
        return None
    fig = _figure(4 * len(keys), 3)
    for ax, key in zip(fig.subplots(1, len(keys), squeeze=False).flat, keys):
        xs = [t["params"].get(key) for t in done]
        ys = [t["final_loss"] for t in done]
        if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs):
            ax.scatter(xs, ys, s=20).set_gid(f"sweep-{key}")
            if min(xs) > 0 and max(xs) / min(xs) >= 100:
                ax.set_xscale("log")
        else:
            names = sorted({str(x) for x in xs})
            ax.scatter([names.index(str(x)) for x in xs], ys, s=20).set_gid(f"sweep-{key}")
            ax.set_xticks(range(len(names)), [plain(n) for n in names], fontsize=7)
        ax.set_xlabel(plain(key))
        ax.set_ylabel("final loss")
        ax.grid(alpha=0.3)
    return svg(fig)
