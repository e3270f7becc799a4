"""The data's inputs: what files hold their records, their content digests (what the cache
key is made of), and their records as raw text, numbered as errors name them.

Three kinds (``data.kind``): JSON lines (a record per line, named ``file:line``), Parquet
files and folders written by ``datasets``' ``save_to_disk`` (a record per row, named
``file row N``). A table's rows become the same JSON text a line would hold, only the
columns the format reads (``messages``, or ``prompt`` and ``completion``), so one parser
checks every kind. The login node's check and the compute node's preparation both read
through here.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterator

from orchestrator.contract import chatdata, datacache, safe_read

from train_entry.errors import UserCodeError

CHUNK = 8 << 20
COLUMNS = {"chat": ("messages",), "instruction": ("prompt", "completion")}
ROWS_PER_BATCH = 1024
STATE_MAX = 1 << 20  # a save_to_disk folder's state.json; a bigger one is not one
_DATA_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,250}\.arrow")


def digest(path: str | os.PathLike, cache_root: str | os.PathLike, kind: str = "jsonl") -> str:
    """The input's content digest (xxh3-128: damage, not an adversary, is what it detects;
    8 GB/s where sha256 does 0.6), remembered for each very file (size, mtime, inode) so
    that a restart, a requeue or another experiment does not read gigabytes again. A
    save_to_disk folder's is that of its data files in order."""
    return _combined([_file_digest_remembered(f, cache_root) for f in data_files(path, kind)], kind)


def known_digest(path: str | os.PathLike, cache_root: str | os.PathLike, kind: str = "jsonl") -> str | None:
    """``digest`` where every file's is remembered unchanged; None where one would be read."""
    try:
        files = data_files(path, kind)
    except UserCodeError:
        return None
    known = [datacache.remembered_digest(cache_root, f) for f in files]
    return None if None in known else _combined(known, kind)


def _combined(digests: list[str], kind: str) -> str:
    if kind != "arrow":
        return digests[0]
    import xxhash

    h = xxhash.xxh3_128()
    for d in digests:
        h.update(d.encode())
    return h.hexdigest()


def _file_digest_remembered(path: Path, cache_root: str | os.PathLike) -> str:
    known = datacache.remembered_digest(cache_root, path)
    if known is not None:
        return known
    before = datacache.stat_key(path)
    value = file_digest(path)
    datacache.remember_digest(cache_root, path, value, before)
    return value


def file_digest(path: str | os.PathLike) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    try:
        with open(path, "rb") as fh:
            while chunk := fh.read(CHUNK):
                h.update(chunk)
    except OSError as exc:
        raise UserCodeError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return h.hexdigest()


def data_files(path: str | os.PathLike, kind: str) -> list[Path]:
    """The files that hold an input's records: the file itself, or a save_to_disk folder's
    Arrow files as its ``state.json`` lists them, each a plain file inside that folder
    (a name with a path in it, or a link, is refused: the folder may be anyone's)."""
    p = Path(path)
    if kind != "arrow":
        if p.is_dir():
            raise UserCodeError(f"'{p}' is a folder; give the {'JSON-lines' if kind == 'jsonl' else 'Parquet'} file of records"
                                + (" (a folder written by save_to_disk is data.kind: arrow)" if (p / "state.json").exists() else ""))
        if not p.exists():
            raise UserCodeError(f"no file '{p}'")
        return [p]
    if not p.is_dir():
        raise UserCodeError(f"'{p}' is not a folder; data.kind: arrow reads a folder written by datasets' save_to_disk")
    if (p / "dataset_dict.json").is_file():
        splits = sorted(d.name for d in p.iterdir() if d.is_dir() and (d / "state.json").is_file())
        raise UserCodeError(f"'{p}' holds several splits ({', '.join(splits) or 'none'}), written by DatasetDict.save_to_disk; "
                            f"point data.path at one split's folder, e.g. {p / (splits[0] if splits else 'train')}")
    state = _state(p)
    files = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(files, list) or not files:
        raise UserCodeError(f"{p / 'state.json'}: no '_data_files' list: not a folder written by save_to_disk")
    if state.get("_indices_data_files"):
        raise UserCodeError(f"{p / 'state.json'}: the data set has an indices mapping; save it again with save_to_disk "
                            "after flatten_indices()")
    out = []
    for i, item in enumerate(files):
        name = item.get("filename") if isinstance(item, dict) else None
        if not isinstance(name, str) or not _DATA_FILE.fullmatch(name):
            raise UserCodeError(f"{p / 'state.json'}: _data_files[{i}] is not the plain name of an .arrow file in that folder")
        f = p / name
        if f.is_symlink() or not f.is_file():
            raise UserCodeError(f"{p / 'state.json'}: names '{name}', which is not a file in '{p}'")
        out.append(f)
    return out


