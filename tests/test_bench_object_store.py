"""The object-storage benchmark's counting proxy: every byte relayed unchanged, every request counted per port.

``benchmarks/harness/objstore.py`` puts a proxy in front of moto's S3
server; the benchmark's request and byte counts are only as good as its
HTTP framing. This drives s3fs through it (a streamed multipart upload, a
one-request put, ranged and whole reads, a HEAD, a listing, a delete, and
an error) and checks the counts against what was sent and read, and that a
second port's counters stay apart. The full benchmark (4 gloo ranks) takes
longer than a smoke test should; it is run by hand (docs/object-storage.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from s3_server import SKIP_REASON, _have_s3

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

pytestmark = pytest.mark.skipif(not _have_s3(), reason=SKIP_REASON)


def test_counting_proxy_counts_requests_and_body_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counts match the bytes s3fs sent and got back, per kind of request and per port."""
    import fsspec
    from harness import objstore

    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SECURITY_TOKEN", "AWS_SESSION_TOKEN",
              "AWS_DEFAULT_REGION", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "NO_PROXY", "no_proxy",
              "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)  # restored after the test; s3_environment sets them
    objstore.s3_environment()
    data = bytes(range(251)) * ((13 << 20) // 251)  # ~13 MiB: three parts of 5 MiB blocks
    with objstore.MotoServer() as server, objstore.CountingProxy(server.port, 2) as proxy:
        url = server.create_bucket("ucp-proxy-test")
        bucket = url[len("s3://"):]
        # skip_instance_cache: a fresh client, so no earlier connection bypasses the port under test
        fs, _ = fsspec.core.url_to_fs(url, skip_instance_cache=True, **objstore.storage_options(proxy.endpoints[0]))
        with fs.open(f"{bucket}/big", "wb", block_size=5 << 20) as f:
            for i in range(0, len(data), 1 << 20):
                f.write(data[i:i + (1 << 20)])
        fs.pipe_file(f"{bucket}/small", b"hello")
        sent = objstore.read_counters(proxy.control_url, 0)
        assert sent.put == 4 and sent.post == 2  # 3 parts + 1 put; create + complete the upload
        # the POST bodies (the completion's XML) are the only bytes beyond the data
        assert len(data) + 5 < sent.bytes_sent < len(data) + 5 + 4096
        assert sent.get == sent.head == sent.list == sent.errors == 0

        ranges = [(0, 10), (100, 5000), (1 << 20, 9 << 20), (len(data) - 7, len(data))]
        got = fs.cat_ranges([f"{bucket}/big"] * len(ranges), [a for a, _ in ranges], [b for _, b in ranges])
        assert got == [data[a:b] for a, b in ranges]
        assert fs.cat_file(f"{bucket}/small") == b"hello"
        fs.invalidate_cache()
        assert fs.info(f"{bucket}/big")["size"] == len(data)
        assert sorted(fs.ls(bucket, detail=False, refresh=True)) == [f"{bucket}/big", f"{bucket}/small"]
        fs.rm_file(f"{bucket}/small")
        with pytest.raises(FileNotFoundError):
            fs.cat_file(f"{bucket}/missing")
        c = objstore.read_counters(proxy.control_url, 0).minus(sent)
        assert c.get >= 5 and c.ranged_get >= 4  # 4 ranges + the whole small object (a miss may be a HEAD)
        assert c.bytes_fetched == sum(b - a for a, b in ranges) + 5
        assert c.head >= 1 and c.list >= 1 and c.delete == 1 and c.errors >= 1
        assert c.put == c.post == c.bytes_sent == 0
        assert c.wire_in > c.bytes_fetched  # headers included
        other = objstore.read_counters(proxy.control_url, 1)
        assert other.requests == 0 and other.wire_in == other.wire_out == 0
