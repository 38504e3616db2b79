"""Object storage on loopback for benchmarks: moto's S3 server, and a proxy that counts requests per client.

:func:`s3_environment` sets the fake credentials (and no proxy for loopback)
that every process of a run inherits. :class:`MotoServer` runs moto's S3
server in a child process on 127.0.0.1, so that its request handling does
not share an interpreter lock with whatever measures it.
:class:`CountingProxy` listens on one port per client (a benchmark gives
rank ``r`` the endpoint of port ``r``), relays every byte to the server
unchanged, and frames the HTTP/1.1 traffic as it passes to count, per port,
requests by kind and the bytes of request and response bodies; a small
control server answers ``GET /`` with every port's counters as JSON, so
that ranks can read theirs before and after a timed section. With
``cap_bytes_per_s`` the proxy also stands for storage whose bandwidth the
whole job shares: every byte it relays from the server, on all ports
together, passes one :class:`TokenBucket` first.

Nothing leaves the machine: every socket is bound to 127.0.0.1.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, BinaryIO

FAKE_CREDENTIALS = {"key": "testing", "secret": "testing"}
_RELAY_BYTES = 1 << 20
_CAPPED_SLICE = 64 << 10  # under a cap, responses are released in slices this big: ports take turns


def s3_environment() -> None:
    """Fake AWS credentials and no proxy for loopback, in ``os.environ`` (inherited by spawned ranks).

    No user configuration or credentials may leak in, and requests to
    127.0.0.1 must not go through a proxy configured for the outside world.
    """
    os.environ.update({
        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SECURITY_TOKEN": "testing",
        "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": "/dev/null", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
        "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
    })
    for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        os.environ.pop(k, None)


def storage_options(endpoint: str) -> dict[str, Any]:
    """fsspec/s3fs options for the server (or proxy port) at ``endpoint`` (``http://127.0.0.1:PORT``)."""
    return {**FAKE_CREDENTIALS, "client_kwargs": {"endpoint_url": endpoint}}


# Stock moto reads an object whole for every ranged GET, then slices it: a ranged GET of a 48 MB
# object costs about 45 ms on the 2-core VM whatever its length (measured under load average 10:
# 55 ms for 1 MiB, 82 ms for 4 MiB; 24 ms for 1 MiB of an 8 MB object), where S3 reads only the
# range. With ``ranged_reads`` the server's GET hands moto a stand-in for the object's bytes that
# reads only the slice asked for, so many small ranged GETs cost what they would on S3.
_RANGED_READS = """
import re
from moto.s3 import responses as _r

class _Slice:
    def __init__(self, key):
        self.key = key
    def __len__(self):
        return self.key.size
    def __bool__(self):
        return self.key.size > 0
    def __getitem__(self, s):
        start, stop, _ = s.indices(self.key.size)
        with self.key.lock:
            self.key._value_buffer.seek(start)
            return self.key._value_buffer.read(max(stop - start, 0))

import threading
from moto.s3.models import FakeKey
_lazy = threading.local()
_value = FakeKey.value

def value(self):
    return _Slice(self) if getattr(_lazy, "on", False) else _value.fget(self)

FakeKey.value = property(value, _value.fset)
_get_object = _r.S3Response.get_object
_RANGE = re.compile(r"bytes=\\d+-\\d*$")

def get_object(self):
    _lazy.on = bool(_RANGE.match(self.headers.get("range", "") or ""))
    try:
        return _get_object(self)
    finally:
        _lazy.on = False

_r.S3Response.get_object = get_object
"""

_MOTO_MAIN = """
import logging, sys
from moto.server import ThreadedMotoServer
""" + "{ranged}" + """
logging.getLogger("werkzeug").setLevel(logging.ERROR)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
host, port = server.get_host_and_port()
print(port, flush=True)
sys.stdin.read()  # until the parent closes our stdin (or dies)
server.stop()
"""


class MotoServer:
    """moto's S3 server in a child process on 127.0.0.1 (a free port); a context manager.

    ``ranged_reads``: a ranged GET reads only its range, as on S3 (stock moto reads the whole
    object for each; see ``_RANGED_READS``)."""

    def __init__(self, ranged_reads: bool = False) -> None:
        main = _MOTO_MAIN.replace("{ranged}", _RANGED_READS if ranged_reads else "")
        self.proc = subprocess.Popen([sys.executable, "-c", main], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.strip():
            self.proc.kill()
            raise RuntimeError("moto's S3 server did not start (is moto[server] installed?)")
        self.port = int(line)
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def create_bucket(self, name: str) -> str:
        """Create bucket ``name``; returns ``s3://name``."""
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                     aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket=name)
        return f"s3://{name}"

    def close(self) -> None:
        """Stop the server (closing its stdin ends it; killed if it lingers)."""
        if self.proc.poll() is None:
            try:
                if self.proc.stdin:
                    self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> MotoServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Counters:
    """Requests and body bytes one client port saw.

    ``get`` counts GETs of objects (whole or ranged) and ``bytes_fetched``
    their response bodies; listings (GET of a bucket) are ``list``. ``put``
    and ``post`` (multipart create/complete) count requests, ``bytes_sent``
    the bodies of both (as on the wire: an aws-chunked body includes its
    framing). ``wire_in``/``wire_out`` count every byte from the server /
    from the client, headers included.
    """

    get: int = 0
    ranged_get: int = 0
    bytes_fetched: int = 0
    list: int = 0
    head: int = 0
    put: int = 0
    post: int = 0
    bytes_sent: int = 0
    delete: int = 0
    other: int = 0
    errors: int = 0
    wire_in: int = 0
    wire_out: int = 0

    @property
    def requests(self) -> int:
        """Every request."""
        return self.get + self.list + self.head + self.put + self.post + self.delete + self.other

    def minus(self, before: Counters) -> Counters:
        """What was counted since ``before``."""
        return Counters(**{k: v - getattr(before, k) for k, v in asdict(self).items()})


class TokenBucket:
    """A cap on the total rate of bytes through every caller, however many threads call.

    Each :meth:`take` reserves its bytes at the cap's rate after every
    earlier reservation (a virtual clock, ``free_at``) and sleeps until all
    but ``burst_bytes`` of what is reserved would have gone through: over
    any stretch of time the bytes taken are at most ``burst_bytes`` plus the
    rate times the stretch, and callers are served in arrival order.
    ``clock`` and ``sleep`` are for tests.
    """

    def __init__(self, bytes_per_s: float, burst_bytes: int = 256 << 10, *,
                 clock: Any = time.monotonic, sleep: Any = time.sleep) -> None:
        if bytes_per_s <= 0:
            raise ValueError(f"a cap must be positive, got {bytes_per_s} bytes/s")
        self.bytes_per_s = float(bytes_per_s)
        self.burst_bytes = burst_bytes
        self.clock, self.sleep = clock, sleep
        self.lock = threading.Lock()
        self.free_at = clock()  # when the bytes reserved so far have all gone through

    def take(self, n: int) -> float:
        """Wait until ``n`` more bytes may pass; returns the seconds waited (0 within the burst)."""
        with self.lock:
            now = self.clock()
            self.free_at = max(self.free_at, now) + n / self.bytes_per_s
            wait = self.free_at - now - self.burst_bytes / self.bytes_per_s
        if wait > 0:
            self.sleep(wait)
        return max(wait, 0.0)


def _kind(method: str, target: str) -> str:
    """The counter a request goes to: GET of a bucket (no key, or a listing query) is a listing."""
    if method != "GET":
        return method.lower() if method in ("HEAD", "PUT", "POST", "DELETE") else "other"
    path, _, query = target.partition("?")
    if "://" in path:  # absolute form
        path = "/" + path.split("://", 1)[1].partition("/")[2]
    key = path.lstrip("/").partition("/")[2]
    return "list" if not key or "list-type=" in query or "delimiter=" in query else "get"


def _headers(f: BinaryIO) -> tuple[bytes, str, dict[str, str]] | None:
    """Raw header block, start line and lower-cased headers of the next message; None at EOF."""
    lines = []
    while True:
        line = f.readline(65537)
        if not line:
            return None
        lines.append(line)
        if line in (b"\r\n", b"\n"):
            if len(lines) == 1:  # stray blank line between messages
                lines = []
                continue
            break
    start = lines[0].decode("latin-1").strip()
    hdrs: dict[str, str] = {}
    for raw in lines[1:-1]:
        k, _, v = raw.decode("latin-1").partition(":")
        hdrs[k.strip().lower()] = v.strip()
    return b"".join(lines), start, hdrs


class _Relay:
    """One client connection: two threads relaying (and framing) the two directions."""

    def __init__(self, proxy: CountingProxy, counters: Counters, client: socket.socket) -> None:
        self.proxy, self.c, self.client = proxy, counters, client
        self.upstream = socket.create_connection(("127.0.0.1", proxy.upstream_port))
        for s in (self.client, self.upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.pending: collections.deque[tuple[str, str]] = collections.deque()  # (method, kind) awaiting answers
        self.ready = threading.Condition()
        threading.Thread(target=self._run, args=(self._requests,), daemon=True).start()
        threading.Thread(target=self._run, args=(self._responses,), daemon=True).start()

    def _run(self, fn: Any) -> None:
        try:
            fn()
        except (OSError, ValueError):
            pass
        finally:  # either side gone: close both, which ends the other thread too
            for s in (self.client, self.upstream):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            with self.ready:
                self.pending.append(("", "closed"))
                self.ready.notify_all()

    def _body(self, src: BinaryIO, dst: socket.socket, hdrs: dict[str, str], wire: str) -> int:
        """Relay one message body; returns its size (chunked: the chunk data, framing excluded)."""
        n = 0
        if "chunked" in hdrs.get("transfer-encoding", "").lower():
            while True:
                size_line = src.readline(65537)
                self._send(dst, size_line, wire)
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:  # trailers up to a blank line
                    while True:
                        line = src.readline(65537)
                        self._send(dst, line, wire)
                        if line in (b"\r\n", b"\n", b""):
                            return n
                n += self._copy(src, dst, size, wire)
                self._send(dst, src.readline(65537), wire)  # CRLF after the data
        left = int(hdrs.get("content-length", "0") or 0)
        return self._copy(src, dst, left, wire)

    def _copy(self, src: BinaryIO, dst: socket.socket, left: int, wire: str) -> int:
        done = 0
        while done < left:
            data = src.read1(min(left - done, _RELAY_BYTES))
            if not data:
                raise OSError("connection closed mid-body")
            self._send(dst, data, wire)
            done += len(data)
        return done

    def _send(self, dst: socket.socket, data: bytes, wire: str) -> None:
        cap = self.proxy.cap if wire == "wire_in" else None
        if cap is None:
            dst.sendall(data)
        else:  # the server's answers share the cap; requests (and uploads) do not
            view = memoryview(data)
            for i in range(0, len(view), _CAPPED_SLICE):
                piece = view[i:i + _CAPPED_SLICE]
                cap.take(len(piece))
                dst.sendall(piece)
        with self.proxy.lock:
            setattr(self.c, wire, getattr(self.c, wire) + len(data))

    def _requests(self) -> None:
        src = self.client.makefile("rb", buffering=_RELAY_BYTES)
        while True:
            msg = _headers(src)
            if msg is None:
                return
            raw, start, hdrs = msg
            method, target = (start.split(" ") + ["", ""])[:2]
            kind = _kind(method, target)
            with self.ready:
                self.pending.append((method, kind))
                self.ready.notify_all()
            with self.proxy.lock:
                setattr(self.c, kind, getattr(self.c, kind) + 1)
                if kind == "get" and "range" in hdrs:
                    self.c.ranged_get += 1
            self._send(self.upstream, raw, "wire_out")
            n = self._body(src, self.upstream, hdrs, "wire_out")
            if kind in ("put", "post"):
                with self.proxy.lock:
                    self.c.bytes_sent += n

    def _responses(self) -> None:
        src = self.upstream.makefile("rb", buffering=_RELAY_BYTES)
        while True:
            msg = _headers(src)
            if msg is None:
                return
            raw, start, hdrs = msg
            status = int(start.split(" ")[1])
            self._send(self.client, raw, "wire_in")
            if 100 <= status < 200:  # interim (100 Continue): the final answer follows
                continue
            with self.ready:
                while not self.pending:
                    self.ready.wait()
                method, kind = self.pending.popleft()
            if kind == "closed":
                return
            if status >= 400:
                with self.proxy.lock:
                    self.c.errors += 1
            if method == "HEAD" or status in (204, 304):
                continue
            if "content-length" not in hdrs and "chunked" not in hdrs.get("transfer-encoding", "").lower():
                while data := src.read1(_RELAY_BYTES):  # body until the server closes
                    self._send(self.client, data, "wire_in")
                return
            n = self._body(src, self.client, hdrs, "wire_in")
            if kind == "get" and status < 300:
                with self.proxy.lock:
                    self.c.bytes_fetched += n


class CountingProxy:
    """``clients`` listening ports on 127.0.0.1 relaying to ``upstream_port``, counting per port.

    ``endpoints[i]`` is the URL client ``i`` should use; ``control_url``
    answers ``GET`` with ``{"0": {counters}, "1": ...}``. ``cap_bytes_per_s``:
    the most bytes per second the server's answers (headers and bodies) may
    reach the clients at, all ports together (None: as fast as they come).
    A context manager.
    """

    def __init__(self, upstream_port: int, clients: int,
                 cap_bytes_per_s: float | None = None) -> None:
        self.upstream_port = upstream_port
        self.cap = TokenBucket(cap_bytes_per_s) if cap_bytes_per_s else None
        self.lock = threading.Lock()
        self.counters = [Counters() for _ in range(clients)]
        self.listeners: list[socket.socket] = []
        for i in range(clients):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen(64)
            self.listeners.append(s)
            threading.Thread(target=self._accept, args=(s, self.counters[i]), daemon=True).start()
        self.endpoints = [f"http://127.0.0.1:{s.getsockname()[1]}" for s in self.listeners]
        proxy = self

        class Control(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = json.dumps(proxy.snapshot_all()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.control = ThreadingHTTPServer(("127.0.0.1", 0), Control)
        self.control.daemon_threads = True
        threading.Thread(target=self.control.serve_forever, daemon=True).start()
        self.control_url = f"http://127.0.0.1:{self.control.server_address[1]}/"

    def _accept(self, listener: socket.socket, counters: Counters) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                _Relay(self, counters, client)
            except OSError:
                client.close()

    def snapshot_all(self) -> dict[str, dict[str, int]]:
        """Every port's counters, by client number."""
        with self.lock:
            return {str(i): asdict(c) for i, c in enumerate(self.counters)}

    def close(self) -> None:
        """Stop listening (open relays end with their connections)."""
        self.control.shutdown()
        self.control.server_close()
        for s in self.listeners:
            s.close()

    def __enter__(self) -> CountingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_counters(control_url: str, client: int) -> Counters:
    """Client ``client``'s counters so far, from the proxy's control server (not itself counted)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via a proxy
    with opener.open(control_url, timeout=30) as r:
        return Counters(**json.loads(r.read())[str(client)])
