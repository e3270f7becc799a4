"""data prepare, list, rm: the prepared (tokenized) data sets every experiment shares.

``prepare`` runs here, on this machine, because it was asked: what a job would otherwise
do at its first start. ``list`` and ``rm`` read the cache's layout (the contract's) only.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from orchestrator.cli.console import stdout_console
from orchestrator.contract import datacache
from orchestrator.errors import UserError
from orchestrator.ledger import access
from orchestrator.spec.hf import RECORD_KINDS


def cmd_data(args) -> int:
    return {"prepare": _prepare, "list": _list, "rm": _rm}[args.data_command](args)


def _root(args) -> Path:
    return Path(args.cache).resolve() if args.cache else access.home_dir(args.home) / "cache" / "data"


def _prepare(args) -> int:
    from orchestrator.submit import submission

    home = access.home_dir(args.home)
    plan = submission.make_plan(args.spec, args.overrides, "local", home)
    seen: dict[tuple, dict] = {}
    for t in plan.tasks:  # a sweep over data or model prepares each distinct input once
        m, d = t.spec.model, t.spec.data
        if d.kind not in RECORD_KINDS or m.kind != "hf":
            raise UserError("data prepare: the spec's data is not records to tokenize (data.kind: jsonl, parquet or arrow "
                            "with model.kind: hf)")
        for paths in [d.paths, d.eval_paths]:
            key = (tuple(paths), d.kind, d.format, m.path, m.gguf_file, d.cache_dir)
            if paths and key not in seen:
                seen[key] = {"model": m.model_dump(mode="json"), "paths": paths, "kind": d.kind, "format": d.format,
                             "cache_dir": d.cache_dir, "max_length": d.max_length}
    docs = [_prepare_one(item, args.processes, not args.json) for item in seen.values()]
    if args.json:
        print(json.dumps(docs, indent=2))
    return 0


def _prepare_one(item: dict, processes: int | None, say: bool) -> dict:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from train_entry.dataprep import ranks
    from train_entry.errors import UserCodeError
    from train_entry.hf import load

    console = stdout_console()
    try:
        tok = load.load_tokenizer(item["model"])
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                      console=console, transient=True) as bar:
            src = ranks.Source(item["paths"], item["format"], item["kind"])
            task = bar.add_task(f"tokenizing {Path(src.named()).name}", total=None)

            def on_progress(stage: str, done: int, total: int | None) -> None:
                bar.update(task, completed=done, total=total)

            said = _Said()
            examples = ranks.find_or_prepare(src, tok, item["cache_dir"], said, lambda line: None, processes, on_progress)
    except UserCodeError as exc:
        raise UserError(str(exc)) from None
    man = examples.manifest
    c, size = man["counts"], sum(f["size"] for f in man["files"].values())
    truncated = int((examples.lengths > item["max_length"]).sum())
    one = len(item["paths"]) == 1
    doc = {"path": str(examples.entry), "input": item["paths"][0] if one else item["paths"], "kind": item["kind"], "key": examples.entry.name, "bytes": size,
           "records": c["records"], "tokens": c["tokens"], "truncated": truncated, "max_length": item["max_length"],
           "without_answer": c["without_target"], "reused": said.kind != "data.prepared", "took_s": man.get("took_s")}
    if say:
        named = src.named()
        console.print(said.line if said.line.startswith(named) else f"{named}: {said.line}", highlight=False)
        console.print(f"  cache     {examples.entry}  ({_size(size)})", highlight=False)
        console.print(f"  records   {c['records']:,}   tokens {c['tokens']:,}   longest {c['longest']:,}", highlight=False)
        console.print(f"  truncated {truncated:,} at data.max_length {item['max_length']}"
                      + (f"   without an answer {c['without_target']:,}" if c["without_target"] else ""), highlight=False)
    return doc


class _Said:
    """What the preparation says as events, kept for this command's own lines."""

    def __init__(self):
        self.kind, self.line = "", ""

    def beat(self, *_args, **_kwargs) -> None:
        pass

    def event(self, kind: str, cause: str, **_extra) -> None:
        if kind != "data.progress":
            self.kind, self.line = kind, cause


def _list(args) -> int:
    root = _root(args)
    found = datacache.entries(root)
    if args.json:
        print(json.dumps([{k: v for k, v in e.items() if k != "manifest"} | _summary(e) for e in found], indent=2))
        return 0
    if not found:
        print(f"no prepared data sets in {root}")
        return 0
    from rich.table import Table

    table = Table(title=f"prepared data sets in {root}")
    for col in ("key", "records", "tokens", "size", "prepared", "input", "problem"):
        table.add_column(col, justify="right" if col in ("records", "tokens", "size") else "left", overflow="fold")
    for e in found:
        s = _summary(e)
        table.add_row(e["key"], f"{s['records']:,}" if s["records"] is not None else "", f"{s['tokens']:,}" if s["tokens"] is not None else "",
                      _size(e["bytes"]), s["prepared"], s["input"], e.get("problem", ""))
    stdout_console().print(table)
    return 0


def _summary(e: dict) -> dict:
    man = e.get("manifest") or {}
    c = man.get("counts") or {}
    inputs = man.get("inputs") or [{}]
    created = man.get("created")
    return {"records": c.get("records"), "tokens": c.get("tokens"), "input": str(inputs[0].get("path", "")),
            "prepared": time.strftime("%Y-%m-%d %H:%M", time.localtime(created)) if isinstance(created, (int, float)) else ""}


def _rm(args) -> int:
    root = _root(args)
    keys = [e["key"] for e in datacache.entries(root)] if args.all else args.keys
    if not keys:
        raise UserError("data rm: name the keys to remove (orchestrate data list), or --all")
    known = {e["key"] for e in datacache.entries(root)}
    for key in keys:
        if not datacache.KEY_RE.fullmatch(key) or key not in known:
            raise UserError(f"data rm: no prepared data set '{key}' in {root} (orchestrate data list)")
    for key in keys:
        datacache.discard_entry(root, key)
        print(f"removed {key}")
    gone = datacache.remove_stale_tmp(root)
    if gone:
        print(f"removed {len(gone)} unfinished preparation folder(s) older than a day")
    return 0


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)
