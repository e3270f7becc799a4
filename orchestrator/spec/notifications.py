"""What a spec's ``notify`` section may say: the triggers, and whether a URL can be a
webhook. Below both the spec that validates them and the notifier (``notify.outbox``),
which checks a URL again where it comes from the watcher's environment."""

from __future__ import annotations

import urllib.parse

TRIGGERS = ("failed", "recovered", "completed", "needs_attention")  # sent unless `on` names others
OPTIONAL_TRIGGERS = ("new_best",)  # sent only where `on` names them


def url_problem(url: str) -> str | None:
    """Why ``url`` cannot be a webhook, without repeating it (None: it can)."""
    if any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in url):
        return "contains whitespace or a control character"
    if not url.isascii():  # http.client sends ASCII only: such a URL would fail on every try
        return "has characters that are not ASCII; give it percent-encoded, as the service shows it"
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError:
        return "is not a URL"
    if parts.scheme not in ("http", "https"):
        return f"must be an http:// or https:// URL (not {parts.scheme + ':' if parts.scheme else 'without a scheme'})"
    if "@" in parts.netloc or parts.username is not None or parts.password is not None:
        # urllib sends no basic auth from the URL, and http.client's errors would quote it
        return "has a user name or password before the host (user:password@); a webhook carries its secret in the path"
    if not parts.hostname:
        return "has no host"
    return None
