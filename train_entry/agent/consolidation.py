"""The job's last step when the spec sets ``checkpoint.consolidate``: full weights from the
final checkpoint into the task's ``weights/`` folder; for ``model: {kind: hf}`` a Hugging
Face folder (the model of a full fine-tune; ``adapter/``, and ``merged/`` with
``export.merge_lora``, for LoRA and QLoRA). With ``which: best`` nothing here: the watcher
makes them from the best checkpoint's evaluation export (``orchestrator.evaluate.weights``).

Node 0's agent runs it once every rank finished, as its own process (the ranks' memory is
free by then), under a timeout, and stops it on SIGTERM. What happens is told to the
ledger through the task's events file; a failure is the launch's failure, named, and not
retried (the committed checkpoint stays: ``orchestrate ckpt consolidate`` does it by hand).
Safe to run again: weights already made from the same checkpoint are kept.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from orchestrator import contract
from orchestrator.contract import ExitCode

from train_entry.consolidate import RECORD

TERM_GRACE_S = 10.0


class _Step:
    """The events and the error record of one run of the step."""

    def __init__(self, tdir: Path, launch: str, generation: int):
        self.tdir, self.launch, self.generation = tdir, launch, generation

    def event(self, kind: str, cause: str, **extra) -> None:
        contract.append_jsonl(contract.events_path(self.tdir), {"event": kind, "cause": cause, "launch": self.launch,
                                                                "generation": self.generation, "time": time.time(), **extra})

    def failed(self, why: str) -> int:
        """Not retried either way (the same checkpoint fails the same way) and never the
        user's code: our step, on our checkpoint; the reason says what went wrong."""
        self.event("weights.failed", why)
        contract.atomic_write_json(
            contract.step_error_path(self.tdir, self.launch, "consolidate"),
            {"where": "the consolidation step", "exit_code": int(ExitCode.INTERNAL_ERROR), "type": "ConsolidationFailed",
             "kind": contract.FailureKind.INTERNAL.value, "message": why, "generation": self.generation, "time": time.time()},
        )
        return ExitCode.INTERNAL_ERROR


def run(cfg: contract.TaskConfig, tdir: Path, launch: str, generation: int, signals: list[int]) -> int:
    opts = cfg.checkpoint.consolidate
    rec = _Step(tdir, launch, generation)
    if opts.which == "best":  # not known until the evaluations, which outlive the job, are over
        rec.event("weights.deferred", "checkpoint.consolidate.which: best: the watcher writes weights/ from the best "
                  "checkpoint's export once the task's evaluations are over")
        return ExitCode.OK
    out = contract.weights_dir(tdir)
    found = contract.committed_checkpoints(tdir)
    if not found:  # the built-in loop always saves its last step; a script may not have saved at all
        return rec.failed("no committed checkpoint to consolidate")
    step, folder = found[0]
    done = contract.read_json(out / RECORD)
    if done and done.get("source") == str(folder.resolve()):
        rec.event("weights.consolidated", f"{out} already holds the weights of step {step}", folder=str(out))
        return ExitCode.OK
    tmp = contract.weights_tmp_dir(tdir, launch)
    shutil.rmtree(tmp, ignore_errors=True)
    hf = cfg.model.get("kind") == "hf"  # a Hugging Face folder: the model, or adapter/ (+ merged/) for LoRA
    argv = [sys.executable, "-m", "train_entry.consolidate", str(folder), "--out", str(tmp), "--dtype", opts.dtype,
            "--format", opts.format, "--max-shard-bytes", str(opts.max_shard_bytes), "--hf" if hf else "--no-hf"]
    rec.event("weights.consolidating", f"step {step} ({folder.name}) into {out}: {opts.dtype} {opts.format}"
              + (" (a Hugging Face folder)" if hf else ""))
    log = contract.consolidate_log_path(tdir)
    log.parent.mkdir(parents=True, exist_ok=True)
    ended = _supervise(argv, tdir, log, opts.timeout_min * 60, signals)
    if ended != "exited":
        shutil.rmtree(tmp, ignore_errors=True)
        if ended == "stopped":
            rec.event("weights.failed", "the consolidation was stopped by a signal; the next launch does it again")
            return ExitCode.CANCELLED
        if ended == "timeout":
            return rec.failed(f"the consolidation took longer than checkpoint.consolidate.timeout_min ({opts.timeout_min} min); see {log}")
        return rec.failed(f"{_last_error(log)} ({ended}; see {log})")
    summary = contract.read_json(tmp / RECORD) or {}
    # weights of an older checkpoint: replaced only once the new ones are whole
    contract.replace_folder(tmp, out, contract.weights_tmp_dir(tdir, launch, old=True))
    layout = {"full": "; a Hugging Face model folder", "adapter": "; a PEFT adapter folder: adapter/",
              "adapter+merged": "; a PEFT adapter folder (adapter/) and the merged model (merged/)"}.get(summary.get("hf"), "")
    rec.event("weights.consolidated", f"step {step} -> {out}: {summary.get('tensors')} tensors, {summary.get('bytes', 0) / 1e6:,.1f} MB "
                f"{opts.dtype} in {len(summary.get('files', []))} file(s){layout}", folder=str(out), bytes=summary.get("bytes"))
    return ExitCode.OK


def _supervise(argv: list[str], cwd: Path, log: Path, timeout: float, signals: list[int]) -> str:
    """Run the consolidation; ``exited`` (0), ``exit N``, ``stopped`` (a signal to the agent) or ``timeout``."""
    with open(log, "ab") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, cwd=str(cwd))
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            stop = any(s in (signal.SIGTERM, signal.SIGINT) for s in signals)
            if stop or time.monotonic() > deadline:
                proc.terminate()
                try:
                    proc.wait(TERM_GRACE_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                return "stopped" if stop else "timeout"
            time.sleep(0.5)
    return "exited" if proc.returncode == 0 else f"exit {proc.returncode}"


def _last_error(log: Path) -> str:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "the consolidation failed"
    errors = [ln for ln in lines if ln.startswith("error:")]
    return (errors or lines or ["the consolidation failed"])[-1][:500]
