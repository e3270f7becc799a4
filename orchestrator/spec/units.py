"""Pure parsers for the units SLURM uses: time limits and memory sizes."""

from __future__ import annotations

import re

_TIME_FORMS = (
    (re.compile(r"^(\d+)$"), ("m",)),
    (re.compile(r"^(\d+):(\d{1,2})$"), ("m", "s")),
    (re.compile(r"^(\d+):(\d{1,2}):(\d{1,2})$"), ("h", "m", "s")),
    (re.compile(r"^(\d+)-(\d+)$"), ("d", "h")),
    (re.compile(r"^(\d+)-(\d+):(\d{1,2})$"), ("d", "h", "m")),
    (re.compile(r"^(\d+)-(\d+):(\d{1,2}):(\d{1,2})$"), ("d", "h", "m", "s")),
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
        f"'{text}' is not a SLURM time limit; use minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"
    )


def format_slurm_time(seconds: int) -> str:
    days, rest = divmod(int(seconds), 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    return f"{days}-{h:02d}:{m:02d}:{s:02d}" if days else f"{h:02d}:{m:02d}:{s:02d}"


_MEM = re.compile(r"^(\d+)([KMGT]?)B?$", re.IGNORECASE)
_MEM_MB = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 * 1024}


def parse_memory_mb(text: str) -> int:
    """Megabytes in a SLURM memory size (``4096``, ``4G``, ``500M``); SLURM's default unit is MB."""
    m = _MEM.match(str(text).strip())
    if not m:
        raise ValueError(f"'{text}' is not a memory size; use e.g. 4096, 500M, 16G or 1T")
    return max(1, int(int(m.group(1)) * _MEM_MB[m.group(2).upper()]))


_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?$", re.IGNORECASE)
_SIZE_EXP = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}


def parse_bytes(text: str) -> int:
    """Bytes in a size such as ``5GB``, ``500MB``, ``100KB`` or ``1048576`` (binary multiples)."""
    m = _SIZE.match(str(text).strip())
    if not m:
        raise ValueError(f"'{text}' is not a size; use e.g. 5GB, 500MB or 100KB")
    return max(1, int(float(m.group(1)) * 1024 ** _SIZE_EXP[m.group(2).upper()]))
