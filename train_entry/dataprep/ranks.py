"""Who does what with the data when a generation of ranks starts.

Global rank 0 finds the entry for the inputs' content: checked and reused; or, when
there is none (or it is damaged: discarded, with an event), prepared by whoever holds the
cache's claim for that key, this rank or another experiment's, while this one waits. It
then names the entries in the generation's hand-off note. Every other rank waits for the
note and opens what it names: no rank but one ever tokenizes, hashes or checks the data
whole, and a rank's memory holds only the pages it reads.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from orchestrator import contract
from orchestrator.contract import datacache

from train_entry.dataprep import build
from train_entry.dataprep.store import Examples

POLL_S = 0.2
CLAIM_BEAT_S = 10.0


class Unwatched:
    """A heartbeat's ``beat`` and ``event`` that go nowhere: preparing outside a rank
    (a benchmark, a test; ``orchestrate data prepare`` keeps what is said)."""

    def beat(self, *_args, **_kwargs) -> None:
        pass

    def event(self, *_args, **_kwargs) -> None:
        pass


@dataclass
class Source:
    """One data set a run reads: its inputs, record format and kind of input (``sources.KINDS``)."""

    paths: list[str]
    fmt: str
    kind: str = "jsonl"

    def named(self) -> str:
        return self.paths[0] + (f" and {len(self.paths) - 1} more" if len(self.paths) > 1 else "")


def open_sets(sources: dict[str, Source], tokenizer, cache_root: str, task_dir: str | Path, ctx, hb, log: Callable[[str], None]) -> dict[str, Examples]:
    """The prepared examples of each named source ("train", "eval"), this rank's way."""
    ldir = contract.launch_dir(task_dir, ctx.launch)
    note = contract.data_handoff_path(ldir, ctx.generation)
    if ctx.rank != 0:
        keys = _wait_for_note(note, set(sources), hb)
        return {name: Examples(datacache.entry_dir(cache_root, key)) for name, key in keys.items()}
    opened = {name: find_or_prepare(src, tokenizer, cache_root, hb, log) for name, src in sources.items()}
    contract.atomic_write_json(note, {"generation": ctx.generation, "keys": {n: e.entry.name for n, e in opened.items()}})
    return opened


def find_or_prepare(src: Source, tokenizer, cache_root: str, hb, log: Callable[[str], None],
                    num_proc: int | None = None, on_progress: build.Progress | None = None) -> Examples:
    """The entry for ``src``: reused when complete and whole, else prepared once (here, or
    by whoever already is: this waits for it). Says what it did as an event; ``hb`` is a
    rank's heartbeat, or anything with its ``beat`` and ``event``."""
    t0 = time.time()
    data = build.inputs(src.paths, src.fmt, tokenizer, cache_root, src.kind)
    claim = datacache.Claim(cache_root, data.key)
    waited_for: dict | None = None
    while True:
        found = _whole(data, cache_root, hb, log)
        if found is not None:
            if waited_for is not None:
                hb.event("data.waited", f"waited {time.time() - t0:.0f} s for {waited_for.get('host')} (pid "
                         f"{waited_for.get('pid')}) to prepare {src.named()}", key=data.key, seconds=round(time.time() - t0, 3))
            else:
                c = found.manifest["counts"]
                hb.event("data.reused", f"{src.named()}: the prepared set {data.key} ({c['records']:,} records, "
                         f"{c['tokens']:,} tokens) matches the files' content and the tokenizer; found and checked in "
                         f"{time.time() - t0:.2f} s", key=data.key, seconds=round(time.time() - t0, 3))
            return found
        if claim.take():
            try:
                # its last holder may have committed it between our look and the take
                found = _whole(data, cache_root, hb, log)
                if found is None:
                    return _prepare(data, tokenizer, cache_root, claim, hb, log, num_proc, on_progress)
            finally:
                claim.release()
            continue
        waited_for = claim.holder() or waited_for or {}
        hb.beat(0, contract.Phase.INIT)
        time.sleep(POLL_S * 5)


def _whole(data: build.Inputs, cache_root: str, hb, log) -> Examples | None:
    """The complete entry, its file read whole against the digest unless it is unchanged
    since it was written (size and mtime as the manifest says: checked then); a damaged
    one is discarded."""
    entry = datacache.entry_dir(cache_root, data.key)
    if not entry.is_dir():
        return None
    try:
        found = Examples(entry)
        if not found.unchanged():
            found.verify()
        return found
    except datacache.CacheError as exc:
        hb.event("data.damaged", f"{exc}; discarded, and prepared again", key=data.key)
        log(f"the prepared data set {data.key} is damaged ({exc}); preparing it again")
        datacache.discard_entry(cache_root, data.key)
        return None


def _prepare(data: build.Inputs, tokenizer, cache_root: str, claim: datacache.Claim, hb, log, num_proc: int | None,
             on_progress: build.Progress | None) -> Examples:
    t0 = time.time()
    log(f"preparing {_named(data.paths)} once for every run on the same content (cache {cache_root})")
    beating = _ClaimBeat(claim)
    said = [0.0, -1]

    def progress(stage: str, done: int, total: int | None) -> None:
        hb.beat(0, contract.Phase.INIT)
        if on_progress is not None:
            on_progress(stage, done, total)
        pct = int(100 * done / total) if total else 0
        if stage == "tokenizing" and (pct // 10 > said[1] // 10 or time.time() - said[0] > 60):
            said[:] = [time.time(), pct]
            line = f"preparing data: {done:,} of {total:,} records tokenized ({pct}%)"
            log(line)
            hb.event("data.progress", line, key=data.key, done=done, total=total)

    beating.start()
    try:
        entry, manifest = build.prepare(data, tokenizer, cache_root, progress, num_proc)
    finally:
        beating.stop()
    c = manifest["counts"]
    line = (f"prepared {c['records']:,} records ({c['tokens']:,} tokens) of {_named(data.paths)} in {time.time() - t0:.1f} s "
            f"with {c['processes']} process(es): {entry}")
    log(line)
    hb.event("data.prepared", line, key=data.key, seconds=round(time.time() - t0, 3))
    return Examples(entry, manifest)


def _named(paths: list[str]) -> str:
    return Source(paths, "").named()


class _ClaimBeat:
    """The claim beaten while its holder lives, whatever the preparation is doing (reading
    the files gives no progress to beat on): only a dead holder's claim goes stale."""

    def __init__(self, claim: datacache.Claim):
        self.claim, self.stopped = claim, threading.Event()
        self.thread = threading.Thread(target=self._run, name="orchestrate-data-claim", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(5)

    def _run(self) -> None:
        while not self.stopped.wait(CLAIM_BEAT_S):
            try:
                self.claim.beat()
            except OSError:
                pass


def _wait_for_note(note: Path, names: set[str], hb) -> dict[str, str]:
    """The entries rank 0 named for this generation (it prepares meanwhile; its heartbeat,
    not this rank's, says whether it is alive)."""
    while True:
        rec = contract.read_json(note)
        if isinstance(rec, dict) and isinstance(rec.get("keys"), dict):
            keys = rec["keys"]
            if set(keys) != names or not all(isinstance(k, str) and datacache.KEY_RE.fullmatch(k) for k in keys.values()):
                raise datacache.CacheError(f"{note}: names {sorted(keys)[:4]}, expected {sorted(names)} (a damaged hand-off note)")
            return keys
        hb.beat(0, contract.Phase.INIT)
        time.sleep(POLL_S)
