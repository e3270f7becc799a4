"""The payloads of the SLURM benchmarks. bench/submission.py: a process that waits until
the benchmark tells its array task to finish (exit 0) or fail (exit 1), and writes when
it exited; ``python bench/payloads.py`` (sbatch, orchestrate) or ``sleeper(i)``
(submitit). bench/thousand.py: ``python bench/payloads.py short``, a task that sleeps
BENCH_SHORT_S seconds and ends."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def sleeper(index: int | None = None) -> int:
    folder = Path(os.environ["BENCH_DIR"])
    index = int(os.environ["SLURM_ARRAY_TASK_ID"]) if index is None else index
    deadline = time.time() + float(os.environ.get("BENCH_MAX_S", "1200"))
    (folder / f"started-{index}").touch()  # the benchmark counts RPCs once every task is up
    while time.time() < deadline:
        for outcome, code in (("finish", 0), ("fail", 1)):
            if (folder / f"{outcome}-{index}").exists():
                tmp = folder / f".exited-{index}.tmp"
                tmp.write_text(str(time.time()))
                tmp.rename(folder / f"exited-{index}")
                if code:
                    raise SystemExit(code)
                return code
        time.sleep(0.2)
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["short"]:
        time.sleep(float(os.environ.get("BENCH_SHORT_S", "2")))
        sys.exit(0)
    sys.exit(sleeper())
