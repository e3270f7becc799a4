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
