"""Pinned checkpoints: kept past ``checkpoint.keep_last``, by rotation and ``ckpt prune``.

Who pins a checkpoint writes its own file, ``pins/<owner>.json`` in the task folder
(``{"steps": {"<step>": "why"}}``, atomically), so that two writers never share one: the
Hugging Face Trainer's callback pins the Trainer's best checkpoint (``trainer``); the
evaluation of checkpoints pins the best by a metric (``keep-best``). A pin file is
untrusted like the rest of the run folder: anything but that shape counts as no pin.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from . import safe_read
from .files import atomic_write_json

PINS_DIR = "pins"
SEEN = "evaluations-seen"  # the watcher's watermark: checkpoints after it have not been looked at yet
_OWNER = re.compile(r"^[a-z][a-z0-9-]{0,31}$")
_MAX = 1 << 20


def pins_path(tdir: str | os.PathLike, owner: str) -> Path:
    if not _OWNER.match(owner):
        raise ValueError(f"pin owner {owner!r}: lower-case letters, digits and '-'")
    return Path(tdir) / PINS_DIR / f"{owner}.json"


def write_pins(tdir: str | os.PathLike, owner: str, steps: dict[int, str]) -> None:
    """``owner``'s pins, replacing its previous ones (an empty dict removes them all)."""
    path = pins_path(tdir, owner)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"steps": {str(int(s)): str(why)[:500] for s, why in sorted(steps.items())}})


def write_seen(tdir: str | os.PathLike, through: int) -> None:
    """The watcher has looked at (and pinned what it needs of) every committed checkpoint up
    to step ``through``; written -1 at submission when the spec evaluates checkpoints."""
    path = pins_path(tdir, SEEN)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"through": int(through)})


def unseen_after(tdir: str | os.PathLike) -> int | None:
    """Rotation keeps every checkpoint after this step (its evaluation may be due, and the
    watcher has not looked yet); None: no evaluations watch this task. A damaged watermark
    keeps everything (-1): nothing due for evaluation is deleted unseen."""
    path = pins_path(tdir, SEEN)
    if not os.path.lexists(path):
        return None
    try:
        data = safe_read.read_capped(path, _MAX, follow=False)
        through = json.loads(data.decode("utf-8")).get("through") if data else None
    except (safe_read.BadRecord, OSError, ValueError, AttributeError, RecursionError):
        return -1
    return through if isinstance(through, int) and not isinstance(through, bool) else -1


def read_pins(tdir: str | os.PathLike) -> dict[int, str]:
    """step -> why it is kept, every owner's pins together (owners in name order: the first
    reason wins)."""
    out: dict[int, str] = {}
    folder = Path(tdir) / PINS_DIR
    try:
        names = sorted(p.name for p in folder.iterdir())
    except OSError:
        return out
    for name in names:
        if not (name.endswith(".json") and _OWNER.match(name[:-5])):
            continue
        for step, why in _owner_pins(folder / name).items():
            out.setdefault(step, why)
    return out


def read_owner_pins(tdir: str | os.PathLike, owner: str) -> dict[int, str]:
    """``owner``'s own pins (none: {})."""
    return _owner_pins(pins_path(tdir, owner))


def _owner_pins(path: Path) -> dict[int, str]:
    try:
        data = safe_read.read_capped(path, _MAX, follow=False)
        steps = json.loads(data.decode("utf-8")).get("steps") if data else None
    except (safe_read.BadRecord, OSError, ValueError, AttributeError, RecursionError):
        return {}
    if not isinstance(steps, dict):
        return {}
    return {int(k): v for k, v in steps.items() if isinstance(k, str) and k.isdigit() and len(k) < 10
            and isinstance(v, str)}
