"""The Trainer's own arguments that mean something else under orchestrate are said, once,
as a `trainer.settings` event (issue 32): a rotation that finds nothing to rotate, an
output folder on another filesystem (each checkpoint copied, not renamed)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from train_entry.integrations.hf_trainer import settings_notes


def test_the_defaults_need_no_word(tmp_path):
    assert settings_notes(SimpleNamespace(save_total_limit=None, output_dir=str(tmp_path / "trainer")), tmp_path) == []


def test_a_rotation_and_an_output_folder_elsewhere_are_said(tmp_path):
    if os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("/dev/shm and the test's folder are one filesystem here")
    notes = settings_notes(SimpleNamespace(save_total_limit=3, output_dir="/dev/shm/not-yet/out"), tmp_path)
    assert len(notes) == 2 and "save_total_limit=3" in notes[0] and "keep_last" in notes[0]
    assert "/dev/shm/not-yet/out is on another filesystem" in notes[1] and "copied" in notes[1]
