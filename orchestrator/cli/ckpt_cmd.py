"""ckpt list, verify, prune, consolidate: sharded checkpoints, by experiment or by folder."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from orchestrator import contract
from orchestrator.checkpoints import commands as ckpt
from orchestrator.cli.console import stdout_console
from orchestrator.errors import UserError
from orchestrator.ledger import access
from orchestrator.states import CheckpointState


def cmd_ckpt(args) -> int:
    if args.ckpt_command == "consolidate":
        return _consolidate(args)
    if args.ckpt_command == "verify":
        return _verify(args)
    path, owner = _ckpt_target(access.home_dir(args.home), args.target)
    if args.ckpt_command == "eval":
        from orchestrator.cli.eval_cmd import evaluate  # loads models: only this command pays for it

        return evaluate(args, path)
    if args.ckpt_command == "best":
        from orchestrator.cli.eval_cmd import best

        return best(args, path, owner)
    if args.ckpt_command == "list":
        return _list(args, path)
    return _prune(args, path, owner)


def _one_checkpoint(path: str, good_only: bool = False) -> Path:
    """A checkpoint folder as given, or the newest (good) one under a task folder."""
    folder = Path(path).expanduser()
    if os.path.lexists(folder / contract.MANIFEST) or folder.name.startswith((".tmp-", "step-")):
        return folder
    found = [c for c in ckpt.find(folder) if (c.verified if good_only else c.committed)]
    if not found:
        raise UserError(f"'{folder}' holds no {'good' if good_only else 'committed'} checkpoint; see `orchestrate ckpt list {folder}`")
    return found[-1].folder


def _ckpt_target(home, target: str):
    """(path, (ledger, experiment) or None) for an experiment reference or a path."""
    path = Path(target).expanduser()
    if path.exists():
        return path, None
    ledger = access.open_ledger(home)
    exp = access.resolve_experiment(ledger, target)[0]
    return Path(exp["run_dir"]), (ledger, exp)


def _consolidate(args) -> int:
    # imported here: the consolidator reads tensors (torch, safetensors); list and prune never do
    from train_entry.consolidate import ConsolidateError, consolidate

    from orchestrator.spec.units import parse_bytes

    try:
        max_bytes = parse_bytes(args.max_shard_size)
    except ValueError as exc:
        raise UserError(f"--max-shard-size: {exc}") from None
    folder = _one_checkpoint(args.path, good_only=True)
    try:
        done = consolidate(folder, args.out, args.dtype, args.format, max_bytes, hf=args.hf, base=args.base)
    except ConsolidateError as exc:
        raise UserError(str(exc)) from None
    print(describe_weights(done, f" in {done['out']}") + f" ({done['seconds']} s)")
    return 0


def describe_weights(done: dict, where: str = "") -> str:
    """One line for a consolidation's summary."""
    size = f"{done['bytes'] / 1e6:,.1f} MB {done['dtype']}"
    kind = done.get("hf")
    if kind == "full":
        return f"{done['tensors']} tensors ({size}) of step {done['step']}: a Hugging Face model folder{where}"
    if kind in ("adapter", "adapter+merged"):
        line = f"{done['adapter_tensors']} LoRA tensors of step {done['step']}: a PEFT adapter folder{where and where + '/adapter'}"
        if kind == "adapter+merged":
            line += (f", and the base with {done['merged_adapted']} weights adapted: a model folder{where and where + '/merged'}")
        return line + f" ({size} in all)"
    return f"{done['tensors']} tensors ({size}) of step {done['step']} in {len(done['files'])} file(s){where}"


def _verify(args) -> int:
    folder = _one_checkpoint(args.path)
    problem = ckpt.verify(folder)
    if problem:
        print(f"damaged: {problem}", file=sys.stderr)
        return 1
    manifest = contract.read_manifest(folder)
    print(f"{folder}: good ({len(manifest['files'])} files, sizes and sha256 as the manifest says)")
    return 0


def _list(args, path: Path) -> int:
    found = ckpt.find(path, deep=args.deep)
    if args.json:
        print(json.dumps([
            {"task": c.task, "step": c.step, "folder": str(c.folder), "engine": c.engine, "world_size": c.world_size,
             "size": c.size, "committed": c.committed, "verified": c.verified, "problem": c.problem,
             "pinned": c.pinned} for c in found
        ], indent=2))
        return 0
    from rich.table import Table  # only the table needs rich

    t = Table(title=str(path), title_justify="left")
    for col in ("task", "step", "engine", "world", "size", "committed", "verified", "pinned", "folder"):
        t.add_column(col, overflow="fold")
    for c in found:
        t.add_row(c.task, str(c.step), c.engine or "-", str(c.world_size or "-"), ckpt.human_size(c.size),
                  "yes" if c.committed else "no", "yes" if c.verified else f"no: {c.problem}", c.pinned or "-",
                  c.folder.name)
    stdout_console().print(t)
    return 0


def _prune(args, path: Path, owner) -> int:
    """Remove all but the newest K good checkpoints per task; with an experiment, record it in the ledger.
    Nothing is deleted through a symbolic link (a ``checkpoints`` folder or a ``step-N`` that is
    one, or leads out of its task folder): those are named, left alone, and the exit code is 1."""
    plan = ckpt.plan_prune(ckpt.find(path), args.keep, args.include_pinned)
    refused = [c for c in plan.remove if _refuse_deletion(c)]
    remove = [c for c in plan.remove if c not in refused]
    for c in remove:
        print(f"{'would remove' if args.dry_run else 'removing'} task {c.task} {c.folder.name} ({ckpt.human_size(c.size)})")
    kept = len(plan.keep) + len(refused)
    if args.dry_run:
        print(f"dry run: {len(remove)} to remove, {kept} kept; nothing removed")
        return 1 if refused else 0
    removed = 0
    for c in remove:
        try:
            contract.discard_checkpoint(c.folder)  # checks again: nothing changed meanwhile
        except FileNotFoundError:
            continue  # removed meanwhile (the run's own rotation): the same end
        except contract.UnsafeDeletion as exc:
            print(f"not removing task {c.task} {c.folder.name}: {exc}", file=sys.stderr)
            kept += 1
            continue
        removed += 1
        if owner and c.step is not None and c.task.isdigit():
            owner[0].mark_checkpoint(owner[1]["id"], int(c.task), c.step, CheckpointState.PRUNED)
    if owner and removed:
        ledger, exp = owner
        ledger.event(exp["id"], "checkpoint.pruned", f"orchestrate ckpt prune --keep {args.keep}: removed {removed} checkpoint(s)")
    print(f"removed {removed} checkpoint(s), kept {kept}")
    return 1 if refused or kept > len(plan.keep) else 0


def _refuse_deletion(c) -> bool:
    """Says so on stderr when ``c`` must not be deleted (contract.deletion_problem)."""
    why = contract.deletion_problem(c.folder)
    if why:
        print(f"not removing task {c.task} {c.folder.name}: {why}", file=sys.stderr)
    return why is not None
