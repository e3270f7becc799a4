from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """An isolated ORCHESTRATE_HOME (ledger and run folders) for one test."""
    h = tmp_path / "home"
    monkeypatch.setenv("ORCHESTRATE_HOME", str(h))
    return h


def cli(*args: str, home: Path, timeout: float = 300, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run `orchestrate` as a user would, in a fresh process."""
    env = {**os.environ, "ORCHESTRATE_HOME": str(home), "PYTHONPATH": str(REPO / "tests" / "workloads")}
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd or REPO,
        stdin=subprocess.DEVNULL,
    )


def status_json(home: Path, *ref: str) -> dict:
    out = cli("status", *ref, "--json", home=home)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
