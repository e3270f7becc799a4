"""The one place that runs external commands (sbatch, sacct, squeue, scancel, ...).

Every command is an argv list (never a shell string) with a timeout. Read-only
queries may be retried on the transient failures a busy controller gives; commands
that change something are run once, except where repeating them is harmless.
"""

from __future__ import annotations

import logging
import subprocess
from dataclasses import dataclass
from typing import Mapping, Sequence

from tenacity import retry, retry_if_exception, stop_after_attempt, wait_exponential

from orchestrator.errors import SchedulerError

log = logging.getLogger(__name__)

# Words of SLURM's clients when the controller or slurmdbd is briefly unreachable.
TRANSIENT = (
    "Socket timed out",
    "Unable to contact slurm controller",
    "slurm_receive_msg",
    "Connection refused",
    "Zero Bytes were transmitted",
    "Transport endpoint is not connected",
)


@dataclass(eq=False)  # exceptions compare by identity
class CommandError(SchedulerError):
    argv: list[str]
    returncode: int | None  # None: it timed out or could not start
    stdout: str
    stderr: str

    def __str__(self) -> str:
        what = " ".join(self.argv[:3]) + (" ..." if len(self.argv) > 3 else "")
        if self.returncode is None:
            return f"`{what}`: {self.stderr.strip()}"
        detail = (self.stderr or self.stdout).strip() or "no output"
        return f"`{what}` failed (exit {self.returncode}): {detail}"

    @property
    def transient(self) -> bool:
        return self.returncode is None or any(w in self.stderr for w in TRANSIENT)


def run(
    argv: Sequence[str],
    *,
    timeout: float,
    check: bool = True,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
) -> subprocess.CompletedProcess:
    """Run ``argv`` once; raise CommandError when it fails (``check``), times out or is missing."""
    argv = [str(a) for a in argv]
    try:
        out = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd, stdin=subprocess.DEVNULL
        )
    except FileNotFoundError:
        raise CommandError(argv, None, "", f"'{argv[0]}' is not installed or not on PATH") from None
    except subprocess.TimeoutExpired as exc:
        raise CommandError(argv, None, _text(exc.stdout), f"no answer within {timeout:g} s") from None
    if check and out.returncode != 0:
        raise CommandError(argv, out.returncode, out.stdout, out.stderr)
    return out


def query(argv: Sequence[str], *, timeout: float = 30, attempts: int = 3, **kw) -> subprocess.CompletedProcess:
    """A read-only (or idempotent) command: retried with backoff on transient failures."""

    def _log(state) -> None:
        log.info("retrying %s after: %s", argv[0], state.outcome.exception())

    runner = retry(
        retry=retry_if_exception(lambda e: isinstance(e, CommandError) and e.transient),
        stop=stop_after_attempt(attempts),
        wait=wait_exponential(multiplier=0.5, max=5),
        before_sleep=_log,
        reraise=True,
    )(run)
    return runner(argv, timeout=timeout, **kw)


def _text(data) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


class Runner:
    """The command runner the SLURM scheduler is given (tests inject their own, e.g. one
    that counts or records the calls, instead of patching this module)."""

    def run(self, argv: Sequence[str], *, timeout: float, check: bool = True, **kw) -> subprocess.CompletedProcess:
        return run(argv, timeout=timeout, check=check, **kw)

    def query(self, argv: Sequence[str], *, timeout: float = 30, attempts: int = 3, **kw) -> subprocess.CompletedProcess:
        return query(argv, timeout=timeout, attempts=attempts, **kw)
