"""Whose failure a rank's exception is: the user's code, orchestrate's own, memory or the cluster.

Fast and in-process: the user's code is a module written into tmp_path and loaded as a
``model.kind: entrypoint`` is."""

import pytest
import torch

from orchestrator import contract
from orchestrator.contract import ExitCode
from train_entry import errors, worker
from train_entry.env import RankContext
from train_entry.heartbeat import Heartbeat
from train_entry.models import build_workload

USER_MODULE = '''
import torch

class Model(torch.nn.Module):
    def __init__(self, fail):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.fail = fail

    def forward(self, x):
        if self.fail == "forward":
            raise ValueError("user bug in forward")
        if self.fail == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory")
        return self.lin(x)

class Data:
    def __init__(self, fail):
        self.fail = fail

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if self.fail == "data":
            raise KeyError(i)
        return torch.ones(4), torch.ones(1)

def loss(out, target):
    return torch.nn.functional.mse_loss(out, target)

def build(fail=None, sizes=None):
    assert isinstance(sizes, (list, type(None))), sizes
    if fail == "build":
        raise RuntimeError("user bug while building")
    out = {"model": Model(fail), "dataset": Data(fail), "loss": loss}
    if fail == "loss":
        out["loss"] = lambda out, target: (out - target).abs()  # not one element
    return out
'''


@pytest.fixture
def user_code(tmp_path, monkeypatch):
    (tmp_path / "users_model_x.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))

    def build(fail=None, **kwargs):
        cfg = contract.TaskConfig.from_dict({
            "contract": contract.CONTRACT_VERSION, "experiment_id": "x", "index": 0, "steps": 1, "task_dir": "/x",
            "model": {"kind": "entrypoint", "entrypoint": "users_model_x:build", "kwargs": {"fail": fail, **kwargs}},
        })
        return build_workload(cfg.model, cfg.data)

    return build


def raised(fn, *args) -> BaseException:
    with pytest.raises(BaseException) as info:
        fn(*args)
    return info.value


def test_what_the_users_code_raises_is_the_users(user_code):
    assert errors.classify(raised(user_code, "build")) == ExitCode.USER_ERROR
    w = user_code("forward")
    assert errors.classify(raised(w.model, torch.ones(2, 4))) == ExitCode.USER_ERROR
    w = user_code("data")
    assert errors.classify(raised(w.dataset.__getitem__, 0)) == ExitCode.USER_ERROR
    assert errors.classify(raised(user_code("loss").loss, torch.ones(2, 1), torch.zeros(2, 1))) == ExitCode.USER_ERROR


def test_a_well_behaved_entry_point_trains_as_written(user_code):
    w = user_code(sizes=[1, 2])  # the kwargs reach it as the lists and dicts the spec holds
    assert sorted(w.model.state_dict()) == ["lin.bias", "lin.weight"]  # no wrapper in the keys
    x, y = w.dataset[0]
    assert len(w.dataset) == 8 and w.loss(w.model(x[None]), y[None]).numel() == 1


def test_what_the_trainer_raises_is_ours(user_code):
    w = user_code()
    w.model(torch.ones(2, 4))  # the user's code ran fine; then our code failed
    assert errors.classify(RuntimeError("Numpy is not available")) == ExitCode.INTERNAL_ERROR
    assert errors.classify(KeyError("step")) == ExitCode.INTERNAL_ERROR


def test_memory_and_the_cluster_are_neither(user_code):
    assert errors.classify(raised(user_code("oom").model, torch.ones(2, 4))) == ExitCode.OUT_OF_MEMORY
    assert errors.classify(torch.OutOfMemoryError("CUDA out of memory")) == ExitCode.OUT_OF_MEMORY
    assert errors.classify(RuntimeError("[gloo] Connection reset by peer")) == ExitCode.INFRA_ERROR
    assert errors.classify(KeyboardInterrupt()) == ExitCode.CANCELLED


def test_errors_that_name_the_users_input_are_the_users(user_code):
    exc = raised(build_workload, {"kind": "entrypoint", "entrypoint": "no_such_module_x:build", "kwargs": {}}, {})
    assert isinstance(exc, errors.UserCodeError) and errors.classify(exc) == ExitCode.USER_ERROR
    exc = raised(build_workload, {"kind": "gpt", "seq_len": 8}, {"kind": "text", "path": "/no/such/file"})
    assert isinstance(exc, errors.UserCodeError) and "data.path" in str(exc)
    exc = raised(user_code("loss").loss, torch.ones(2, 1), torch.zeros(2, 1))
    assert isinstance(exc, errors.UserCodeError) and "one-element tensor" in str(exc)


def test_the_error_record_says_whose_fault_it_was(tmp_path, user_code):
    ctx = RankContext(rank=1, local_rank=1, world_size=2, local_world_size=2, node_rank=0, node_name="n1", launch="7.0", generation=2)
    session = type("Session", (), {"task_dir": tmp_path, "ctx": ctx, "hb": Heartbeat(tmp_path, ctx, 10.0)})()
    session.hb.beat(5, "train")
    for exc, code, kind in [
        (RuntimeError("Numpy is not available"), ExitCode.INTERNAL_ERROR, "internal"),
        (raised(user_code("forward").model, torch.ones(2, 4)), ExitCode.USER_ERROR, "user_error"),
    ]:
        assert worker.record_failure(session, exc) == code
        rec = contract.read_json(contract.error_path(tmp_path, "7.0", 1))
        assert (rec["kind"], rec["exit_code"], rec["step"], rec["generation"]) == (kind, code, 5, 2)
        assert rec["type"] == type(exc).__name__ and rec["message"] == str(exc)
    assert "user bug in forward" in rec["traceback"]
    assert contract.read_json(contract.heartbeat_path(tmp_path, 1))["phase"] == "failed"
