"""Pinned checkpoints (`contract.pins`): kept past `keep_last` by the run's own rotation and
by `ckpt prune` (unless `--include-pinned`); a pin file is untrusted input, and a damaged or
hostile one pins nothing."""

import os

import pytest

from orchestrator import contract
from test_ckpt_commands import make_checkpoint
from train_entry.checkpoint.rotation import Rotation


def steps(tdir):
    return [s for s, _ in contract.committed_checkpoints(tdir)]


def test_each_owner_writes_its_own_pins_and_readers_see_them_all(tmp_path):
    contract.write_pins(tmp_path, "trainer", {30: "the Trainer's best"})
    contract.write_pins(tmp_path, "keep-best", {10: "exact_match 0.9", 30: "exact_match 0.8"})
    assert contract.read_pins(tmp_path) == {10: "exact_match 0.9", 30: "exact_match 0.8"}  # owners in name order
    contract.write_pins(tmp_path, "keep-best", {})
    assert contract.read_pins(tmp_path) == {30: "the Trainer's best"}
    with pytest.raises(ValueError, match="pin owner"):
        contract.pins_path(tmp_path, "../escape")


@pytest.mark.parametrize("content", [b"{not json", b'{"steps": [30]}', b'{"steps": {"30": 5, "x": "y", "-1": "z"}}',
                                     b"[]", b'{"steps": {"' + b"9" * 20 + b'": "huge"}}'])
def test_a_damaged_pin_file_pins_nothing(tmp_path, content):
    (tmp_path / contract.pins.PINS_DIR).mkdir()
    (tmp_path / contract.pins.PINS_DIR / "trainer.json").write_bytes(content)
    assert contract.read_pins(tmp_path) == {}


def test_a_pin_file_that_is_a_link_or_a_fifo_is_not_followed(tmp_path):
    outside = tmp_path / "elsewhere.json"
    outside.write_text('{"steps": {"10": "planted"}}')
    folder = tmp_path / "task" / contract.pins.PINS_DIR
    folder.mkdir(parents=True)
    os.symlink(outside, folder / "trainer.json")
    os.mkfifo(folder / "keep-best.json")
    assert contract.read_pins(tmp_path / "task") == {}


def test_rotation_spares_a_pinned_checkpoint(tmp_path):
    tdir = tmp_path / "task"
    contract.write_pins(tdir, "trainer", {100: "best"})
    for step in (100, 200, 300, 400):
        make_checkpoint(tdir, step)
        rotation = Rotation(tdir, keep_last=2)
        rotation.rotate()
        rotation.wait()
    assert steps(tdir) == [400, 300, 100]


def test_prune_keeps_pinned_ones_unless_asked(tmp_path):
    from conftest import cli

    tdir = contract.task_dir(tmp_path / "run", 0)
    for step in (100, 200, 300):
        make_checkpoint(tdir, step)
    contract.write_pins(tdir, "trainer", {100: "the Trainer's best"})
    assert cli("ckpt", "prune", str(tmp_path / "run"), "--keep", "1", home=tmp_path / "home").returncode == 0
    assert steps(tdir) == [300, 100]
    out = cli("ckpt", "prune", str(tmp_path / "run"), "--keep", "1", "--include-pinned", home=tmp_path / "home")
    assert out.returncode == 0 and steps(tdir) == [300], out.stderr


def test_rotation_keeps_what_the_watcher_has_not_seen_while_checkpoints_are_evaluated(tmp_path):
    tdir = tmp_path / "task"
    assert contract.unseen_after(tdir) is None  # no evaluations: keep_last alone
    contract.write_seen(tdir, -1)  # at submission
    for step in (100, 200, 300):
        make_checkpoint(tdir, step)
        rotation = Rotation(tdir, keep_last=2)
        rotation.rotate()
        rotation.wait()
    assert steps(tdir) == [300, 200, 100]  # the watcher has looked at none of them yet
    contract.write_seen(tdir, 300)  # it has (and pinned what it needs): rotation goes on
    make_checkpoint(tdir, 400)
    Rotation(tdir, keep_last=2).rotate()
    assert steps(tdir) == [400, 300]
    contract.pins_path(tdir, "evaluations-seen").write_text("{damaged")
    assert contract.unseen_after(tdir) == -1  # a damaged watermark keeps everything
    assert contract.read_pins(tdir) == {}
