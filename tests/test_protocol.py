import os

import pytest

from orchestrator import protocol
from orchestrator.units import format_slurm_time, parse_memory_mb, parse_slurm_time


@pytest.mark.parametrize(
    "text,expected",
    [
        ("n1", ["n1"]),
        ("n[1-3]", ["n1", "n2", "n3"]),
        ("n[1-2,5],gpu[08-10]", ["n1", "n2", "n5", "gpu08", "gpu09", "gpu10"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("a,b", ["a", "b"]),
    ],
)
def test_expand_hostlist(text, expected):
    assert protocol.expand_hostlist(text) == expected


def test_slurm_units():
    assert parse_slurm_time("90") == 5400
    assert parse_slurm_time("1:30") == 90
    assert parse_slurm_time("01:00:00") == 3600
    assert parse_slurm_time("2-00:00:00") == 172800
    assert parse_slurm_time("1-2") == 93600
    with pytest.raises(ValueError):
        parse_slurm_time("1h")
    assert format_slurm_time(93784) == "1-02:03:04"
    assert parse_memory_mb("4G") == 4096 and parse_memory_mb("500M") == 500 and parse_memory_mb("1024") == 1024


def test_atomic_write_leaves_no_temporary_files(tmp_path):
    target = tmp_path / "sub" / "hb.json"
    protocol.atomic_write_json(target, {"a": 1})
    protocol.atomic_write_json(target, {"a": 2})
    assert protocol.read_json(target) == {"a": 2}
    assert os.listdir(target.parent) == ["hb.json"]
    assert protocol.read_json(tmp_path / "absent.json") is None


def test_jsonl_reader_takes_only_complete_lines(tmp_path):
    p = tmp_path / "m.jsonl"
    protocol.append_jsonl(p, {"step": 1})
    with open(p, "a") as fh:
        fh.write('{"step": 2')  # a writer caught mid-line
    rows, off = protocol.read_jsonl_from(p, 0)
    assert rows == [{"step": 1}]
    with open(p, "a") as fh:
        fh.write("}\n")
    rows, off2 = protocol.read_jsonl_from(p, off)
    assert rows == [{"step": 2}] and off2 == p.stat().st_size


def test_ports_differ_between_jobs_and_generations():
    ports = {protocol.derive_port(str(j)) for j in range(1000, 1100)}
    assert len(ports) == 100 and all(20000 <= p < 50000 for p in ports)
    assert protocol.derive_port("1234_5") != protocol.derive_port("1234_5", generation=1)


def test_contract_module_is_stdlib_only():
    import ast
    import sys

    tree = ast.parse(open(protocol.__file__).read())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names <= set(sys.stdlib_module_names) | {"__future__"}


def test_train_entry_imports_only_the_contract_from_orchestrator():
    import ast
    import pathlib

    import train_entry

    for f in pathlib.Path(train_entry.__file__).parent.rglob("*.py"):
        tree = ast.parse(f.read_text())
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("orchestrator"):
                ok = n.module == "orchestrator.protocol" or (n.module == "orchestrator" and [a.name for a in n.names] == ["protocol"])
                assert ok, f"{f} imports {n.module}"
            if isinstance(n, ast.Import):
                for a in n.names:
                    assert not a.name.startswith("orchestrator") or a.name == "orchestrator.protocol", f
