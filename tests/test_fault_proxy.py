"""The fault-injection proxy (tests/fault_proxy.py) against the real moto S3 server, driven through s3fs.

Checks that requests pass through unchanged (bytes, Range headers, multipart
parts), that the accounting matches what was transferred, and that each
fault kind reaches the client the way a real S3 failure would: the client
retries 500/503/reset by itself, AccessDenied fails until cleared.
"""

from __future__ import annotations

import http.client
import os
import uuid
from typing import Any

import pytest

import fault_proxy
import s3_server
from fault_proxy import FaultProxy

s3_bucket = s3_server.s3_bucket  # the session fixture s3_proxy depends on
s3_proxy = fault_proxy.s3_proxy  # the fixture under test, made visible to this module


def _fs(options: dict[str, Any]) -> Any:
    import s3fs

    return s3fs.S3FileSystem(**options, skip_instance_cache=True)


def _object(url: str, fs: Any, size: int) -> tuple[str, bytes]:
    """A fresh object of ``size`` random bytes; returns its path (bucket/key) and data."""
    path = f"{url.removeprefix('s3://')}/proxy-{uuid.uuid4().hex[:10]}/obj.bin"
    data = os.urandom(size)
    fs.pipe_file(path, data)
    return path, data


def _get_of(key: str):
    """A match for GETs of one object."""
    return lambda method, target, headers: method == "GET" and target.split("?")[0].endswith(key)


def test_roundtrip_counts_bytes(s3_proxy: tuple[str, dict[str, Any], FaultProxy]) -> None:
    url, options, proxy = s3_proxy
    fs = _fs(options)
    path, data = _object(url, fs, 48 * 1024)

    puts = proxy.select("PUT")
    assert len(puts) == 1 and puts[0].status == 200 and puts[0].fault is None
    assert puts[0].path.endswith(path.split("/", 1)[1])
    assert proxy.bytes_received("PUT") == len(data)  # the body exactly as sent, nothing re-framed

    proxy.reset_records()
    assert fs.cat_file(path) == data
    gets = proxy.select("GET")
    assert len(gets) == 1 and gets[0].status == 200
    assert proxy.bytes_sent("GET") == len(data)
    assert fs.info(path)["size"] == len(data)  # HEAD keeps the object's Content-Length
    # (a whole-object cat_file also sends a HEAD first in this s3fs; HEADs carry no body)
    assert proxy.count("HEAD", status=200) >= 1 and proxy.bytes_sent("HEAD") == 0


def test_ranged_reads_record_range_and_bytes(s3_proxy: tuple[str, dict[str, Any], FaultProxy]) -> None:
    url, options, proxy = s3_proxy
    fs = _fs(options)
    path, data = _object(url, fs, 16 * 1024)
    proxy.reset_records()

    assert fs.cat_file(path, start=100, end=1100) == data[100:1100]
    assert fs.cat_file(path, start=8192, end=8200) == data[8192:8200]
    gets = proxy.select("GET")
    assert [g.range for g in gets] == ["bytes=100-1099", "bytes=8192-8199"]
    assert [g.status for g in gets] == [206, 206]
    assert [g.response_bytes for g in gets] == [1000, 8]
    assert proxy.bytes_sent() == 1008


@pytest.mark.parametrize(("kind", "times"), [("503", 2), ("500", 1), ("reset", 1), ("reset_mid", 1)])
def test_transient_faults_are_retried(
    s3_proxy: tuple[str, dict[str, Any], FaultProxy], kind: str, times: int
) -> None:
    url, options, proxy = s3_proxy
    fs = _fs(options)
    path, data = _object(url, fs, 32 * 1024)
    proxy.reset_records()

    proxy.inject(kind, times, match=_get_of(path))
    assert fs.cat_file(path, start=1000, end=21000) == data[1000:21000]
    assert proxy.pending() == 0
    gets = proxy.select("GET")
    assert [g.fault for g in gets] == [kind] * times + [None]
    assert all(g.range == "bytes=1000-20999" for g in gets)
    assert gets[-1].status == 206 and gets[-1].response_bytes == 20000
    if kind in ("500", "503"):
        assert proxy.count("GET", fault=kind, status=int(kind)) == times
    elif kind == "reset":
        assert gets[0].status is None and gets[0].response_bytes == 0
    else:  # reset_mid: status and half the body went out before the RST
        assert gets[0].status == 206 and gets[0].response_bytes == 10000


