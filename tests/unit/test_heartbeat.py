"""The trainer's heartbeat file: periodic within a phase, written at once on a new phase."""

from orchestrator import contract
from train_entry.env import RankContext
from train_entry.heartbeat import Heartbeat


def test_a_new_phase_is_written_at_once_and_the_same_phase_only_every_interval(tmp_path):
    now = [1000.0]
    ctx = RankContext(rank=1, local_rank=1, world_size=2, local_world_size=2, node_rank=0, node_name="n1", launch="7.0")
    hb = Heartbeat(tmp_path, ctx, interval_s=10.0, clock=lambda: now[0])

    def written():
        rec = contract.read_json(contract.heartbeat_path(tmp_path, 1))
        return rec["step"], rec["phase"]

    hb.beat(5, "train")
    assert written() == (5, "train")
    now[0] += 1
    hb.beat(6, "train")  # within the interval: not written
    assert written() == (5, "train")
    hb.beat(6, "saving", force=True)
    now[0] += 0.5
    # back to training right after a save: written, or a rank hung now would keep the save's long timeout
    hb.beat(6, "train")
    assert written() == (6, "train")
    now[0] += 10
    hb.beat(9, "train")
    assert written() == (9, "train")


def test_a_save_beats_only_while_it_advances_and_a_stalled_one_gets_the_training_timeout(tmp_path):
    import time

    from orchestrator.contract.taskconfig import Heartbeat as HbConfig
    from orchestrator.supervise.recovery import find_hang
    from train_entry.checkpoint.progress import SaveProgress

    class Beats:
        def __init__(self):
            self.beats = []

        def beat(self, step, phase, force=False):
            self.beats.append((step, phase))

    hb, folder = Beats(), tmp_path / ".tmp-step-7"
    folder.mkdir()
    (tmp_path / "step-000000005").mkdir()  # a committed checkpoint: not a save in progress
    with SaveProgress(hb, 7, tmp_path, interval_s=0.05) as progress:
        assert hb.beats == [(7, "writing")]  # the save's clock starts at once
        time.sleep(0.3)
        assert len(hb.beats) == 1  # nothing written, no stage passed: silent, as a stuck step is
        (folder / "shard").write_bytes(b"x" * 100)
        time.sleep(0.3)
        assert len(hb.beats) == 2  # the folder grew
        progress.advance()
        time.sleep(0.3)
        assert len(hb.beats) == 3  # a stage passed (a block hashed)
        (tmp_path / "step-000000005" / "big").write_bytes(b"x" * 100)
        time.sleep(0.3)
        assert len(hb.beats) == 3  # a committed folder is no progress
        (tmp_path / ".tmp-step-6").mkdir()
        (tmp_path / ".tmp-step-6" / "shard").write_bytes(b"x" * 10)
        time.sleep(0.3)
        assert len(hb.beats) == 4  # an earlier asynchronous save this one waits for: progress too
    assert set(hb.beats) == {(7, "writing")}

    cfg = HbConfig(interval_s=1.0, timeout_s=4.0, save_timeout_s=1800.0)
    row = {"rank": 1, "node": "n2", "launch": "7.0", "generation": 0, "step": 300, "time": 1000.0}
    assert find_hang([{**row, "phase": "writing"}], "7.0", cfg, 0.1, 1006.0).phase == "writing"
    assert find_hang([{**row, "phase": "saving"}], "7.0", cfg, 0.1, 1006.0) is None  # a script's own save: no progress reported
