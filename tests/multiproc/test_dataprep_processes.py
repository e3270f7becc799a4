"""Preparations in real processes: two at once on the same data do the work once, and one
killed in the middle leaves nothing that is ever read; the next takes over at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import REPO
from orchestrator.contract import datacache

pytestmark = pytest.mark.multiproc  # each process imports transformers and datasets

PREPARE = textwrap.dedent("""
    import json, os, sys, time
    sys.path.insert(0, sys.argv[4])
    import tiny
    from train_entry.dataprep import ranks
    data, cache, barrier = sys.argv[1], sys.argv[2], sys.argv[3]
    tok = tiny.tokenizer()
    open(os.path.join(barrier, str(os.getpid())), "w").close()
    while len(os.listdir(barrier)) < int(sys.argv[5]):  # every process imported: start together
        time.sleep(0.01)
    said = []
    class Said:
        def beat(self, *a, **k): pass
        def event(self, kind, cause, **k):
            if kind != "data.progress": said.append(kind)
    ex = ranks.find_or_prepare(ranks.Source([data], "chat"), tok, cache, Said(), lambda line: None, num_proc=1)
    print(json.dumps({"events": said, "entry": str(ex.entry), "records": len(ex)}))
""")


def _start(tmp_path, data, n_together):
    barrier = tmp_path / "barrier"
    barrier.mkdir(exist_ok=True)
    return subprocess.Popen([sys.executable, "-c", PREPARE, str(data), str(tmp_path / "cache"), str(barrier),
                             str(REPO / "tests" / "hf"), str(n_together)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _data(tmp_path, n):
    sys.path.insert(0, str(REPO / "tests" / "hf"))
    import tiny

    return tiny.make_chat_data(tmp_path / "d.jsonl", n=n)


def test_two_preparations_of_the_same_data_at_once_do_the_work_once(tmp_path):
    data = _data(tmp_path, 1000)  # seconds of work: the other process asks for the claim within milliseconds
    procs = [_start(tmp_path, data, 2) for _ in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(o["events"][0] for o in outs) == ["data.prepared", "data.waited"], outs
    assert outs[0]["entry"] == outs[1]["entry"] and outs[0]["records"] == 1000
    assert [e["key"] for e in datacache.entries(tmp_path / "cache")] == [os.path.basename(outs[0]["entry"])]
    assert not [n for n in os.listdir(tmp_path / "cache") if n.startswith(datacache.TMP_PREFIX)]


def test_a_preparer_killed_midway_leaves_nothing_read_and_the_next_takes_over_at_once(tmp_path):
    data = _data(tmp_path, 3000)  # about 10 s of one process: killed 0.5 s into it
    victim = _start(tmp_path, data, 1)
    cache = tmp_path / "cache"
    deadline = time.time() + 120
    while not any(n.endswith(datacache.CLAIM_SUFFIX) for n in (os.listdir(cache) if cache.exists() else [])):
        assert time.time() < deadline and victim.poll() is None, victim.stderr.read()[-3000:] if victim.poll() is not None else "no claim"
        time.sleep(0.02)
    time.sleep(0.5)  # inside the preparation
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert datacache.entries(cache) == []  # nothing half-made is an entry
    assert any(n.startswith(datacache.TMP_PREFIX) for n in os.listdir(cache))  # what it left
    t0 = time.time()
    for f in os.listdir(tmp_path / "barrier"):
        os.unlink(tmp_path / "barrier" / f)
    heir = _start(tmp_path, data, 1)
    out, err = heir.communicate(timeout=300)
    assert heir.returncode == 0, err[-3000:]
    got = json.loads(out.strip().splitlines()[-1])
    # its holder is gone from this host: taken over now, not after the claim's stale time
    assert got["events"] == ["data.prepared"] and time.time() - t0 < datacache.CLAIM_STALE_S, got
    assert not [n for n in os.listdir(cache) if n.startswith(datacache.TMP_PREFIX) or n.endswith(datacache.CLAIM_SUFFIX)]


def test_data_prepare_list_and_rm_as_a_user_runs_them(home, tmp_path, tiny_model):
    from conftest import cli, write

    data = _data(tmp_path, 50)
    spec = write(tmp_path / "s.yaml", f"name: d\nsteps: 2\nmodel: {{kind: hf, path: {tiny_model}}}\n"
                 f"data: {{kind: jsonl, path: {data}, max_length: 40}}\n")
    out = cli("data", "prepare", str(spec), home=home)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    cache = home / "cache" / "data"
    (entry,) = datacache.entries(cache)
    man = entry["manifest"]
    assert f"cache     {entry['path']}" in out.stdout and f"records   {man['counts']['records']:,}" in out.stdout, out.stdout
    assert "truncated" in out.stdout and "at data.max_length 40" in out.stdout
    again = cli("data", "prepare", str(spec), "--json", home=home)
    doc = json.loads(again.stdout)[0]
    assert doc["reused"] and doc["key"] == entry["key"] and doc["records"] == 50, doc
    listed = json.loads(cli("data", "list", "--json", home=home).stdout)
    assert [e["key"] for e in listed] == [entry["key"]] and listed[0]["records"] == 50
    bad = cli("data", "rm", "0" * 32, home=home)
    assert bad.returncode == 2 and "no prepared data set" in bad.stderr and "Traceback" not in bad.stderr
    assert cli("data", "rm", entry["key"], home=home).returncode == 0
    assert datacache.entries(cache) == []
