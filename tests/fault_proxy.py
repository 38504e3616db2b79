"""A fault-injecting HTTP proxy in front of the test S3 server (moto), for object-storage tests.

Object-storage tests (issue #16) need two things a bare S3 server cannot give:
failures on demand (connection resets, 500/503 answers, slow or truncated
responses, permanent AccessDenied) and a server-side count of what the client
actually sent and fetched (requests, Range headers, bytes). ``FaultProxy``
sits on 127.0.0.1 between s3fs and moto, forwards every request unchanged
(the Host header too: SigV4 signs it) and records each one.

Use it through the ``s3_proxy`` fixture::

    import fault_proxy
    import s3_server

    s3_bucket = s3_server.s3_bucket   # s3_proxy builds on it: both must be visible
    s3_proxy = fault_proxy.s3_proxy   # in the test module, as fixtures

    def test_x(s3_proxy):
        url, options, proxy = s3_proxy          # options point s3fs at the proxy
        fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
        proxy.inject("503", count=2, match=lambda m, p, h: m == "GET")
        ...                                     # the code under test reads via fs
        assert proxy.count(method="GET", fault="503") == 2
        assert proxy.bytes_sent("GET") == expected_bytes

Faults are bounded (each ``inject`` fires at most ``count`` times, then
requests pass through) except ``deny``, which lasts until ``clear()``.
``reset_records()`` starts a fresh count, e.g. after the test wrote its
fixture data. Without moto[server]/s3fs the fixture is skipped (the
``s3_bucket`` reason).
"""

from __future__ import annotations

import copy
import http.client
import select
import socket
import struct
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator, Mapping
from urllib.parse import parse_qs, urlsplit

import pytest

import s3_server

s3_bucket = s3_server.s3_bucket  # the session fixture s3_proxy builds on

Match = Callable[[str, str, Mapping[str, str]], bool]
"""``match(method, path_with_query, headers) -> bool``: which requests a fault applies to."""

FAULT_KINDS = ("reset", "500", "503", "slow", "trickle", "reset_mid", "stall")

# Connection-level headers (RFC 9110 7.6.1) are not forwarded; Expect is answered
# by this proxy (BaseHTTPRequestHandler sends the 100 Continue itself).
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "expect",
}

_ERRORS = {
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
    403: ("AccessDenied", "Access Denied"),
}

TRICKLE_PIECE = 64 << 10
"""The body of a ``trickle`` answer is written in pieces of this many bytes."""

_ANY: Any = object()  # "no filter" for count(), where None means "no fault"


@dataclass(frozen=True)
class RequestRecord:
    """One request as the proxy saw it (the server-side view tests assert on)."""

    method: str
    path: str  # as sent, percent-encoded, without the query
    query: str  # raw query string ("" when none)
    range: str | None  # the Range request header
    status: int | None  # status returned to the client; None when the connection was reset before any
    request_bytes: int  # request body bytes received (after de-chunking)
    response_bytes: int  # response body bytes actually sent to the client
    fault: str | None  # the fault applied ("reset", "503", "deny", ...) or None
    elapsed_s: float  # from request line read to response sent (informational)
    started_s: float = 0.0  # time.monotonic() when its body had been read (for overlaps)

    @property
    def params(self) -> dict[str, list[str]]:
        """The query parsed (``{"partNumber": ["1"], "uploadId": [...]}``); flag parameters map to ``[""]``."""
        return parse_qs(self.query, keep_blank_values=True)


@dataclass
class _Rule:
    kind: str
    remaining: int | None  # None: permanent (deny)
    match: Match | None
    delay_s: float
    status: int


def _error_body(status: int, path: str) -> bytes:
    code, message = _ERRORS.get(status, ("InternalError", "Injected error"))
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message>"
        f"<Resource>{path}</Resource><RequestId>{uuid.uuid4().hex[:16].upper()}</RequestId></Error>"
    ).encode()


