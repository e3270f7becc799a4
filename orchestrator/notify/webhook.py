"""The webhook sender: one daemon thread that POSTs what it is handed and reports how
each POST went. It never touches the ledger (the watcher's thread records the outcomes),
so a slow or dead server delays no watcher cycle.

A webhook URL is a secret (whoever has it can post to the channel): no message, outcome
or error here ever contains it.
"""

from __future__ import annotations

import logging
import queue
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Callable

from orchestrator.contract.safe_read import cut

log = logging.getLogger(__name__)


def url_problem(url: str) -> str | None:
    """Why ``url`` cannot be a webhook, without repeating it (None: it can)."""
    if any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in url):
        return "contains whitespace or a control character"
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError:
        return "is not a URL"
    if parts.scheme not in ("http", "https"):
        return f"must be an http:// or https:// URL (not {parts.scheme + ':' if parts.scheme else 'without a scheme'})"
    if not parts.hostname:
        return "has no host"
    return None


@dataclass(frozen=True)
class Job:
    row_id: int
    url: str
    body: bytes
    timeout_s: float


@dataclass(frozen=True)
class Outcome:
    row_id: int
    status: int | None = None  # the HTTP status, when the server answered
    error: str | None = None  # None: delivered
    permanent: bool = False  # the server refuses it for good (4xx but 429): retrying would not help


def _opener():
    """urllib's opener, less redirects: the payload goes only to the host the user named."""
    import urllib.request

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, req, fp, code, msg, headers, newurl):
            return None  # urllib then raises HTTPError with the 3xx

    return urllib.request.build_opener(NoRedirect())


def post(job: Job) -> Outcome:
    """POST the JSON body once; 2xx is delivered, 4xx other than 429 (and any redirect)
    is permanent, the rest (5xx, 429, no connection, a timeout) is worth retrying."""
    import http.client
    import urllib.error
    import urllib.request

    request = urllib.request.Request(job.url, data=job.body, method="POST",
                                     headers={"Content-Type": "application/json", "User-Agent": "orchestrate"})
    try:
        with _opener().open(request, timeout=job.timeout_s) as response:
            response.read(65536)
            return Outcome(job.row_id, status=response.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        code = exc.code
        if 300 <= code < 400:
            return Outcome(job.row_id, code, f"HTTP {code}: the webhook redirects, and redirects are not followed; "
                           "give the URL it redirects to", permanent=True)
        return Outcome(job.row_id, code, _scrub(f"HTTP {code} {exc.reason}", job.url), permanent=400 <= code < 500 and code != 429)
    except urllib.error.URLError as exc:
        return Outcome(job.row_id, error=_scrub(f"cannot reach the webhook: {exc.reason}", job.url))
    except (OSError, http.client.HTTPException, ValueError) as exc:  # a timeout reading the answer, a broken one
        return Outcome(job.row_id, error=_scrub(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__, job.url))


def _scrub(text: str, url: str) -> str:
    """An error's text for events and the ledger: one line, short, never the URL."""
    for secret in {url, urllib.parse.urlsplit(url).path} - {"", "/"}:
        text = text.replace(secret, "<webhook>")
    return cut(" ".join(text.split()), 300)


class Sender:
    """One background thread, started on first use. ``submit`` hands it a batch (one
    experiment's due notifications, oldest first); after a retryable failure the rest of
    the batch is reported with the same error without being tried (the server is down:
    no reason to wait out a timeout per message). ``results`` is read by the watcher."""

    def __init__(self, send: Callable[[Job], Outcome] = post):
        self.send = send
        self.jobs: queue.Queue[list[Job] | None] = queue.Queue()
        self.results: queue.Queue[Outcome] = queue.Queue()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def submit(self, batch: list[Job]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="orchestrate-notify", daemon=True)
            self._thread.start()
        self.jobs.put(batch)

    def close(self) -> None:
        """No POST starts after this (one under way may still finish, unrecorded)."""
        self._closed.set()
        self.jobs.put(None)

    def _run(self) -> None:
        while (batch := self.jobs.get()) is not None:
            failed: Outcome | None = None
            for job in batch:
                if self._closed.is_set():
                    return  # what is left stays PENDING in the ledger, for the next watcher
                if failed is not None:
                    self.results.put(Outcome(job.row_id, error=failed.error))
                    continue
                try:
                    outcome = self.send(job)
                except Exception as exc:  # never let the thread die: the rows would wait forever
                    log.warning("notification %s: %s", job.row_id, type(exc).__name__)
                    outcome = Outcome(job.row_id, error=f"{type(exc).__name__} in the sender")
                if outcome.error is not None and not outcome.permanent:
                    failed = outcome
                self.results.put(outcome)
