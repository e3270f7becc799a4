"""A save between its write and its commit: what the commit needs of it, and, for an
asynchronous save, the fingerprint taken from the copy its writer writes."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from train_entry.checkpoint import fingerprint


class CopyFingerprint:
    """The fingerprint of an asynchronous save, taken from the copy its writer writes, on a
    thread of its own while training goes on; ``result`` (collective) adds up the ranks'."""

    def __init__(self, engine, names: list[tuple[str, int]]):
        self.names = names
        self.copy = engine.snapshot()  # a future: the copy is made on a thread too
        self.box: list = []
        self.thread = threading.Thread(target=self._run, name="checkpoint-fingerprint", daemon=True)
        self.t0 = time.perf_counter()
        self.thread.start()

    def _run(self) -> None:
        try:
            staged = self.copy.result() if self.copy is not None else {}
            self.box.append(fingerprint.partial(staged.get("model") or {}, self.names))
        except BaseException as exc:  # raised again on the training thread, at the commit
            self.box.append(exc)
        self.seconds = time.perf_counter() - self.t0

    def done(self) -> bool:
        return not self.thread.is_alive()

    def result(self) -> dict:
        self.thread.join()
        sums = self.box[0]
        if isinstance(sums, BaseException):  # every rank still joins the all-reduce, then all raise
            try:
                fingerprint.finish(torch.zeros(len(self.names), 4, dtype=torch.float64), self.names, failed=True)
            finally:
                raise sums
        return {"fingerprint": fingerprint.finish(sums, self.names), "fingerprint_s": self.seconds}


@dataclass
class SaveInFlight:
    step: int
    tmp: Path  # the save's ``.tmp-`` folder
    meta: dict  # the manifest's own fields (launch, loss, probe, fingerprint)
    t0: float  # perf_counter when the save began
    blocked_s: float = 0.0  # training held up by the save, before its commit
    written: Any = None  # writer.Written: the files the engine hashed as it wrote them
    future: Any = None  # an asynchronous write's completion
    copy_fingerprint: CopyFingerprint | None = None  # the fingerprint still being taken
    staging_mark: float | None = None  # the engine's staging wait when an asynchronous save began

    def ready(self) -> bool:
        """This rank's write, and the fingerprint taken from its copy, are done."""
        return self.future.done() and (self.copy_fingerprint is None or self.copy_fingerprint.done())
