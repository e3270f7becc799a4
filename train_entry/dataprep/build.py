"""Preparing one cache entry: the records read, tokenized with ``datasets.Dataset.map`` in
several processes, written as one memory-mappable Arrow file, its digest in the manifest,
and the folder renamed into place. The key is what decides the tokens: the input files'
content, the tokenizer (its vocabulary, rules, special tokens and chat template), the
record format, and the library versions that render and tokenize. Not ``max_length``,
packing, the split or the seed: they are applied when the entry is opened, so a sweep over
them shares one entry."""

from __future__ import annotations

import functools
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from orchestrator import contract
from orchestrator.contract import datacache

from train_entry.dataprep import encode, sources
from train_entry.errors import UserCodeError

PREP_VERSION = 1  # raised when what an entry holds changes: older entries are then not found
EXAMPLES = "examples.arrow"
RECORDS_PER_PROCESS = 5000  # fewer records than this per process: a pool costs more than it saves
WHERE_FROM = ("name_or_path", "_commit_hash", "cache_dir", "local_files_only", "gguf_file", "revision", "token")  # not content
Progress = Callable[[str, int, "int | None"], None]  # (stage, done, total)


@dataclass
class Inputs:
    """One data set to prepare: its files, its record format and its cache key."""

    paths: list[str]
    fmt: str
    key: str
    parts: dict = field(repr=False)
    kind: str = "jsonl"


def inputs(paths: list[str], fmt: str, tokenizer, cache_root: str | os.PathLike, kind: str = "jsonl") -> Inputs:
    import xxhash

    parts = {
        "prep": PREP_VERSION,
        "format": fmt,
        "inputs": [sources.digest(p, cache_root, kind) for p in paths],  # content only: a renamed copy is the same data
        "tokenizer": tokenizer_digest(tokenizer),
        "libraries": _versions(),
    }
    if kind != "jsonl":  # JSON lines' entries keep the keys they had before the other kinds came
        parts["kind"] = kind
    return Inputs(list(paths), fmt, xxhash.xxh3_128(json.dumps(parts, sort_keys=True).encode()).hexdigest(), parts, kind)


def tokenizer_digest(tokenizer) -> str:
    """Everything of the tokenizer that decides ids: its rules and vocabulary (the fast
    tokenizer's whole definition), special tokens, settings and chat template."""
    import xxhash

    h = xxhash.xxh3_128()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    settings = {k: v for k, v in tokenizer.init_kwargs.items() if not k.endswith("_file") and k not in WHERE_FROM}
    for part in (type(tokenizer).__name__, tokenizer.chat_template, sorted(tokenizer.get_vocab().items()) if backend is None else None,
                 settings):
        h.update(json.dumps(part, sort_keys=True, default=str).encode())
    if backend is not None:
        h.update(backend.to_str().encode())
    return h.hexdigest()


def _versions() -> dict:
    import tokenizers
    import transformers

    return {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__}


def prepare(data: Inputs, tokenizer, cache_root: str | os.PathLike, progress: Progress | None = None,
            num_proc: int | None = None) -> tuple[Path, dict]:
    """Build the entry and commit it; its folder and manifest. The caller holds the claim."""
    root = Path(cache_root)
    datacache.remove_dead_tmp(root, data.key)  # a killed preparer's half-made folders
    scratch, out = datacache.tmp_dir(root, data.key), datacache.tmp_dir(root, data.key)
    started = time.time()
    try:
        counts = _build(data, tokenizer, scratch, out / EXAMPLES, progress or (lambda *a: None), num_proc)
        shutil.rmtree(scratch, ignore_errors=True)
        st = (out / EXAMPLES).stat()
        manifest = {"created": time.time(), "took_s": round(time.time() - started, 3), "counts": counts,
                    "inputs": [{"path": p[:256], "digest": d} for p, d in zip(data.paths, data.parts["inputs"])],
                    "format_of_records": data.fmt, "kind_of_inputs": data.kind, "key_parts": data.parts,
                    "files": {EXAMPLES: {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "digest": sources.file_digest(out / EXAMPLES)}}}
        entry = datacache.commit_entry(out, root, data.key, manifest)
        return entry, datacache.read_manifest(entry)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if out.exists():
            shutil.rmtree(out, ignore_errors=True)


def processes_for(n: int) -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, n // RECORDS_PER_PROCESS))