def test_deny_until_clear(s3_proxy: tuple[str, dict[str, Any], FaultProxy]) -> None:
    url, options, proxy = s3_proxy
    fs = _fs(options)
    path, data = _object(url, fs, 4096)
    proxy.reset_records()

    proxy.deny(lambda method, target, headers: method == "GET")
    with pytest.raises(PermissionError):
        fs.cat_file(path)
    with pytest.raises(PermissionError):
        fs.cat_file(path)
    denied = proxy.select("GET", fault="deny")
    assert len(denied) == 2 and all(r.status == 403 for r in denied)  # not retried: a permanent error

    proxy.clear()
    assert fs.cat_file(path) == data
    assert proxy.count("GET", fault=None, status=200) == 1


def test_slow_request_still_succeeds(s3_proxy: tuple[str, dict[str, Any], FaultProxy]) -> None:
    url, options, proxy = s3_proxy
    fs = _fs(options)
    path, data = _object(url, fs, 4096)
    proxy.reset_records()

    proxy.inject("slow", match=lambda method, target, headers: method == "GET", delay_s=0.2)
    assert fs.cat_file(path) == data
    gets = proxy.select("GET")
    assert [g.fault for g in gets] == ["slow"] and gets[0].status == 200 and gets[0].response_bytes == 4096


def test_multipart_upload_parts_go_through_and_a_503_part_is_retried(
    s3_proxy: tuple[str, dict[str, Any], FaultProxy],
) -> None:
    url, options, proxy = s3_proxy
    fs = _fs(options)
    path = f"{url.removeprefix('s3://')}/proxy-{uuid.uuid4().hex[:10]}/big.bin"
    data = os.urandom(11 * 2**20)

    def part_2(method: str, target: str, headers: Any) -> bool:
        return method == "PUT" and "partNumber=2" in target

    proxy.inject("503", match=part_2)
    with fs.open(path, "wb", block_size=5 * 2**20) as f:
        for i in range(0, len(data), 2**20):
            f.write(data[i : i + 2**20])

    parts = [r for r in proxy.select("PUT") if "partNumber" in r.params]
    assert sorted(int(r.params["partNumber"][0]) for r in parts if r.fault is None) == [1, 2, 3]
    assert [r.params["partNumber"] for r in parts if r.fault == "503"] == [["2"]]
    assert sum(r.request_bytes for r in parts if r.fault is None) == len(data)
    assert all("uploadId" in r.params for r in parts)
    posts = proxy.select("POST")
    assert any("uploads" in r.params for r in posts)  # CreateMultipartUpload
    assert any("uploadId" in r.params for r in posts)  # CompleteMultipartUpload

    proxy.reset_records()
    assert fs.cat_file(path) == data
    assert proxy.bytes_sent("GET") == len(data)


def test_plain_http_and_chunked_request_bodies(s3_proxy: tuple[str, dict[str, Any], FaultProxy]) -> None:
    """Keep-alive towards the client; a chunked PUT body reaches the server de-chunked; a reset is an RST."""
    url, options, proxy = s3_proxy
    bucket = url.removeprefix("s3://")
    host, port = proxy.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    prefix = f"{bucket}/proxy-{uuid.uuid4().hex[:10]}"
    data = os.urandom(3000)
    # moto accepts unsigned PUTs (but answers unsigned GETs with 403); the reads below go through s3fs.
    conn.request("PUT", f"/{prefix}/chunked.bin", body=iter([data[:1000], data[1000:]]), encode_chunked=True)
    resp = conn.getresponse()
    resp.read()
    assert resp.status == 200
    sock = conn.sock
    conn.request("PUT", f"/{prefix}/plain.bin", body=data[::-1])
    resp = conn.getresponse()
    resp.read()
    assert resp.status == 200 and conn.sock is sock  # the same connection: kept alive
    proxy.inject("reset", match=lambda method, target, headers: method == "GET")
    conn.request("GET", f"/{prefix}/plain.bin")
    with pytest.raises(ConnectionResetError):  # an RST, not a FIN (RemoteDisconnected)
        conn.getresponse().read()
    conn.close()
    assert [(r.method, r.request_bytes, r.fault) for r in proxy.records] == [
        ("PUT", 3000, None),
        ("PUT", 3000, None),
        ("GET", 0, "reset"),
    ]

    fs = _fs(options)
    assert fs.cat_file(f"{prefix}/chunked.bin") == data
    assert fs.cat_file(f"{prefix}/plain.bin") == data[::-1]
