"""A checkpoint may be damaged or hostile: reading one never runs its code and never
touches a file outside its folder, and deleting never follows a link out of the task.

A pickle payload (a shell command that creates a marker file) placed where our loaders
unpickle (DCP's .metadata, a DCP bytes entry, DeepSpeed's optimizer and model states, the
RNG states) is refused by `ckpt verify`, `ckpt consolidate` and the compute side's resume,
and the marker never appears. Manifests naming paths outside the folder, links, FIFOs
and malformed entries are named as such, without a hang or a traceback. `ckpt prune`
leaves what a linked `checkpoints/` or `step-N` points to alone. And real checkpoints
still load: their globals are exactly the allow-list."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, cli
from orchestrator import contract
from train_entry.checkpoint import safeload

HOLDS_CODE = "this checkpoint holds code; it was not loaded"


class Evil:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def commit(tdir: Path, files: dict, state_format: str = "dcp", step: int = 1, **extra) -> Path:
    """A committed checkpoint of ``files`` (name -> bytes) plus whatever is already in its
    tmp folder, listed as the trainer lists them; ``extra`` overrides manifest fields."""
    tmp = contract.checkpoint_tmp(tdir, step)
    tmp.mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_bytes(data)
    listed = {str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": sha(p.read_bytes())}
              for p in sorted(tmp.rglob("*")) if p.is_file() and not p.is_symlink()}
    manifest = {"step": step, "engine": "ddp", "world_size": 1, "state_format": state_format, "files": listed, **extra}
    return contract.commit_checkpoint(tmp, manifest)


def torch_bytes(obj) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def real_dcp(folder: Path, extra: dict | None = None) -> None:
    """A DCP save (one process) of a small model and its AdamW states, as the engines save them."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optim": osd, **(extra or {})}, checkpoint_id=str(folder), no_dist=True)


# ---------------------------------------------------------------- the compute side, in a process of its own

RESUME = r"""
import json, sys, types
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch
from torch import distributed as dist
from train_entry.checkpoint import safeload
from train_entry.checkpoint.checkpointer import Checkpointer
from train_entry.checkpoint.rng import load_rng_state
from train_entry.engines.base import DCPState, Engine
from train_entry.engines.deepspeed import DeepSpeedEngine

work = Path(sys.argv[2])
dist.init_process_group("gloo", init_method=f"file://{work}/store", rank=0, world_size=1)


class Plain(DCPState, Engine):
    def __init__(self):
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        self.optimizer = torch.optim.AdamW(self.model.parameters())


def attempt(fn):
    try:
        fn()
        return "loaded"
    except safeload.CheckpointRefused as exc:
        return "refused: " + str(exc)


out = {}
for folder in map(Path, sys.argv[3:]):
    ns = types.SimpleNamespace
    cfg = ns(checkpoint=ns(resume_from=str(folder), verify="sha256", keep_last=2, every_steps=0, every_minutes=0,
                           async_save=False), dir=work / "task", engine={"kind": "ddp"})
    found = Checkpointer(cfg, 0, 1).find_resume()  # discovery, as every launch does
    res = {"resumed": found.folder is not None, "skipped": [why for _, why in found.skipped]}
    # and the loaders themselves, as if discovery had let it through
    if (folder / "dcp").is_dir():
        res["dcp"] = attempt(lambda: Plain().load_state(folder, True))
    if (folder / "deepspeed").is_dir():
        calls = []
        fake = ns(universal=False, trainable_only=False, model=ns(load_checkpoint=lambda *a, **k: calls.append(a)))
        res["deepspeed"] = attempt(lambda: DeepSpeedEngine.load_state(fake, folder, True))
        res["deepspeed_called"] = bool(calls)
    if (folder / "rng" / "rank-0.pt").exists():
        res["rng"] = attempt(lambda: load_rng_state(folder / "rng" / "rank-0.pt"))
    out[str(folder)] = res
print(json.dumps(out))
"""


