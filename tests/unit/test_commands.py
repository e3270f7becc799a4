"""The command chokepoint: argv lists, timeouts, errors that carry what happened."""

import sys

import pytest

from orchestrator.scheduler import commands
from orchestrator.errors import SchedulerError


def test_success_and_failure_carry_output():
    assert commands.run([sys.executable, "-c", "print('hi')"], timeout=30).stdout == "hi\n"
    with pytest.raises(commands.CommandError) as err:
        commands.run([sys.executable, "-c", "import sys; sys.stderr.write('nope'); sys.exit(3)"], timeout=30)
    e = err.value
    assert isinstance(e, SchedulerError) and e.returncode == 3 and e.stderr == "nope" and not e.transient
    assert "failed (exit 3): nope" in str(e)


def test_timeout_and_missing_binary_are_errors_not_hangs():
    with pytest.raises(commands.CommandError) as err:
        commands.run(["sleep", "5"], timeout=0.2)
    assert err.value.returncode is None and err.value.transient and "no answer within 0.2 s" in str(err.value)
    with pytest.raises(commands.CommandError, match="not installed or not on PATH"):
        commands.run(["no-such-binary-xyz"], timeout=5)


def test_query_retries_transient_failures_only(tmp_path):
    counter = tmp_path / "n"
    flaky = (
        "import sys, pathlib; p = pathlib.Path(sys.argv[1]); n = int(p.read_text() or 0) if p.exists() else 0; "
        "p.write_text(str(n + 1)); "
        "sys.exit(0) if n >= 2 else (sys.stderr.write('Socket timed out on send/recv operation'), sys.exit(1))"
    )
    assert commands.query([sys.executable, "-c", flaky, str(counter)], timeout=30).returncode == 0
    assert counter.read_text() == "3"
    counter.write_text("0")
    with pytest.raises(commands.CommandError):
        commands.query([sys.executable, "-c", "import sys; sys.exit(1)"], timeout=30)
