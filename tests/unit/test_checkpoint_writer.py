"""The checkpoint writer: shards hashed as they are written (the commit reads none of them
back), written around the page cache where the filesystem allows it, and an asynchronous
save's copy made on a thread that training waits for only before it changes the state."""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from pathlib import Path

import pytest
import torch

from orchestrator import contract
from train_entry.checkpoint import direct_io, writer


def _cfg(task_dir: Path, asynchronous: bool = False, direct_io: bool = True, keep_last: int = 2) -> contract.TaskConfig:
    return contract.TaskConfig.from_dict({
        "contract": contract.CONTRACT_VERSION, "experiment_id": "w", "index": 0, "steps": 10, "task_dir": str(task_dir),
        "checkpoint": {"every_steps": 1, "keep_last": keep_last, "async_save": asynchronous, "direct_io": direct_io},
        "engine": {"kind": "ddp", "backend": "gloo", "precision": "fp32", "find_unused_parameters": False,
                   "activation_checkpointing": False},
        "optimizer": {"name": "adamw", "lr": 1e-2, "grad_clip": None}})


def _engine(cfg):
    from train_entry.engines import build_engine

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    engine = build_engine(cfg, model, torch.device("cpu"))
    _step(engine)
    return engine


def _step(engine) -> None:
    engine.micro_step(torch.randn(4, 256), None, lambda out, _t: out.pow(2).mean(), 1, True)
    engine.optimizer_step(1e-2)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _disk_reads(monkeypatch) -> list[str]:
    """The files the commit hashes by reading them back."""
    read = []
    original = contract.file_sha256

    def spy(path, *a, **k):
        read.append(Path(path).name)
        return original(path, *a, **k)

    monkeypatch.setattr(contract, "file_sha256", spy)
    return read


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "page-cache"])
def test_the_shards_are_hashed_as_written_and_the_manifest_matches_the_disk(tmp_path, monkeypatch, world_of_one, direct):
    from train_entry.checkpoint.checkpointer import Checkpointer

    cfg = _cfg(tmp_path, direct_io=direct)
    engine = _engine(cfg)
    opened = []
    real = direct_io.DirectStream.__init__
    monkeypatch.setattr(direct_io.DirectStream, "__init__", lambda self, fd, hashing=True: (opened.append(fd), real(self, fd, hashing))[1])
    read = _disk_reads(monkeypatch)
    info = Checkpointer(cfg, 0, 1, engine).save(1, {})
    folder = Path(info["folder"])
    files = contract.read_manifest(folder)["files"]
    shards = [n for n in files if n.startswith("dcp/")]
    assert any(n.endswith(".distcp") for n in shards) and "dcp/.metadata" in shards, files
    for name, record in files.items():  # every record is the file as it is on disk
        assert record == {"size": (folder / name).stat().st_size, "sha256": _sha(folder / name)}, name
    assert contract.verify_checkpoint(folder, deep=True) is None
    # nothing DCP wrote was read back to be hashed: only the RNG states (written by torch.save)
    assert sorted(read) == ["rank-0.pt"], read
    probe = direct_io.open_direct(tmp_path / "probe")
    if probe is not None:
        os.close(probe)
    assert bool(opened) == (direct and probe is not None)  # around the page cache where this filesystem allows it


def test_where_the_filesystem_refuses_direct_io_the_page_cache_is_used(tmp_path, monkeypatch, world_of_one):
    from train_entry.checkpoint.checkpointer import Checkpointer

    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(direct_io.os, "open", no_direct)
    cfg = _cfg(tmp_path)
    info = Checkpointer(cfg, 0, 1, _engine(cfg)).save(1, {})
    assert contract.verify_checkpoint(Path(info["folder"]), deep=True) is None


def test_a_file_not_written_in_order_is_hashed_from_disk(tmp_path):
    written = writer.Written()
    fs = writer._RecordingFileSystem(written, direct=False)
    with fs.create_stream(tmp_path / "plain", "wb") as s:
        s.write(b"a" * 1000)
    with fs.create_stream(tmp_path / "sought", "wb") as s:
        s.write(b"b" * 1000)
        s.seek(10)
        s.write(b"c")
    records = written.result(tmp_path)
    assert records == {"plain": {"size": 1000, "sha256": hashlib.sha256(b"a" * 1000).hexdigest()}}


def test_a_record_that_does_not_match_the_file_is_not_trusted(tmp_path):
    from train_entry.checkpoint.commit import hashed_as_written

    (tmp_path / "a").write_bytes(b"12345")
    (tmp_path / "b").write_bytes(b"12345")
    (tmp_path / "c").write_bytes(b"1")
    right = {"size": 5, "sha256": "x"}
    shares = [{"a": right, "b": {"size": 4, "sha256": "y"}, "gone": right}, {"c": {"size": 1, "sha256": "z"}},
              {"c": {"size": 1, "sha256": "z"}}]  # c claimed by two ranks: read back
    assert hashed_as_written(tmp_path, ["a", "b", "c"], shares) == {"a": right}