def _state(folder: Path) -> dict:
    """state.json, a regular file of the folder itself (a link or a FIFO is refused, never followed or waited on)."""
    path = folder / "state.json"
    try:
        raw = safe_read.read_capped(path, STATE_MAX)
        if raw is not None:
            return safe_read.parse_json(raw)
    except safe_read.BadRecord as exc:
        raise UserCodeError(f"{path}: {exc}: not a folder written by save_to_disk") from None
    raise UserCodeError(f"{path}: no such file: not a folder written by save_to_disk")


def raw_lines(paths: list[str], kind: str = "jsonl", fmt: str = "chat") -> Iterator[dict]:
    """``{"file": index in paths, "line": its number, "text", "error"}`` for every record
    (every non-blank line, every row), in order; ``error`` names what makes it no record
    before it is parsed. ``line`` is a table's row number (from 1)."""
    for f, path in enumerate(paths):
        if kind == "jsonl":
            yield from _lines(f, path)
        else:
            yield from _rows(f, path, kind, fmt)


def _lines(f: int, path: str) -> Iterator[dict]:
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise UserCodeError(f"{path}: cannot read: {exc.strerror or exc}") from None
    with fh:
        n = 0
        while raw := fh.readline(chatdata.MAX_LINE_BYTES + 1):
            n += 1
            if len(raw) > chatdata.MAX_LINE_BYTES:
                yield {"file": f, "line": n, "text": "",
                       "error": f"{path}:{n}: a line longer than {chatdata.MAX_LINE_BYTES:,} bytes (no record is that long: a damaged file?)"}
                while raw and not raw.endswith(b"\n"):  # the rest of that line
                    raw = fh.readline(chatdata.MAX_LINE_BYTES + 1)
                continue
            if not raw.strip():
                continue
            try:
                yield {"file": f, "line": n, "text": raw.decode("utf-8"), "error": None}
            except UnicodeDecodeError as exc:
                yield {"file": f, "line": n, "text": "", "error": f"{path}:{n}: not JSON ({exc})"}


def _rows(f: int, path: str, kind: str, fmt: str) -> Iterator[dict]:
    """A table's rows, a batch at a time (the file memory-mapped: nothing is held whole)."""
    import pyarrow as pa

    wanted = COLUMNS[fmt]
    n = 0
    try:
        for batch in _batches(path, kind, wanted):
            for row in batch.to_pylist():
                n += 1
                try:
                    yield {"file": f, "line": n, "text": json.dumps(row, ensure_ascii=False, allow_nan=False), "error": None}
                except (TypeError, ValueError) as exc:
                    yield {"file": f, "line": n, "text": "", "error": f"{path} row {n}: not a record ({exc})"}
    except (OSError, pa.ArrowException) as exc:
        raise UserCodeError(f"{path}: cannot read as {kind} ({exc})") from None


def _batches(path: str, kind: str, wanted: tuple[str, ...]):
    if kind == "parquet":
        import pyarrow.parquet as pq

        (file,) = data_files(path, kind)
        pf = pq.ParquetFile(str(file), memory_map=True)
        _has_columns(path, pf.schema_arrow.names, wanted)
        yield from pf.iter_batches(batch_size=ROWS_PER_BATCH, columns=list(wanted))
        return
    for file in data_files(path, kind):
        schema, batches = _ipc_batches(file)
        _has_columns(str(file), schema.names, wanted)
        for batch in batches:
            yield batch.select(list(wanted))


def _ipc_batches(file: Path):
    """(schema, batches) of an Arrow file: the stream format save_to_disk writes, or the file format."""
    import pyarrow as pa

    try:
        reader = pa.ipc.open_stream(pa.memory_map(str(file)))
        return reader.schema, iter(reader)
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(pa.memory_map(str(file)))
        return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))


def _has_columns(path: str, names: list[str], wanted: tuple[str, ...]) -> None:
    missing = [c for c in wanted if c not in names]
    if missing:
        fmt = "chat" if wanted == COLUMNS["chat"] else "instruction"
        raise UserCodeError(f"{path}: no column {', '.join(repr(c) for c in missing)} (data.format: {fmt}); "
                            f"its columns: {', '.join(names[:20]) or 'none'}")


def where(paths: list[str], kind: str = "jsonl"):
    """How an error names record ``n`` of input ``f``."""
    if kind == "jsonl":
        return lambda f, n: f"{Path(paths[f])}:{n}"
    return lambda f, n: f"{Path(paths[f])} row {n}"


def count(path: str, kind: str, fmt: str) -> int:
    """The records of one input, each checked as the preparation parses it; RecordError
    names the first bad one, UserCodeError an input that cannot be read."""
    name = where([path], kind)
    n = 0
    for rec in raw_lines([path], kind, fmt):
        if rec["error"] is not None:
            raise chatdata.RecordError(rec["error"])
        try:
            chatdata.to_messages(json.loads(rec["text"]), fmt, name(0, rec["line"]))
        except json.JSONDecodeError as exc:
            raise chatdata.RecordError(f"{name(0, rec['line'])}: not JSON ({exc})") from None
        n += 1
    return n
