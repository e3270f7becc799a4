"""A save that reports its progress, so that a stalled one is caught within the heartbeat
timeout instead of ``heartbeat.save_timeout_s``.

While a save blocks training, a thread looks at the checkpoint's folder every heartbeat
interval and beats (phase ``writing``) only when the save advanced since its last look:
the folder grew, or the save passed a stage (a file hashed, the engine's write returned).
A save stuck in a collective or on a hung filesystem stops beating, as a stuck training
step does; the watcher allows ``writing`` the training timeout, not the save timeout.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from orchestrator import contract


def folder_bytes(folder: Path) -> int:
    """Bytes of the regular files under ``folder`` (links are not followed)."""
    total, stack = 0, [str(folder)]
    while stack:
        try:
            with os.scandir(stack.pop()) as entries:
                for e in entries:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
                        elif e.is_file(follow_symlinks=False):
                            total += e.stat(follow_symlinks=False).st_size
                    except OSError:  # removed while we looked (a commit's rename, a cleared tmp)
                        pass
        except OSError:
            pass
    return total


class SaveProgress:
    """``with SaveProgress(hb, step, folder):`` around a blocking save; ``advance()`` marks a stage.
    ``folder``: the checkpoints folder; every save in progress in it counts (an asynchronous
    save of an earlier step that this one waits for, too)."""

    def __init__(self, hb, step: int, folder: Path, interval_s: float):
        self.hb, self.step, self.folder, self.interval_s = hb, step, folder, interval_s
        self.stages = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="orchestrate-save-progress", daemon=True)

    def advance(self) -> None:
        self.stages += 1

    def __enter__(self) -> "SaveProgress":
        self.hb.beat(self.step, contract.Phase.WRITING, force=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _written(self) -> int:
        try:
            with os.scandir(self.folder) as entries:
                saving = [e.path for e in entries if e.name.startswith(contract.TMP_PREFIX) and e.is_dir(follow_symlinks=False)]
        except OSError:
            return 0
        return sum(folder_bytes(Path(p)) for p in saving)

    def _watch(self) -> None:
        last = (self.stages, self._written())
        while not self._stop.wait(self.interval_s):
            mark = (self.stages, self._written())
            if mark != last and not self._stop.is_set():
                last = mark
                self.hb.beat(self.step, contract.Phase.WRITING, force=True)