def test_an_asynchronous_save_holds_the_state_of_its_step_though_the_copy_is_slow(tmp_path, monkeypatch, world_of_one):
    """The copy is made on a thread while training goes on; the optimizer step waits for it,
    that wait counts as training blocked, and the checkpoint holds the weights of the step
    saved, not the next one's."""
    from torch.distributed.checkpoint.staging import DefaultStager

    from train_entry.checkpoint.checkpointer import Checkpointer
    from train_entry.engines import build_engine

    # the copy is held until half a second after the step began waiting for it: what the
    # step waited is then known however busy the machine (a plain sleep in the copy would
    # race the main thread's way to the step)
    release = threading.Event()
    stage = DefaultStager.stage

    def stage_when_released(self, state_dict):
        assert release.wait(60), "the step never waited for the copy"
        return stage(self, state_dict)

    monkeypatch.setattr(DefaultStager, "stage", stage_when_released)
    cfg = _cfg(tmp_path, asynchronous=True)
    engine = _engine(cfg)
    wait_staged = engine.wait_staged

    def wait_staged_then_release():
        pending = engine.snapshot()
        if pending is not None and not pending.done():  # not the save's own call, before its copy
            threading.Timer(0.5, release.set).start()
        wait_staged()

    monkeypatch.setattr(engine, "wait_staged", wait_staged_then_release)
    saved = {k: v.clone() for k, v in engine.model.module.state_dict().items()}
    ck = Checkpointer(cfg, 0, 1, engine)
    assert ck.save(1, {})["async"]
    assert not engine.snapshot().done()  # the save returned before the copy was made
    _step(engine)  # waits for the copy, then changes every weight
    assert engine.staging_wait_s > 0.3
    info = ck.finish_pending()
    assert info["blocked_s"] >= engine.staging_wait_s
    ck.close()

    fresh = build_engine(cfg, torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)), torch.device("cpu"))
    Checkpointer(cfg, 0, 1, fresh).load(ck.find_resume())
    loaded = fresh.model.module.state_dict()
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name
        assert not torch.equal(engine.model.module.state_dict()[name], tensor), name  # the step did change it


def test_rotation_deletes_on_a_thread_and_leaves_no_trash(tmp_path, world_of_one):
    from train_entry.checkpoint.checkpointer import Checkpointer

    cfg = _cfg(tmp_path, keep_last=2)
    engine = _engine(cfg)
    ck = Checkpointer(cfg, 0, 1, engine)
    for step in range(1, 5):
        ck.save(step, {})
    ck.close()
    names = sorted(p.name for p in contract.checkpoints_dir(tmp_path).iterdir())
    assert names == [contract.checkpoint_name(3), contract.checkpoint_name(4)], names


def test_only_a_discarded_checkpoint_is_removed_as_trash(tmp_path):
    keep = tmp_path / "step-000000001"
    keep.mkdir()
    with pytest.raises(contract.UnsafeDeletion):
        contract.remove_trash(keep)
    assert keep.is_dir()


def test_a_file_renamed_while_it_is_flushed_is_flushed_under_its_new_name(tmp_path, monkeypatch):
    """A synchronous save's flush runs beside DCP's rename of .metadata.tmp: never an error."""
    written = writer.Written()
    fs = writer._RecordingFileSystem(written, direct=False)
    with fs.create_stream(tmp_path / ".metadata.tmp", "wb") as s:
        s.write(b"metadata")
    real_open = os.open

    def open_after_the_rename(path, flags, *a):
        if str(path).endswith(".tmp"):
            fs.rename(tmp_path / ".metadata.tmp", tmp_path / ".metadata")
        return real_open(path, flags, *a)

    monkeypatch.setattr(writer.os, "open", open_after_the_rename)
    written.fsync()
    monkeypatch.undo()
    assert written.result(tmp_path) == {".metadata": {"size": 8, "sha256": hashlib.sha256(b"metadata").hexdigest()}}
    assert written.flushed == {str(tmp_path / ".metadata")}


def test_a_failed_direct_write_raises_its_own_error(tmp_path, monkeypatch):
    fd = direct_io.open_direct(tmp_path / "probe")
    if fd is None:
        pytest.skip("this filesystem has no O_DIRECT")
    os.close(fd)

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    stream = direct_io.open_stream(tmp_path / "shard", hashing=False)
    assert isinstance(stream, direct_io.DirectStream)
    monkeypatch.setattr(direct_io.os, "write", full)
    with pytest.raises(OSError) as raised:
        try:
            stream.write(bytes(3 * direct_io.DIRECT_BUFFER))
        finally:
            stream.close(fsync=True)  # as DCP's stream is closed after a failed write
    assert raised.value.errno == errno.ENOSPC, raised.value
