"""Pure parsers for the units SLURM uses (time limits, memory sizes), and for durations and
sizes as people write them (``2h``, ``200KB``)."""

from __future__ import annotations

import re

# at most 9 digits a number: beyond any limit SLURM keeps, and never a huge int to parse
_N = r"(\d{1,9})"
_TIME_FORMS = (
    (re.compile(rf"^{_N}$"), ("m",)),
    (re.compile(rf"^{_N}:(\d{{1,2}})$"), ("m", "s")),
    (re.compile(rf"^{_N}:(\d{{1,2}}):(\d{{1,2}})$"), ("h", "m", "s")),
    (re.compile(rf"^{_N}-{_N}$"), ("d", "h")),
    (re.compile(rf"^{_N}-{_N}:(\d{{1,2}})$"), ("d", "h", "m")),
    (re.compile(rf"^{_N}-{_N}:(\d{{1,2}}):(\d{{1,2}})$"), ("d", "h", "m", "s")),
)
_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def parse_slurm_time(text: str) -> int:
    """Seconds in a SLURM time limit (``90``, ``1:30:00``, ``2-00:00:00``, ...).

    Raises ValueError naming the accepted forms.
    """
    text = str(text).strip()
    for pattern, units in _TIME_FORMS:
        m = pattern.match(text)
        if m:
            return sum(int(v) * _SECONDS[u] for v, u in zip(m.groups(), units))
    raise ValueError(
        f"{_shown(text)} is not a SLURM time limit; use minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"
    )


_DURATION = re.compile(r"^(\d{1,9}(?:\.\d{1,6})?)\s*([smhd]?)$", re.IGNORECASE)


def parse_duration_s(text: str) -> float:
    """Seconds in a duration as people write one: ``90`` (seconds), ``90s``, ``30m``, ``2h``,
    ``1.5d``. Raises ValueError naming the accepted forms; zero is not a duration."""
    m = _DURATION.match(str(text).strip())
    seconds = float(m.group(1)) * _SECONDS[(m.group(2) or "s").lower()] if m else 0.0
    if seconds <= 0:
        raise ValueError(f"{_shown(text)} is not a duration; use seconds, or a number with s, m, h or d (90s, 30m, 2h, 1.5d)")
    return seconds


def _shown(text) -> str:
    """``text`` quoted for an error message, cut short (it may be anything)."""
    text = str(text)
    return repr(text if len(text) <= 40 else text[:40] + "...")


def format_slurm_time(seconds: int) -> str:
    days, rest = divmod(int(seconds), 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    return f"{days}-{h:02d}:{m:02d}:{s:02d}" if days else f"{h:02d}:{m:02d}:{s:02d}"


_MEM = re.compile(r"^(\d{1,15})([KMGT]?)B?$", re.IGNORECASE)
_MEM_MB = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 * 1024}
MAX_MEMORY_MB = 1024**3  # 1 PiB: more than any node has


def parse_memory_mb(text: str) -> int:
    """Megabytes in a SLURM memory size (``4096``, ``4G``, ``500M``); SLURM's default unit is MB.

    0 stays 0: SLURM's "all the memory of each node" (not 1 MB)."""
    m = _MEM.match(str(text).strip())
    if not m:
        raise ValueError(f"{_shown(text)} is not a memory size; use e.g. 4096, 500M, 16G or 1T (0: all of a node's memory)")
    n = int(m.group(1))
    mb = n * _MEM_MB[m.group(2).upper()]
    if mb > MAX_MEMORY_MB:
        raise ValueError(f"'{text}' is more than 1P (1024T); no node has that much memory")
    return 0 if n == 0 else max(1, int(mb))


def sbatch_memory(text: str) -> str:
    """The value of sbatch's ``--mem`` for a memory size: ``0`` as itself (all of each
    node's memory), anything else in whole megabytes."""
    mb = parse_memory_mb(text)
    return "0" if mb == 0 else f"{mb}M"


_SIZE = re.compile(r"^(\d{1,15}(?:\.\d{1,9})?)\s*([KMGT]?)(i?B)?$", re.IGNORECASE)
_SIZE_EXP = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}


def parse_bytes(text: str) -> int:
    """Bytes in a size such as ``5GB``, ``500MB``, ``100KB`` or ``1048576`` (binary multiples)."""
    m = _SIZE.match(str(text).strip())
    if not m:
        raise ValueError(f"{_shown(text)} is not a size; use e.g. 5GB, 500MB or 100KB")
    size = float(m.group(1)) * 1024 ** _SIZE_EXP[m.group(2).upper()]
    if size > 1024**5:
        raise ValueError(f"'{text}' is more than 1PB")
    return max(1, int(size))