def _build(data: Inputs, tokenizer, scratch: Path, target: Path, progress: Progress, num_proc: int | None) -> dict:
    import datasets
    import pyarrow as pa
    import pyarrow.compute as pc

    datasets.disable_progress_bars()  # progress goes to the heartbeat, events and the command's bar
    datasets.utils.logging.set_verbosity_error()
    raw = _records(datasets, data, scratch)
    n = len(raw)
    if n == 0:
        raise UserCodeError(f"{data.paths[0]}: no records")
    procs = num_proc or processes_for(n)
    counts_dir = scratch / "progress"
    counts_dir.mkdir()
    watch = _Watch(counts_dir, n, progress)
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    environ = os.environ  # datasets' map with num_proc leaves a deepcopy of it in its place: put back below
    if procs > 1:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # N processes already: no N x cores threads, no fork warning
    try:
        watch.start()
        enc = raw.map(
            functools.partial(_encode_counted, tokenizer, data.fmt, sources.where(data.paths, data.kind), str(counts_dir)),
            batched=True, batch_size=512, num_proc=procs if procs > 1 else None, remove_columns=["text"],
            features=datasets.Features({"file": datasets.Value("int32"), "line": datasets.Value("int64"),
                                        "input_ids": datasets.Sequence(datasets.Value("int32")),
                                        "target": datasets.Sequence(datasets.Value("uint8")),
                                        "length": datasets.Value("int32"), "first_target": datasets.Value("int32"),
                                        "error": datasets.Value("string")}),
            cache_file_name=str(scratch / "encoded.arrow"), new_fingerprint=f"{data.key}-encoded", desc=None)
    finally:
        # the process's own mapping again: what captured os.environ (rich's consoles, say) would
        # otherwise never see a variable set from here on
        os.environ = environ
        watch.stop()
        if procs > 1:
            if old is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = old
    table = enc.with_format("arrow")[:]
    errors = table.column("error")
    if errors.null_count != len(errors):
        first = pc.index(pc.is_valid(errors), True).as_py()
        raise UserCodeError(errors[first].as_py())
    table = table.drop_columns(["error"])
    with pa.OSFile(str(target), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=65536):
            writer.write_batch(batch)
    progress("written", n, n)
    lengths = table.column("length")
    return {"records": n, "tokens": int(pc.sum(lengths).as_py() or 0), "longest": int(pc.max(lengths).as_py() or 0),
            "without_target": int(pc.sum(pc.equal(table.column("first_target"), -1)).as_py() or 0),
            "processes": procs}


def _records(datasets, data: Inputs, scratch: Path):
    """The inputs' records as raw text, an Arrow table on disk (``sources.raw_lines``)."""
    try:
        return datasets.Dataset.from_generator(
            sources.raw_lines, gen_kwargs={"paths": data.paths, "kind": data.kind, "fmt": data.fmt}, cache_dir=str(scratch / "raw"),
            features=datasets.Features({"file": datasets.Value("int32"), "line": datasets.Value("int64"),
                                        "text": datasets.Value("string"), "error": datasets.Value("string")}),
            fingerprint=f"{data.key}-raw", keep_in_memory=False)
    except datasets.exceptions.DatasetGenerationError as exc:  # what the reader said, not datasets' wrapper
        if isinstance(exc.__cause__, UserCodeError):
            raise exc.__cause__ from None
        raise


def _encode_counted(tokenizer, fmt: str, where_of, counts_dir: str, batch: dict) -> dict:
    """``encode.encode_batch``, and how many records this process has done, for the
    progress watcher (a process of the pool cannot call back into the preparing rank)."""
    out = encode.encode_batch(tokenizer, fmt, where_of, batch)
    _DONE[0] += len(batch["line"])
    if time.monotonic() - _DONE[1] >= 1.0:  # what the watcher reads, about as often as it reads it
        _DONE[1] = time.monotonic()
        contract.atomic_write_text(Path(counts_dir) / str(os.getpid()), str(_DONE[0]))
    return out


_DONE = [0, 0.0]  # records this process encoded, and when it last said so (each pool process has its own)


class _Watch:
    """Sums what the encoding processes report, about once a second, for ``progress``."""

    def __init__(self, counts_dir: Path, total: int, progress: Progress):
        self.dir, self.total, self.progress = counts_dir, total, progress
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="orchestrate-data-progress", daemon=True)

    def start(self) -> None:
        _DONE[:] = [0, 0.0]
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(5)

    def _run(self) -> None:
        last = -1
        while not self.stopped.wait(1.0):
            done = 0
            for name in os.listdir(self.dir):
                try:
                    done += int((self.dir / name).read_text() or 0)
                except (OSError, ValueError):
                    pass
            if done != last:
                last = done
                self.progress("tokenizing", min(done, self.total), self.total)
