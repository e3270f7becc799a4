"""What validate checks of a `kind: command` (issue 32): the program on the ranks' PATH,
and the files and folders its arguments plainly name; the rest is said as not checked."""

from __future__ import annotations

import os

from orchestrator.submit import command_check


def test_the_paths_a_program_reads_are_found_and_names_are_left_alone():
    argv = ["trl", "sft", "--model_name_or_path", "./m", "--dataset_name", "HuggingFaceH4/ultrachat_200k",
            "--data=/d", "--output_dir", "./out", "train", "cfg.yml", "--config", "x.yaml", "--dataset", "~/data"]
    assert command_check.read_paths(argv) == [(3, "./m", "named by --model_name_or_path"), (6, "/d", "named by --data"),
                                              (10, "cfg.yml", "a config file"), (14, "~/data", "named by --dataset")]
    # a hub id, a split's name, an output folder, a flag's own value: never taken for files to read


def test_a_missing_program_or_file_is_named_with_its_place_in_argv(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "cfg.yml").write_text("{}\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "tool"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    ok = ["tool", "train", "cfg.yml", "--dataset_name", "./data"]
    assert command_check.problems(ok, str(tmp_path), str(bin_dir)) == []
    assert command_check.problems(["python", "t.py"], str(tmp_path), "") == []  # the agent's own interpreter
    found = command_check.problems(["nosuch", "train", "gone.yml", "--data", "./none"], str(tmp_path), str(bin_dir))
    assert [i for i, _ in found] == [0, 2, 4]
    assert "no program 'nosuch' on PATH" in found[0][1]
    assert f"'{os.path.join(tmp_path, 'gone.yml')}' (a config file;" in found[1][1] and "named by --data" in found[2][1]
