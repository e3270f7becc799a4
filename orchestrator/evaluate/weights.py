"""``checkpoint.consolidate.which: best``: a task's ``weights/`` from its best checkpoint.

The best is known only once training and the task's evaluations are over, which the job does
not wait for, so the watcher makes them then. No consolidation runs for it: each evaluation
exported its checkpoint with ``checkpoint.consolidate``'s dtype and shard size
(``export_arguments``) and ``keep_best`` keeps the best one's export, so ``weights/`` is
linked from that export (hard links; a copy across file systems), built aside and renamed
into place: never seen half made, and a watcher stopped half-way starts it again.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

from orchestrator import contract
from orchestrator.evaluate import policy

EVENT = "weights.best"
_BUILD = "best"  # the hidden folder weights/ is built in (contract.weights_tmp_dir)


def export_arguments(consolidate) -> list[str]:
    """The evaluation's export options when its export may become ``weights/``."""
    if consolidate is None or consolidate.which != "best":
        return []
    from orchestrator.spec.units import parse_bytes

    return ["--dtype", consolidate.dtype, "--max-shard-bytes", str(parse_bytes(consolidate.max_shard_size))]


def make_best(ledger, exp_id: str, idx: int, tdir: Path, rows: list[dict], keep) -> None:
    """``weights/`` from the best evaluated checkpoint by ``keep`` (``checkpoint.keep_best``),
    once; the ledger's newest ``weights.best`` event says which step it holds."""
    said = (ledger.newest_task_events(exp_id, EVENT).get(idx) or {}).get("data")
    said = json.loads(said) if isinstance(said, str) else (said or {})
    kept = policy.best(rows, keep.metric, keep.mode, 1)
    step = kept[0]["step"] if kept else None
    if "step" in said and said["step"] == step:
        return
    if step is None:
        ledger.event(exp_id, EVENT, f"no weights/: no evaluation of this task gave {keep.metric} "
                     "(checkpoint.consolidate.which: best)", idx=idx, data={"step": None})
        return
    src = contract.eval_dir(tdir, step) / "model"
    out = contract.weights_dir(tdir)
    try:
        _link_tree(src, contract.weights_tmp_dir(tdir, _BUILD))
        contract.replace_folder(contract.weights_tmp_dir(tdir, _BUILD), out, contract.weights_tmp_dir(tdir, _BUILD, old=True))
    except OSError as exc:
        shutil.rmtree(contract.weights_tmp_dir(tdir, _BUILD), ignore_errors=True)
        cause = f"no weights/ from step {step}, the best by {keep.metric}: {exc}"
        if not ledger.has_event(exp_id, "weights.failed", cause, idx=idx):
            ledger.event(exp_id, "weights.failed", cause, idx=idx, data={"step": step})
        return
    value = kept[0]["metrics"][keep.metric]
    ledger.event(exp_id, EVENT, f"step {step}, the best by {keep.metric} ({value:.4g}) -> {out}: its evaluation's "
                 "export (checkpoint.consolidate.which: best)", idx=idx, data={"step": step})


def _link_tree(src: Path, dst: Path) -> None:
    """``src``'s folders and regular files under ``dst``, linked where the file system allows.
    A link or anything else that is not a regular file in the export (the run folder is not
    trusted) is left out, never followed."""
    if not src.is_dir() or src.is_symlink() or not (src / contract.WEIGHTS_RECORD).is_file():
        raise OSError(f"the export {src} is gone or not whole")
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    for root, dirs, files in os.walk(src, followlinks=False):
        rel = Path(root).relative_to(src)
        for d in dirs:
            if not os.path.islink(Path(root) / d):
                (dst / rel / d).mkdir()
        for f in files:
            path = Path(root) / f
            if not stat.S_ISREG(os.lstat(path).st_mode):
                continue
            try:
                os.link(path, dst / rel / f, follow_symlinks=False)
            except OSError:  # another file system, or links not allowed there
                shutil.copyfile(path, dst / rel / f, follow_symlinks=False)
