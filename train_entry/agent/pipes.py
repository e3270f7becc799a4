"""Writing to a child's stdin without ever blocking the agent for long: an order larger
than the pipe's buffer waits for the child to read it, up to a deadline."""

from __future__ import annotations

import os
import select
import subprocess
import time

WRITE_DEADLINE_S = 60.0  # for an order larger than the pipe's buffer (every rank's environment): the child reads it first


def write_all(proc: subprocess.Popen, data: bytes, deadline_s: float) -> bool:
    """``data``, then the end of input; False when the child died or did not read it all
    within ``deadline_s``."""
    try:
        fd = proc.stdin.fileno()
        os.set_blocking(fd, False)
        view, end = memoryview(data), time.monotonic() + deadline_s
        while view:
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:
                if time.monotonic() > end or proc.poll() is not None:
                    return False
                select.select([], [fd], [], 0.1)
        proc.stdin.close()
        return True
    except (OSError, ValueError):
        return False
