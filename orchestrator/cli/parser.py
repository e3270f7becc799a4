"""The command line's grammar: one small function per command group.

The subcommands are added in the order ``--help`` lists them; nothing here imports
more than argparse, so ``orchestrate --help`` starts at once.
"""

from __future__ import annotations

import argparse

from orchestrator import __version__

EPILOG = "The ledger lives in --home, else $ORCHESTRATE_HOME, else ~/.orchestrate."


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orchestrate", description="Batch orchestration and fault tolerance for distributed training on SLURM.", epilog=EPILOG)
    p.add_argument("--version", action="version", version=f"orchestrate {__version__}")
    p.add_argument("--home", help="folder of the ledger (default: $ORCHESTRATE_HOME or ~/.orchestrate)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_spec_commands(sub)
    _add_submit(sub)
    _add_watch(sub)
    _add_read_commands(sub)
    _add_ckpt(sub)
    _add_data(sub)
    _add_cancel(sub)
    return p


def _spec_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("spec", help="experiment spec (YAML)")
    sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a spec field (repeatable)")


def _add_spec_commands(sub) -> None:
    """validate, schema, plan: read a spec, submit nothing."""
    sp = sub.add_parser("validate", help="check a spec and report every error with its field and line")
    _spec_args(sp)
    sp.add_argument("--explain", action="store_true",
                    help="show where each value comes from: site or user defaults file, the spec, or --set (with lines)")

    sp = sub.add_parser("schema", help="print the spec's JSON Schema (for editors), or its reference as Markdown")
    sp.add_argument("--markdown", action="store_true", help="the field reference as a Markdown table")

    sp = sub.add_parser("plan", help="per-GPU memory and communication of each engine, and the one to use")
    _spec_args(sp)
    sp.add_argument("--gpu-memory", metavar="SIZE", help="memory of one GPU, e.g. 80G (default: resources.gpu_memory)")
    sp.add_argument("--nodes", type=int, help="nodes (default: resources.nodes)")
    sp.add_argument("--gpus-per-node", type=int, help="GPUs (ranks) per node (default: resources.tasks_per_node)")
    sp.add_argument("--task", type=int, default=0, help="which sweep task to plan (default 0)")
    sp.add_argument("--json", action="store_true")


def _add_submit(sub) -> None:
    sp = sub.add_parser("submit", help="validate, expand the sweep and submit every task")
    _spec_args(sp)
    # scheduler.EXECUTORS, not imported here: it would load the spec models at start-up
    sp.add_argument("--executor", choices=["local", "slurm"], help="default: slurm when sbatch is found, else local")
    sp.add_argument("--dry-run", action="store_true", help="print the plan; submit and record nothing")
    sp.add_argument("--watch", "--wait", dest="watch", action="store_true",
                    help="stay and watch (recover failures) until every task ends; exit 0 only if all completed")
    sp.add_argument("--interval", type=float, default=2.0, help="seconds between watcher cycles with --watch (default 2)")
    sp.add_argument("--json", action="store_true", help="print the plan or the final status as JSON")


def _add_watch(sub) -> None:
    sp = sub.add_parser("watch", help="ingest heartbeats, poll the scheduler, detect hangs and recover failures")
    sp.add_argument("experiment", nargs="?", help="id or name; default: every live experiment, until stopped")
    sp.add_argument("--interval", type=float, default=5.0, help="seconds between cycles (default 5); one scheduler poll each")
    sp.add_argument("--once", action="store_true", help="one cycle, then exit")
    sp.add_argument("--sbatch", action="store_true", help="run this watcher as a small SLURM job instead (for login nodes that stop long processes)")
    sp.add_argument("--time", default="7-00:00:00", help="time limit of the --sbatch job (default 7 days)")


def _add_read_commands(sub) -> None:
    """status, logs, events: read the ledger and the run folder."""
    sp = sub.add_parser("status", help="tasks with state, attempts, step, loss, throughput, goodput, heartbeat age")
    sp.add_argument("experiment", nargs="?", help="id or name (a name means the newest experiment of that name)")
    sp.add_argument("--json", action="store_true", help="machine-readable (format in docs/reference/status-json.md)")
    sp.add_argument("--all", action="store_true", help="every experiment with this name, not only the newest")

    sp = sub.add_parser("logs", help="the output of one rank of one task")
    sp.add_argument("experiment")
    sp.add_argument("--task", type=int, default=0)
    sp.add_argument("--rank", type=int, default=0)
    sp.add_argument("-f", "--follow", action="store_true", help="keep printing until the task ends")

    sp = sub.add_parser("events", help="the history of an experiment: every state change with its cause")
    sp.add_argument("experiment")
    sp.add_argument("--json", action="store_true")

    sp = sub.add_parser("report", help="one HTML page: loss across restarts, timeline, goodput, checkpoints, events")
    sp.add_argument("experiment", help="id or name (a name means the newest experiment of that name)")
    sp.add_argument("--out", help="where to write the page (default: report.html in the experiment's run folder)")
    sp.add_argument("--json", action="store_true", help="print the same figures as JSON instead")
    sp.add_argument("--mtbf", metavar="DURATION",
                    help="also project the goodput at a fault every DURATION (e.g. 2h, 30m, 7.9h), each costing what "
                         "this run's faults cost on average")


def _add_ckpt(sub) -> None:
    sp = sub.add_parser("ckpt", help="list, verify, prune and consolidate sharded checkpoints")
    ck = sp.add_subparsers(dest="ckpt_command", required=True, metavar="ACTION")
    c = ck.add_parser("list", help="every checkpoint: step, engine, world size, size, committed, verified")
    c.add_argument("target", help="experiment id or name, run folder, task folder, or checkpoint folder")
    c.add_argument("--deep", action="store_true", help="verify sha256 of every file too (reads everything)")
    c.add_argument("--json", action="store_true")
    c = ck.add_parser("verify", help="check one checkpoint: every file present, sizes and sha256 as the manifest says")
    c.add_argument("path", help="a step-N folder (or a task folder: its newest checkpoint)")
    c = ck.add_parser("consolidate", help="one checkpoint -> full weights (safetensors shards + index), streaming; "
                      "for model kind hf a Hugging Face folder (the model, or adapter/ and merged/)")
    c.add_argument("path", help="a step-N folder (or a task folder: its newest good checkpoint)")
    c.add_argument("--out", required=True, help="a new folder for the weights")
    c.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    c.add_argument("--format", default="safetensors", choices=["safetensors", "torch"])
    c.add_argument("--max-shard-size", default="5GB", help="largest output file (default 5GB): also the memory bound")
    c.add_argument("--hf", action=argparse.BooleanOptionalAction, default=None,
                   help="a Hugging Face folder: the model (full fine-tune), or adapter/ and merged/ (LoRA); the default "
                   "for checkpoints of model kind hf (they hold hf.json); --no-hf: the tensors under the checkpoint's names")
    c.add_argument("--base", metavar="FOLDER", help="with --hf: the base model folder, if it is no longer where the "
                   "checkpoint's hf.json says (it must still be the same model: its fingerprint is checked)")
    c = ck.add_parser("eval", help="evaluate checkpoints by generation: greedy answers to prompts, scored against "
                      "references (each result in the task's evals/step-N/)")
    c.add_argument("target", help="experiment id or name, run folder, task folder, or a checkpoint folder")
    c.add_argument("--prompts", required=True, metavar="FILE", help="JSONL: chats ending with the reference answer "
                   "(a held-out split as it is), or {\"prompt\", \"reference\"}")
    c.add_argument("--all", action="store_true", help="every good checkpoint, in step order (default: the newest of each task)")
    c.add_argument("--again", action="store_true", help="evaluate checkpoints that have a result already")
    c.add_argument("--metric", action="append", default=None, choices=["exact_match", "contains"],
                   help="exact_match (default), contains; repeat for both")
    c.add_argument("--score", metavar="MODULE:FUNCTION", help="your own metric: a function (answer, reference, prompt) "
                   "-> number, importable from here")
    c.add_argument("--max-new-tokens", type=int, default=None, help="default: a few past the longest reference")
    c.add_argument("--json", action="store_true", help="the results as JSON")
    c = ck.add_parser("best", help="the best evaluated checkpoints of each task (checkpoint.keep_best, or a metric you name)")
    c.add_argument("target", help="experiment id or name, run folder, or task folder")
    c.add_argument("--metric", default=None, help="default: keep_best's metric, else the evaluations' first")
    c.add_argument("--mode", choices=["max", "min"], default=None, help="default: keep_best's, else max")
    c.add_argument("-n", type=int, default=None, help="how many per task (default: keep_best's n, else 1)")
    c.add_argument("--json", action="store_true")
    c = ck.add_parser("prune", help="delete all but the newest K good checkpoints of each task, and the pinned ones")
    c.add_argument("target", help="experiment id or name, run folder, task folder, or checkpoints folder")
    c.add_argument("--keep", type=int, required=True, metavar="K")
    c.add_argument("--dry-run", action="store_true", help="print what would be removed; remove nothing")
    c.add_argument("--include-pinned", action="store_true", help="remove pinned checkpoints (the best ones, the "
                   "Trainer's best) past the newest K too")


def _add_data(sub) -> None:
    sp = sub.add_parser("data", help="prepare (tokenize once), list and remove the data sets every experiment shares")
    dt = sp.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    c = dt.add_parser("prepare", help="tokenize a spec's data into the cache now, on this machine, with a progress bar; "
                      "prints the cache's path, size, and its record, token and truncation counts")
    _spec_args(c)
    c.add_argument("--processes", type=int, metavar="N", help="tokenizing processes (default: one per core, fewer for small data)")
    c.add_argument("--json", action="store_true")
    for name, helptext in (("list", "every prepared data set: key, records, tokens, size, input"),
                           ("rm", "remove prepared data sets (a run that needs one again prepares it again)")):
        c = dt.add_parser(name, help=helptext)
        c.add_argument("--cache", metavar="DIR", help="the cache folder (default: $ORCHESTRATE_HOME/cache/data, "
                       "where data.cache_dir points unless a spec sets it)")
        if name == "list":
            c.add_argument("--json", action="store_true")
        else:
            c.add_argument("keys", nargs="*", metavar="KEY")
            c.add_argument("--all", action="store_true", help="every prepared data set in the cache")


def _add_cancel(sub) -> None:
    sp = sub.add_parser("cancel", help="stop an experiment's live tasks (never requeued)")
    sp.add_argument("experiment")
    sp.add_argument("--task", type=int, help="only this task")
