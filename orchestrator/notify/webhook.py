"""The webhook sender: one daemon thread that POSTs what it is handed and reports how
each POST went. It never touches the ledger (the watcher's thread records the outcomes),
so a slow or dead server delays no watcher cycle.

A webhook URL is a secret (whoever has it can post to the channel): no message, outcome
or error here ever contains it.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Callable

from orchestrator.contract.safe_read import cut

log = logging.getLogger(__name__)


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
    permanent: bool = False  # the server refuses it for good (4xx but 408, 425, 429): retrying would not help
    retry_after: float | None = None  # seconds the server asked us to wait (Retry-After), if it did


RETRYABLE_4XX = (408, 425, 429)  # request timeout, too early, too many requests: worth another try
BODY_BYTES = 65536  # of an answer's body read at most (it is not used: reading it lets the server finish)


class _Deadline:
    """A wall-clock limit on one POST. urllib's timeout bounds each socket operation, not
    the whole: a server that answers a byte at a time could hold the thread for ever (and
    the notify lease could run out meanwhile). At the deadline every socket of the POST is
    shut down, which wakes a blocked read at once. Not bounded: the name lookup before
    the connection (getaddrinfo cannot be interrupted), nor a connect per address that
    the name has (each within the timeout)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.at = time.monotonic() + seconds
        self.expired = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def left(self) -> float:
        return self.at - time.monotonic()

    def watch(self, sock: socket.socket) -> socket.socket:
        with self._lock:
            self._sockets.append(sock)
            expired = self.expired
        if expired:
            self._cut(sock)
        return sock

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            sockets = list(self._sockets)
        for sock in sockets:
            self._cut(sock)

    @staticmethod
    def _cut(sock: socket.socket) -> None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # closed already

    def cancel(self) -> None:
        self._timer.cancel()


def _opener(deadline: _Deadline):
    """urllib's opener (proxies from the environment included), less redirects: the payload
    goes only to the host the user named; its connections' sockets watched by ``deadline``."""
    import http.client
    import urllib.request

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, req, fp, code, msg, headers, newurl):
            return None  # urllib then raises HTTPError with the 3xx

    def watched(base):
        class Connection(base):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self._create_connection = self._watched_connection

            def _watched_connection(self, address, timeout=None, *rest):
                left = max(0.01, min(timeout or deadline.seconds, deadline.left()))
                return deadline.watch(socket.create_connection(address, left, *rest))

        return Connection

    class Http(urllib.request.HTTPHandler):
        def http_open(self, req):
            return self.do_open(watched(http.client.HTTPConnection), req)

    class Https(urllib.request.HTTPSHandler):
        def https_open(self, req):
            extra = {"check_hostname": self._check_hostname} if hasattr(self, "_check_hostname") else {}
            return self.do_open(watched(http.client.HTTPSConnection), req, context=self._context, **extra)

    return urllib.request.build_opener(NoRedirect(), Http(), Https())


def _retry_after(headers) -> float | None:
    """A Retry-After header in seconds (its HTTP-date form is not read: the backoff stands)."""
    value = (headers.get("Retry-After") if headers is not None else None) or ""
    value = value.strip()
    return float(value) if value.isdigit() and len(value) < 10 else None


def post(job: Job) -> Outcome:
    """POST the JSON body once, within ``job.timeout_s`` in all (``_Deadline``); 2xx is
    delivered, 4xx other than 408, 425 and 429 (and any redirect) is permanent, the rest
    (5xx, those three, no connection, a timeout) is worth retrying."""
    import http.client
    import urllib.error
    import urllib.request

    deadline = _Deadline(job.timeout_s)
    try:
        request = urllib.request.Request(job.url, data=job.body, method="POST",
                                         headers={"Content-Type": "application/json", "User-Agent": "orchestrate"})
        with _opener(deadline).open(request, timeout=job.timeout_s) as response:
            status, read = response.status, 0
            try:  # the answer's body, while time is left: the status has said how it went
                while read < BODY_BYTES and deadline.left() > 0 and (chunk := response.read(4096)):
                    read += len(chunk)
            except (OSError, http.client.HTTPException):
                pass
            return Outcome(job.row_id, status=status)
    except urllib.error.HTTPError as exc:
        exc.close()
        code = exc.code
        if 300 <= code < 400:
            return Outcome(job.row_id, code, f"HTTP {code}: the webhook redirects, and redirects are not followed; "
                           "give the URL it redirects to", permanent=True)
        return Outcome(job.row_id, code, _scrub(f"HTTP {code} {exc.reason}", job.url),
                       permanent=400 <= code < 500 and code not in RETRYABLE_4XX, retry_after=_retry_after(exc.headers))
    except Exception as exc:  # no connection, a timeout, a broken answer, a URL http.client refuses
        if deadline.expired:
            return Outcome(job.row_id, error=f"timed out: no answer within {job.timeout_s:g} s")
        if isinstance(exc, (ValueError, http.client.InvalidURL)):
            # their text quotes the URL (InvalidURL: "nonnumeric port: 'secret@host'"): never shown
            return Outcome(job.row_id, error=f"the webhook URL cannot be used ({type(exc).__name__})")
        if isinstance(exc, urllib.error.URLError):
            reason = str(exc.reason) or type(exc.reason).__name__
            return Outcome(job.row_id, error=_scrub(f"cannot reach the webhook: {reason}", job.url))
        if isinstance(exc, (OSError, http.client.HTTPException)):
            return Outcome(job.row_id, error=_scrub(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__, job.url))
        raise
    finally:
        deadline.cancel()


def _scrub(text: str, url: str) -> str:
    """An error's text for events and the ledger: one line, short, never the URL nor a
    part of it that could be secret (the host with any user and port, the path, the query)."""
    try:
        parts = urllib.parse.urlsplit(url)
        secrets = {url, parts.netloc, parts.path, parts.query}
    except ValueError:
        secrets = {url}
    for secret in sorted(secrets - {"", "/"}, key=len, reverse=True):
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

    def died(self) -> bool:
        """Whether the thread ended without being closed (what it was handed is never reported)."""
        return self._thread is not None and not self._thread.is_alive() and not self._closed.is_set()

    def restart(self) -> None:
        """After ``died``: forget the batches it never took (their rows are PENDING in the
        ledger and handed over again); the next ``submit`` starts a new thread."""
        while True:
            try:
                self.jobs.get_nowait()
            except queue.Empty:
                break
        self._thread = None

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
                    self.results.put(Outcome(job.row_id, error=failed.error, retry_after=failed.retry_after))
                    continue
                try:
                    outcome = self.send(job)
                except Exception as exc:  # never let the thread die: the rows would wait forever
                    log.warning("notification %s: %s", job.row_id, type(exc).__name__)
                    outcome = Outcome(job.row_id, error=f"{type(exc).__name__} in the sender")
                if outcome.error is not None and not outcome.permanent:
                    failed = outcome
                self.results.put(outcome)
