"""The data cache's layout as the contract defines it: an entry is trusted only as its
manifest describes it, exactly one process holds a claim, and a dead holder's claim is
taken over. Stdlib only, like the contract."""

from __future__ import annotations

import json
import os
import time

import pytest

from orchestrator.contract import datacache

KEY = "0123456789abcdef0123456789abcdef"


def _entry(root, key=KEY, payload=b"tokens"):
    tmp = datacache.tmp_dir(root, key)
    (tmp / "examples.arrow").write_bytes(payload)
    return datacache.commit_entry(tmp, root, key, {"created": time.time(), "counts": {"records": 3},
                                                   "files": {"examples.arrow": {"size": len(payload), "digest": "d"}}})


def test_a_committed_entry_reads_back_and_a_half_written_one_is_not_an_entry(tmp_path):
    entry = _entry(tmp_path)
    assert datacache.read_manifest(entry)["counts"] == {"records": 3}
    half = datacache.tmp_dir(tmp_path, "f" * 32)  # a preparation that died before its commit
    (half / "examples.arrow").write_bytes(b"x")
    assert [e["key"] for e in datacache.entries(tmp_path)] == [KEY]  # never listed, never read
    os.unlink(entry / datacache.DATA_MANIFEST)
    with pytest.raises(datacache.CacheError, match="no manifest.json"):
        datacache.read_manifest(entry)


@pytest.mark.parametrize("damage", ["shorter", "missing", "link", "outside", "other-key", "not-json"])
def test_a_damaged_or_hostile_entry_is_refused_with_the_file_named(tmp_path, damage):
    entry = _entry(tmp_path)
    man_path = entry / datacache.DATA_MANIFEST
    man = json.loads(man_path.read_text())
    if damage == "shorter":
        (entry / "examples.arrow").write_bytes(b"tok")
    elif damage == "missing":
        os.unlink(entry / "examples.arrow")
    elif damage == "link":
        (tmp_path / "elsewhere").write_bytes(b"tokens")
        os.unlink(entry / "examples.arrow")
        os.symlink(tmp_path / "elsewhere", entry / "examples.arrow")
    elif damage == "outside":
        man["files"] = {"../elsewhere": {"size": 6, "digest": "d"}}
    elif damage == "other-key":
        man["key"] = "f" * 32
    else:
        man_path.write_text("{not json")
    if damage in ("outside", "other-key"):
        man_path.write_text(json.dumps(man))
    with pytest.raises(datacache.CacheError) as err:
        datacache.read_manifest(entry)
    assert str(entry) in str(err.value) or "elsewhere" in str(err.value)
    listed = datacache.entries(tmp_path)
    assert len(listed) == 1 and "problem" in listed[0]  # listed, with what is wrong


def test_a_second_commit_of_the_same_key_leaves_the_first_and_removes_its_own_folder(tmp_path):
    first = _entry(tmp_path, payload=b"first!")
    _entry(tmp_path, payload=b"second")
    assert (first / "examples.arrow").read_bytes() == b"first!"
    assert sorted(os.listdir(tmp_path)) == [KEY]


def test_exactly_one_process_takes_a_claim_and_a_dead_holders_claim_is_taken_over(tmp_path, monkeypatch):
    a, b = datacache.Claim(tmp_path, KEY), datacache.Claim(tmp_path, KEY)
    assert a.take() and not b.take()
    assert b.holder()["pid"] == os.getpid()
    a.beat()
    assert not b.take()  # beaten: alive
    rec = json.loads(a.path.read_text())
    a.path.write_text(json.dumps({**rec, "time": time.time() - datacache.CLAIM_STALE_S - 1}))
    assert b.take()  # its holder stopped beating long ago: dead
    a.held = False  # (a would find it taken)
    b.release()
    assert not a.path.exists()


def test_a_remembered_digest_is_used_only_for_the_same_unchanged_file(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("a\n")
    before = datacache.stat_key(f)
    datacache.remember_digest(tmp_path / "cache", f, "abc", before)
    assert datacache.remembered_digest(tmp_path / "cache", f) == "abc"
    f.write_text("b\n")  # same size, new content: mtime differs
    os.utime(f, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert datacache.remembered_digest(tmp_path / "cache", f) is None
    datacache.remember_digest(tmp_path / "cache", f, "stale", before)  # changed while read: not remembered
    assert datacache.remembered_digest(tmp_path / "cache", f) is None


def test_discard_and_the_keys_a_path_may_hold(tmp_path):
    _entry(tmp_path)
    datacache.discard_entry(tmp_path, KEY)
    assert os.listdir(tmp_path) == []
    for bad in ("../x", "A" * 32, "abc"):
        with pytest.raises(datacache.CacheError):
            datacache.entry_dir(tmp_path, bad)