class FaultProxy:
    """HTTP/1.1 proxy on 127.0.0.1 (free port) forwarding to ``upstream`` with bounded fault injection.

    A context manager: the server thread starts on enter and stops on exit.
    ``url`` is the proxy's base URL (use it as the S3 endpoint_url).
    """

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"FaultProxy forwards to an http:// base URL, got {upstream!r}")
        self.upstream_host = parts.hostname
        self.upstream_port = parts.port or 80
        self._lock = threading.Lock()
        self._rules: list[_Rule] = []
        self._records: list[RequestRecord] = []
        # Requests being answered: a client can get its last byte before the proxy
        # records the request, so reading the records waits for them (briefly).
        self._busy = 0
        self._idle = threading.Condition(self._lock)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()  # releases stalled requests

    # ------------------------------------------------------------ lifecycle

    def start(self) -> FaultProxy:
        """Bind 127.0.0.1:0 and serve in a daemon thread."""
        self._stopping.clear()
        handler = type("_BoundHandler", (_Handler,), {"proxy": self})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, args=(0.05,), name="fault-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving (open keep-alive connections die with their daemon threads)."""
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` of the running proxy."""
        if self._server is None:
            raise RuntimeError("FaultProxy is not running")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    # ------------------------------------------------------------ faults

    def inject(self, kind: str, count: int = 1, *, match: Match | None = None, delay_s: float | None = None) -> None:
        """Apply fault ``kind`` to the next ``count`` requests chosen by ``match`` (None: any request).

        Kinds: ``reset`` (read the request, then RST the connection), ``500``
        (InternalError), ``503`` (SlowDown), ``slow`` (forward, wait
        ``delay_s`` before answering; 0.5 s by default), ``trickle`` (forward,
        send status, headers and the body's first piece of ``TRICKLE_PIECE``
        bytes at once, then the other pieces spread evenly over ``delay_s``: a
        slow transfer rather than a late one; the record counts the pieces
        written before the client went away), ``reset_mid``
        (forward, send status, headers and half the body, then RST),
        ``stall`` (read the request, forward nothing and answer nothing:
        hold the connection until the client closes it, the proxy stops or
        ``delay_s`` passes; no limit by default). Rules are tried in the
        order they were injected; one request gets at most one fault.
        """
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; expected one of {FAULT_KINDS}")
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        with self._lock:
            default = float("inf") if kind == "stall" else 0.5
            self._rules.append(_Rule(kind, count, match, default if delay_s is None else delay_s, 0))

    def deny(self, match: Match | None, status: int = 403) -> None:
        """Answer every request chosen by ``match`` with an AccessDenied-style error until ``clear()``."""
        with self._lock:
            self._rules.insert(0, _Rule("deny", None, match, 0.0, status))

    def clear(self) -> None:
        """Drop every pending fault and deny rule."""
        with self._lock:
            self._rules.clear()

    def pending(self) -> int:
        """How many bounded faults have not fired yet."""
        with self._lock:
            return sum(r.remaining or 0 for r in self._rules)

    def _take_rule(self, method: str, target: str, headers: Mapping[str, str]) -> _Rule | None:
        with self._lock:
            for rule in self._rules:
                if rule.match is not None and not rule.match(method, target, headers):
                    continue
                if rule.remaining is not None:
                    rule.remaining -= 1
                    if rule.remaining == 0:
                        self._rules.remove(rule)
                return rule
        return None

    # ------------------------------------------------------------ accounting

    def _begin(self) -> None:
        with self._lock:
            self._busy += 1

    def _record(self, rec: RequestRecord | None) -> None:
        with self._lock:
            if rec is not None:
                self._records.append(rec)
            self._busy -= 1
            self._idle.notify_all()

    @property
    def records(self) -> list[RequestRecord]:
        """A copy of every request recorded so far, in completion order.

        Waits (up to 5 s) for requests still being answered, so a request
        whose answer the client already has is always in the list.
        """
        with self._lock:
            self._idle.wait_for(lambda: self._busy == 0, timeout=5.0)
            return list(self._records)

    def reset_records(self) -> None:
        """Forget the requests recorded so far."""
        with self._lock:
            self._records.clear()

    def select(
        self, method: str | None = None, *, fault: str | None = _ANY, status: int | None = _ANY
    ) -> list[RequestRecord]:
        """Records filtered by method, fault (None: unfaulted only) and status; unset filters match all."""
        return [
            r
            for r in self.records
            if (method is None or r.method == method)
            and (fault is _ANY or r.fault == fault)
            and (status is _ANY or r.status == status)
        ]

    def count(self, method: str | None = None, *, fault: str | None = _ANY, status: int | None = _ANY) -> int:
        """How many requests match (see ``select``)."""
        return len(self.select(method, fault=fault, status=status))

    def max_in_flight(self, method: str | None = None, *, fault: str | None = _ANY) -> int:
        """The most matching requests the proxy was answering at the same moment."""
        events = sorted(e for r in self.select(method, fault=fault)
                        for e in ((r.started_s, 1), (r.started_s + r.elapsed_s, -1)))
        most = cur = 0
        for _, d in events:
            cur += d
            most = max(most, cur)
        return most

    def bytes_sent(self, method: str | None = "GET") -> int:
        """Response body bytes the proxy sent to the client for ``method`` (None: all methods)."""
        return sum(r.response_bytes for r in self.select(method))

    def bytes_received(self, method: str | None = "PUT") -> int:
        """Request body bytes the client sent for ``method`` (None: all methods)."""
        return sum(r.request_bytes for r in self.select(method))


class _Handler(BaseHTTPRequestHandler):
    """One client connection (one thread): forwards each request over its own upstream connection."""

    protocol_version = "HTTP/1.1"  # keep-alive towards the client
    proxy: FaultProxy  # set on the per-proxy subclass
    _upstream: http.client.HTTPConnection | None = None
    _body_sent = 0  # body bytes of the current answer written so far (a trickled one, piece by piece)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per request would drown test output

    def do_GET(self) -> None:
        """Every method goes through the same forwarding path."""
        self._proxy()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    # ------------------------------------------------------------ request side

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return self._read_chunked()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _read_chunked(self) -> bytes:
        out = bytearray()
        while True:
            line = self.rfile.readline(65537)
            size = int(line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                    pass  # trailer fields: dropped (the body is forwarded with Content-Length)
                return bytes(out)
            out += self.rfile.read(size)
            self.rfile.readline(3)  # the CRLF closing the chunk

    # ------------------------------------------------------------ upstream

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        # A kept-alive upstream connection may have been closed by the server
        # between requests; that shows up before any response, so one retry on a
        # fresh connection is safe and invisible to the client.
        for attempt in (0, 1):
            reused = self._upstream is not None
            if self._upstream is None:
                self._upstream = http.client.HTTPConnection(
                    self.proxy.upstream_host, self.proxy.upstream_port, timeout=120
                )
            conn = self._upstream
            try:
                conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in self.headers.items():
                    if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                        conn.putheader(name, value)
                if body or self.command in ("PUT", "POST"):
                    conn.putheader("Content-Length", str(len(body)))
                conn.endheaders(body or None)
                resp = conn.getresponse()
                data = resp.read()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                conn.close()
                self._upstream = None
                if reused and attempt == 0:
                    continue
                raise
            if resp.will_close:
                conn.close()
                self._upstream = None
            return resp.status, resp.reason, resp.getheaders(), data
        raise AssertionError("unreachable")

    # ------------------------------------------------------------ client side

    def _send(self, status: int, reason: str, headers: list[tuple[str, str]], body: bytes, *, cut: bool,
              spread_s: float = 0.0) -> int:
        """Send a response; with ``cut`` only half the body, and return the body bytes sent. With
        ``spread_s`` the body goes in pieces of TRICKLE_PIECE, the first at once and the last
        ``spread_s`` later, each counted in
        ``self._body_sent`` once written (what the client got before it went away)."""
        self.send_response_only(status, reason)
        for name, value in headers:
            if name.lower() in _HOP_BY_HOP or name.lower() == "content-length":
                continue
            self.send_header(name, value)
        if self.command == "HEAD":
            # No body; the Content-Length describes the object (s3fs's info() reads it).
            length = next((v for n, v in headers if n.lower() == "content-length"), None)
            if length is not None:
                self.send_header("Content-Length", length)
            body = b""
        else:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.flush()
        sent = body[: len(body) // 2] if cut else body
        pieces = [sent[i:i + TRICKLE_PIECE] for i in range(0, len(sent), TRICKLE_PIECE)] if spread_s else [sent]
        for k, piece in enumerate(pieces):
            if k:
                time.sleep(spread_s / (len(pieces) - 1))
            if piece:
                self.wfile.write(piece)
                self.wfile.flush()
                self._body_sent += len(piece)
        return len(sent)

    def _send_error(self, status: int, path: str) -> int:
        body = _error_body(status, path)
        headers = [
            ("Content-Type", "application/xml"),
            ("x-amz-request-id", uuid.uuid4().hex[:16].upper()),
        ]
        if status == 503:
            headers.append(("Retry-After", "0"))
        return self._send(status, http.client.responses.get(status, ""), headers, body, cut=False)

    def _rst(self) -> None:
        """Close the client connection with a TCP RST (SO_LINGER on, timeout 0)."""
        self.close_connection = True
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        # close() here marks the socket closed; its descriptor goes when finish()
        # closes rfile/wfile, before socketserver's shutdown(SHUT_WR) could send a FIN.
        self.connection.close()

    def _stall(self, limit_s: float) -> None:
        """Answer nothing until the client closes the connection, the proxy stops or ``limit_s``
        passes; then close it."""
        end = time.monotonic() + limit_s
        self.close_connection = True
        while not self.proxy._stopping.is_set() and time.monotonic() < end:
            ready, _, _ = select.select([self.connection], [], [], 0.05)
            if ready and not self.connection.recv(1, socket.MSG_PEEK):
                return  # the client gave up on this request

    def _proxy(self) -> None:
        self.proxy._begin()  # balanced by _record in the finally below (or _record(None))
        t0 = time.monotonic()
        try:
            body = self._read_body()
        except BaseException:
            self.proxy._record(None)
            raise
        target = self.path
        path, _, query = target.partition("?")
        rule = self.proxy._take_rule(self.command, target, self.headers)
        fault = rule.kind if rule else None
        status: int | None = None
        sent = 0
        self._body_sent = 0
        try:
            if rule is None or rule.kind == "slow":
                status, reason, headers, data = self._forward(body)
                if rule is not None:
                    time.sleep(rule.delay_s)
                sent = self._send(status, reason, headers, data, cut=False)
            elif rule.kind == "trickle":
                status, reason, headers, data = self._forward(body)
                sent = self._send(status, reason, headers, data, cut=False, spread_s=rule.delay_s)
            elif rule.kind == "reset":
                self._rst()
            elif rule.kind == "stall":
                self._stall(rule.delay_s)
            elif rule.kind in ("500", "503"):
                status = int(rule.kind)
                sent = self._send_error(status, path)
            elif rule.kind == "deny":
                status = rule.status
                sent = self._send_error(status, path)
            elif rule.kind == "reset_mid":
                status, reason, headers, data = self._forward(body)
                sent = self._send(status, reason, headers, data, cut=True)
                time.sleep(0.05)  # let the half body reach the client: an RST discards unsent data
                self._rst()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away; still record what was asked
            sent = self._body_sent  # and the pieces of a trickled body it was sent
        finally:
            self.proxy._record(
                RequestRecord(
                    method=self.command,
                    path=path,
                    query=query,
                    range=self.headers.get("Range"),
                    status=status,
                    request_bytes=len(body),
                    response_bytes=sent,
                    fault=fault,
                    elapsed_s=time.monotonic() - t0,
                    started_s=t0,
                )
            )

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            if self._upstream is not None:
                self._upstream.close()
                self._upstream = None


def storage_options_via(proxy: FaultProxy, storage_options: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of s3fs ``storage_options`` whose endpoint_url is the proxy's."""
    options = copy.deepcopy(dict(storage_options))
    options.setdefault("client_kwargs", {})["endpoint_url"] = proxy.url
    return options


@pytest.fixture
def s3_proxy(s3_bucket: tuple[str, dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any], FaultProxy]]:
    """A fresh FaultProxy in front of the session's moto server: yields ``(url, options_via_proxy, proxy)``."""
    url, options = s3_bucket
    with FaultProxy(options["client_kwargs"]["endpoint_url"]) as proxy:
        yield url, storage_options_via(proxy, options), proxy
