"""Where the snapshots of ``checkpoint.snapshot_every_steps`` live: the node's memory
(``/dev/shm``, or ``ORCHESTRATE_SNAPSHOT_DIR``), one folder per launch used as a task
folder (its ``checkpoints/`` holds the newest snapshot, written and committed as a
checkpoint is). Per launch: a requeue starts a new launch, finds none and resumes from
storage. The folder shared by every user of the node is checked before use: a link or a
folder another user made could hand the ranks state they did not write.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from pathlib import Path
from typing import Mapping

from orchestrator.contract import envvars


def snapshot_base(env: Mapping[str, str] | None = None) -> Path:
    """This user's folder in the node's memory (``env``: the ranks' environment, if not this
    process's: the spec's ``env`` may name another folder)."""
    env = os.environ if env is None else env
    return Path(env.get(envvars.SNAPSHOT_DIR) or "/dev/shm") / f"orchestrate-{os.getuid()}"


def snapshot_root(tdir: str | os.PathLike, launch: str, env: Mapping[str, str] | None = None) -> Path:
    """The snapshots of one launch of the task in ``tdir``."""
    task = hashlib.sha256(os.fsencode(os.path.abspath(tdir))).hexdigest()[:16]
    return snapshot_base(env) / task / launch


def private_snapshot_root(tdir: str | os.PathLike, launch: str) -> tuple[Path | None, str | None]:
    """The launch's snapshot folder, made if need be, with what is wrong if it cannot be
    trusted: (folder, None), or (None, why)."""
    base = snapshot_base()
    try:
        base.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(base)
    except OSError as exc:
        return None, f"{base}: {exc.strerror or exc}"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return None, f"{base} is not a folder (a link?)"
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None, f"{base} is not this user's alone (owner {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})"
    root = snapshot_root(tdir, launch)
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        return None, f"{root}: {exc.strerror or exc}"
    return root, None


def discard_snapshots(tdir: str | os.PathLike, launch: str, env: Mapping[str, str] | None = None) -> None:
    """The launch ended: its snapshots go (they hold the node's memory). Never through a link."""
    root = snapshot_root(tdir, launch, env)
    try:
        if root.is_symlink() or not root.is_dir():
            return
    except OSError:
        return
    shutil.rmtree(root, ignore_errors=True)
    try:
        root.parent.rmdir()  # the task's folder, once no launch of it is left
    except OSError:
        pass