def resume_attempts(tmp_path: Path, *folders: Path) -> dict:
    """What the compute side makes of each folder given as ``checkpoint.resume_from``."""
    work = tmp_path / "compute"
    work.mkdir(exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", RESUME, str(REPO), str(work), *map(str, folders)],
                          capture_output=True, text=True, timeout=180, env=env, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- code in a checkpoint


def _dcp_metadata(tdir, marker):
    return commit(tdir, {"dcp/.metadata": pickle.dumps(Evil(marker)), "dcp/__0_0.distcp": b"\0" * 64})


def _dcp_bytes_entry(tdir, marker):
    real_dcp(contract.checkpoint_tmp(tdir, 1) / "dcp", {"extra": Evil(marker)})  # a non-tensor entry: torch.save bytes
    return commit(tdir, {})


def _zero_optim_states(tdir, marker):
    return commit(tdir, {
        "deepspeed/state/zero_pp_rank_0_mp_rank_00_optim_states.pt":
            torch_bytes({"optimizer_state_dict": {"zero_stage": 2, "loss_scaler": Evil(marker)}}),
        "deepspeed/state/mp_rank_00_model_states.pt": torch_bytes({"module": {"w": torch.ones(2)}, "buffer_names": []}),
    }, state_format="deepspeed")


def _zero_model_states(tdir, marker):
    return commit(tdir, {
        "deepspeed/state/mp_rank_00_model_states.pt":
            torch_bytes({"module": {"w": torch.ones(2)}, "buffer_names": [], "ds_config": Evil(marker)}),
    }, state_format="deepspeed")


def _rng_states(tdir, marker):
    real_dcp(contract.checkpoint_tmp(tdir, 1) / "dcp")
    return commit(tdir, {"rng/rank-0.pt": torch_bytes({"torch": torch.get_rng_state(), "python": Evil(marker)})})


PLACES = {"dcp-metadata": (_dcp_metadata, "dcp"), "dcp-bytes-entry": (_dcp_bytes_entry, "dcp"),
          "zero-optim-states": (_zero_optim_states, "deepspeed"), "zero-model-states": (_zero_model_states, "deepspeed"),
          "rng-states": (_rng_states, "rng")}


@pytest.mark.parametrize("place", list(PLACES))
def test_a_checkpoint_holding_code_is_bad_is_not_consolidated_nor_resumed_and_never_runs(tmp_path, place):
    marker = tmp_path / "MARKER"
    make, loader = PLACES[place]
    folder = make(tmp_path / "task", marker)
    assert contract.verify_checkpoint(folder, deep=True) is None  # sizes and sums agree: only its contents betray it

    out = cli("ckpt", "verify", str(folder), home=tmp_path / "home", timeout=120)
    assert out.returncode == 1 and HOLDS_CODE in out.stderr and "posix.system" in out.stderr, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and " good " not in out.stdout

    res = cli("ckpt", "consolidate", str(folder), "--out", str(tmp_path / "out"), home=tmp_path / "home", timeout=120)
    assert res.returncode != 0 and HOLDS_CODE in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "out").exists()

    got = resume_attempts(tmp_path, folder)[str(folder)]
    assert not got["resumed"] and HOLDS_CODE in got["skipped"][0], got  # skipped, as a damaged one is
    assert got[loader].startswith("refused: ") and HOLDS_CODE in got[loader], got  # and the loader refuses on its own
    assert not got.get("deepspeed_called"), "DeepSpeed's own loader was reached"
    assert not marker.exists(), "the checkpoint's code ran"


def test_the_refusal_names_the_file_and_the_global(tmp_path):
    marker = tmp_path / "MARKER"
    folder = _zero_optim_states(tmp_path / "task", marker)
    with pytest.raises(safeload.CheckpointRefused) as exc:
        safeload.check_file(folder, "deepspeed/state/zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert str(exc.value) == (f"{folder}/deepspeed/state/zero_pp_rank_0_mp_rank_00_optim_states.pt: it calls "
                              f"posix.system, which no checkpoint needs: {HOLDS_CODE}")
    folder = _dcp_metadata(tmp_path / "task2", marker)
    with pytest.raises(safeload.CheckpointRefused, match=r"dcp/\.metadata: it calls posix\.system"):
        safeload.read_dcp_metadata(folder / "dcp")
    assert not marker.exists()


def test_dcp_metadata_may_only_name_files_of_its_folder(tmp_path):
    """storage_data says where DCP reads each tensor: a path out of the folder is refused."""
    folder = tmp_path / "dcp"
    real_dcp(folder)
    meta = pickle.loads((folder / ".metadata").read_bytes())  # our own, trusted here
    first = next(iter(meta.storage_data))
    meta.storage_data[first] = dataclasses.replace(meta.storage_data[first], relative_path="../../../etc/hostname")
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(safeload.CheckpointRefused, match="not a file name of this folder"):
        safeload.read_dcp_metadata(folder)


# ---------------------------------------------------------------- manifests


