"""SLURM host lists, which both sides parse (the login side from sacct, agents from SLURM_JOB_NODELIST)."""

from __future__ import annotations

import re


def expand_hostlist(spec: str) -> list[str]:
    """Expand a SLURM host list: ``n[1-3,5],gpu[01-02]`` -> n1 n2 n3 n5 gpu01 gpu02.

    Zero padding is kept (``[01-02]``); several bracket groups in one name are
    expanded as a product, as SLURM does.
    """
    out: list[str] = []
    for item in _split_top_level(spec.strip()):
        if item:
            out.extend(_expand_one(item))
    return out


def _split_top_level(spec: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in spec:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def _expand_one(item: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", item)
    if not m:
        return [item]
    head, tail = item[: m.start()], item[m.end() :]
    values: list[str] = []
    for rng in m.group(1).split(","):
        if "-" in rng:
            lo, hi = rng.split("-", 1)
            width = len(lo)
            values.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
        elif rng:
            values.append(rng)
    return [h for v in values for h in _expand_one(head + v + tail)]
