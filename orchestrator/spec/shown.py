"""How a spec's paths and values appear in a message: dotted paths, values cut short, and
secret fields (a webhook URL) never repeated."""

from __future__ import annotations

from typing import Any

Path_ = tuple[Any, ...]


# Fields whose values no message repeats: whoever reads them can use them (a webhook URL
# posts to its channel; `webhook_env` is a name, unless the URL was pasted there).
SECRET_PATHS = frozenset({("notify", "webhook"), ("notify", "webhook_env")})


def is_secret(path: Path_) -> bool:
    """Whether ``path`` is a secret field, or a mapping holding one (its value has it)."""
    path = tuple(path)
    return bool(path) and any(path[: len(p)] == p or p[: len(path)] == path for p in SECRET_PATHS)


def shown_item(item: str) -> str:
    """A `--set` item for a message: as ``shorten`` shows it, but the value of a secret
    field hidden (`notify.webhook=<hidden>`)."""
    key, sep, _ = item.partition("=")
    path = tuple(part.strip() for part in key.strip().split("."))
    if sep and is_secret(path):
        return shorten(f"{dotted(path)}=<hidden>")
    for p in SECRET_PATHS:
        if item.strip().startswith(dotted(p)):  # not of the form key=value: the whole item may be the URL
            return shorten(f"{dotted(p)}...<hidden>")
    return shorten(item)


def shorten(value: Any, limit: int = 80) -> str:
    """``value`` for a message: its repr (escaped, quoted), cut at ``limit`` characters."""
    try:
        shown = repr(value)
    except ValueError:  # an int past Python's 4300 digits
        shown = f"<a {type(value).__name__}>"
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def dotted(path: Path_) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out