def _bad_manifests(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """name -> (checkpoint folder, what `verify` must say)."""
    cases = {}
    hostname = Path("/etc/hostname").read_bytes() if Path("/etc/hostname").is_file() else b""
    outside = tmp_path / "x"
    outside.write_bytes(b"secret")

    def case(name, files, why, setup=None, raw=None):
        tdir = tmp_path / name
        tmp = contract.checkpoint_tmp(tdir, 1)
        tmp.mkdir(parents=True)
        (tmp / "ok.bin").write_bytes(b"ok")
        if setup:
            setup(tmp)
        if raw is not None:
            (tmp / contract.MANIFEST).write_bytes(raw)
            os.replace(tmp, tmp.parent / contract.checkpoint_name(1))
        else:
            contract.commit_checkpoint(tmp, {"step": 1, "engine": "ddp", "world_size": 1, "state_format": "dcp",
                                             "files": {"ok.bin": {"size": 2, "sha256": sha(b"ok")}, **files}})
        cases[name] = (tmp.parent / contract.checkpoint_name(1), why)

    rel = "not a relative path inside the checkpoint folder"
    case("absolute", {"/etc/hostname": {"size": len(hostname), "sha256": sha(hostname)}}, rel)
    case("dotdot", {"../../x": {"size": 6, "sha256": sha(b"secret")}}, rel)
    case("devzero", {"../../../dev/zero": {"size": 0, "sha256": sha(b"")}}, rel)
    case("symlink", {"zero.bin": {"size": 0, "sha256": sha(b"")}}, "zero.bin is a symbolic link, not a regular file",
         setup=lambda t: (t / "zero.bin").symlink_to("/dev/zero"))
    case("linked-folder", {"etc/hostname": {"size": len(hostname), "sha256": sha(hostname)}}, "leads out of the checkpoint folder",
         setup=lambda t: (t / "etc").symlink_to("/etc"))
    case("fifo", {"pipe": {"size": 0, "sha256": sha(b"")}}, "pipe is a FIFO, not a regular file", setup=lambda t: os.mkfifo(t / "pipe"))
    case("files-a-list", None, "manifest damaged: 'files' is not an object",
         raw=json.dumps({"format": 1, "step": 1, "world_size": 1, "files": ["ok.bin"]}).encode())
    case("entry-a-string", {"a.bin": "big"}, "manifest damaged: files['a.bin']: not an object of size and sha256")
    case("no-size", {"a.bin": {"sha256": sha(b"")}}, "files['a.bin']: its size is not a whole number of bytes")
    case("negative-size", {"a.bin": {"size": -1, "sha256": sha(b"")}}, "its size is not a whole number of bytes")
    case("size-true", {"a.bin": {"size": True, "sha256": sha(b"")}}, "its size is not a whole number of bytes")
    case("sha-not-hex", {"a.bin": {"size": 0, "sha256": "z" * 64}}, "its sha256 is not 64 hex digits")
    case("name-not-a-path", {"": {"size": 0, "sha256": sha(b"")}}, "not a file name")
    case("not-json", None, "manifest damaged: not JSON", raw=b"{\"files\": ")
    case("a-list", None, "manifest damaged: not a JSON object", raw=b"[]")
    case("step-a-string", None, "manifest damaged: 'step' is not a whole number",
         raw=json.dumps({"format": 1, "step": "1", "world_size": 1, "files": {}}).encode())
    case("manifest-linked", None, "manifest.json cannot be read", raw=b"")
    link = cases["manifest-linked"][0] / contract.MANIFEST
    link.unlink()
    link.symlink_to("/dev/zero")
    return cases


@pytest.mark.timeout(600)
def test_manifests_naming_paths_outside_links_fifos_or_malformed_entries_are_named_without_a_hang(tmp_path):
    cases = _bad_manifests(tmp_path)
    for name, (folder, why) in cases.items():
        assert contract.verify_checkpoint(folder, deep=True) is not None, name
        out = cli("ckpt", "verify", str(folder), home=tmp_path / "home", timeout=60)
        assert out.returncode == 1 and why in out.stderr, (name, out.stdout + out.stderr)
        assert "Traceback" not in out.stderr, (name, out.stderr)
    listed = cli("ckpt", "list", str(cases["devzero"][0].parent), "--deep", "--json", home=tmp_path / "home", timeout=60)
    assert listed.returncode == 0 and not json.loads(listed.stdout)[0]["verified"], listed.stderr
    got = resume_attempts(tmp_path, *(folder for folder, _ in cases.values()))
    for name, (folder, why) in cases.items():
        res = got[str(folder)]
        assert not res["resumed"] and why in res["skipped"][0], (name, res)


def test_hashing_reads_regular_files_only_and_never_past_the_size_given(tmp_path):
    (tmp_path / "f").write_bytes(b"a" * 10)
    assert contract.file_sha256(tmp_path / "f", limit=3) == sha(b"a" * 4)  # stops past the limit
    (tmp_path / "z").symlink_to("/dev/zero")
    with pytest.raises(ValueError, match="symbolic link"):
        contract.file_sha256(tmp_path / "z")
    os.mkfifo(tmp_path / "p")
    with pytest.raises(ValueError, match="not a regular file"):
        contract.file_sha256(tmp_path / "p")  # opened without blocking, then refused


# ---------------------------------------------------------------- deleting


def _tree(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else None for p in sorted(path.rglob("*"))}


def test_prune_never_deletes_through_a_linked_checkpoints_folder(tmp_path):
    outside = tmp_path / "someone-else"
    for step in (100, 200, 300):
        commit(outside, {"dcp/__0_0.distcp": bytes([step % 251]) * 100}, step=step)
    before = _tree(outside)
    tdir = contract.task_dir(tmp_path / "run", 0)
    tdir.mkdir(parents=True)
    contract.checkpoints_dir(tdir).symlink_to(contract.checkpoints_dir(outside))
    out = cli("ckpt", "prune", str(tmp_path / "run"), "--keep", "1", home=tmp_path / "home")
    assert out.returncode == 1 and "is a symbolic link" in out.stderr and "removed 0 checkpoint(s)" in out.stdout, out
    assert _tree(outside) == before
    assert contract.remove_leftovers(tdir) == [] and _tree(outside) == before


def test_prune_never_deletes_through_a_linked_step_folder(tmp_path):
    outside = tmp_path / "someone-else"
    commit(outside, {"dcp/__0_0.distcp": b"x" * 100}, step=100)
    before = _tree(outside)
    tdir = contract.task_dir(tmp_path / "run", 0)
    for step in (200, 300):
        commit(tdir, {"dcp/__0_0.distcp": bytes([step % 251]) * 100}, step=step)
    (contract.checkpoints_dir(tdir) / "step-000000100").symlink_to(contract.checkpoints_dir(outside) / "step-000000100")
    leftover = contract.checkpoints_dir(tdir) / ".tmp-step-000000400"
    leftover.symlink_to(contract.checkpoints_dir(outside) / "step-000000100")
    out = cli("ckpt", "prune", str(tmp_path / "run"), "--keep", "1", home=tmp_path / "home")
    assert out.returncode == 1 and "step-000000100" in out.stderr and "symbolic link" in out.stderr, out
    assert "removing task 0 step-000000200" in out.stdout  # the real one goes
    assert _tree(outside) == before
    with pytest.raises(contract.UnsafeDeletion):
        contract.discard_checkpoint(contract.checkpoints_dir(tdir) / "step-000000100")
    assert contract.remove_leftovers(tdir) == [".tmp-step-000000400"]  # the link removed, not what it points to
    assert not os.path.lexists(leftover) and _tree(outside) == before


# ---------------------------------------------------------------- real checkpoints still load


def test_a_dcp_checkpoint_of_a_model_and_its_optimizer_passes_and_reads_as_torch_reads_it(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    real_dcp(tmp_path / "dcp")
    safeload.check_dcp(tmp_path / "dcp")
    mine = safeload.read_dcp_metadata(tmp_path / "dcp")
    theirs = FileSystemReader(str(tmp_path / "dcp")).read_metadata()  # our own file: trusted here
    assert mine.state_dict_metadata == theirs.state_dict_metadata and mine.storage_data == theirs.storage_data


def test_the_deepspeed_allow_list_names_real_deepspeed_objects_and_loads_the_fp16_scaler(tmp_path):
    """The names track DeepSpeed (a rename would make every checkpoint refused); fp16's dynamic
    scaler, on GPUs only, is checked by pickling a real one."""
    import importlib

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    for name in safeload.DEEPSPEED_GLOBALS:
        module, attr = name.rsplit(".", 1)
        assert isinstance(getattr(importlib.import_module(module), attr), type), name
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    scaler = DynamicLossScaler(init_scale=2**16, scale_window=1000, min_scale=1, delayed_shift=2, consecutive_hysteresis=False)
    torch.save({"optimizer_state_dict": {"loss_scaler": scaler, "dynamic_loss_scale": True}}, tmp_path / "o.pt")
    assert isinstance(safeload.torch_load(tmp_path / "o.pt")["optimizer_state_dict"]["loss_scaler"], safeload._Inert)


@pytest.mark.multiproc
def test_real_zero_checkpoints_hold_exactly_the_allow_listed_globals_and_load(tmp_path):
    """ZeRO-2 and ZeRO-3 checkpoints (2 ranks) of a model with frozen, tied and integer parts."""
    from torch.serialization import get_unsafe_globals_in_checkpoint

    from conftest import free_port

    made = subprocess.run([sys.executable, str(REPO / "tests" / "workloads" / "zero_frozen_tied.py"), str(tmp_path), str(free_port())],
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    seen = set()
    for stage in (2, 3):
        src = tmp_path / f"z{stage}" / "deepspeed"
        files = safeload.torch_files(src)
        assert len(files) >= 3
        for rel in files:
            seen |= set(get_unsafe_globals_in_checkpoint(str(src / rel)))
        safeload.check_everywhere(src, files)
    assert seen == set(safeload.DEEPSPEED_GLOBALS) - {"deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"}
