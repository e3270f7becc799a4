"""Rotation: the committed checkpoints past ``keep_last``, but for the pinned ones
(``contract.pins``: the best by an evaluation, the Trainer's best), are renamed out of the way at
once and deleted on a thread (deleting gigabytes holds training up for a while). A
process cut short leaves ``.trash-`` folders that the next start removes; nothing is
ever deleted through a symbolic link.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from orchestrator import contract


class Rotation:
    def __init__(self, task_dir: Path, keep_last: int):
        self.task_dir, self.keep_last = task_dir, keep_last
        self.remover: threading.Thread | None = None  # deletes what the last rotation discarded

    def rotate(self) -> None:
        """Rank 0, after a commit: discard the checkpoints past ``keep_last``."""
        self.wait()
        trash = []
        pinned = contract.read_pins(self.task_dir)
        unseen = contract.unseen_after(self.task_dir)  # eval.checkpoints: the watcher has not looked at these yet
        for step, folder in contract.committed_checkpoints(self.task_dir)[self.keep_last:]:
            if step in pinned or (unseen is not None and step > unseen):
                continue
            try:
                trash.append(contract.discard_checkpoint(folder, remove=False))
            except contract.UnsafeDeletion as exc:  # kept: never deleted through a link
                print(f"checkpoint rotation: {folder.name} not removed: {exc}", file=sys.stderr, flush=True)
        if trash:
            self.remover = threading.Thread(target=lambda: [contract.remove_trash(t) for t in trash],
                                            name="checkpoint-rotation", daemon=True)
            self.remover.start()

    def wait(self) -> None:
        """The last rotation's deletions are done."""
        if self.remover is not None:
            self.remover.join()
            self.remover = None
