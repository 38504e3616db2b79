"""Object storage under faults: a proxy between s3fs and the moto server resets connections,
answers 500/503, slows and truncates responses, or denies access (tests/fault_proxy.py).

Saves and loads either succeed through retries or fail with a StorageError naming the
URL; no partial checkpoint is ever listed or loaded, and a save killed mid-upload
(SIGKILL) leaves the previous checkpoint at the same URL loadable.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import fault_proxy
import s3_server
from dist_utils import bit_equal
from ucp_dcp import UCPLoadPlanner, UCPSavePlanner, UCPStorageReader, UCPStorageWriter, load_state_dict
from ucp_dcp.byteio.objstore import ObjectStore
from ucp_dcp.errors import CheckpointFormatError, StorageError

s3_bucket = s3_server.s3_bucket  # session fixtures, made visible to this module
s3_proxy = fault_proxy.s3_proxy

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def state(seed: int, mib: int = 2) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * 256, 1024, generator=g), "b": torch.randn(77, generator=g), "step": seed}


def _save(sd: dict[str, Any], url: str, options: dict[str, Any]) -> None:
    dcp.save(sd, storage_writer=UCPStorageWriter(url, storage_options=options), planner=UCPSavePlanner())


def _equal(got: dict[str, Any], sd: dict[str, Any]) -> bool:
    return bit_equal(got["w"], sd["w"]) and bit_equal(got["b"], sd["b"]) and got["step"] == sd["step"]


def _is_part(m: str, p: str, h: Any) -> bool:
    return m == "PUT" and "partNumber=" in p


def _is_ranged_get(m: str, p: str, h: Any) -> bool:
    return m == "GET" and h.get("Range") is not None


def test_save_and_load_succeed_through_transient_faults(s3_proxy: Any) -> None:
    base, options, proxy = s3_proxy
    url = f"{base}/faults-{uuid.uuid4().hex[:8]}"
    sd = state(1, mib=20)  # 20 MiB: a multipart upload of two 16 MiB parts
    proxy.inject("503", count=2, match=_is_part)
    proxy.inject("reset", count=1, match=_is_part)
    proxy.inject("500", count=1, match=lambda m, p, h: m == "PUT" and p.endswith("ucp_index.json"))
    _save(sd, url, options)
    assert proxy.count(fault="503") == 2 and proxy.count(fault="reset") == 1 and proxy.count(fault="500") == 1
    assert proxy.count("PUT", fault=None, status=200) >= 3  # two parts and the index went through

    proxy.reset_records()
    proxy.inject("reset_mid", count=2, match=_is_ranged_get)
    proxy.inject("503", count=3, match=_is_ranged_get)
    proxy.inject("slow", count=1, match=_is_ranged_get, delay_s=0.2)
    got = {"w": torch.zeros_like(sd["w"]), "b": torch.zeros_like(sd["b"]), "step": 0}
    dcp.load(got, storage_reader=UCPStorageReader(url, storage_options=options), planner=UCPLoadPlanner())
    assert _equal(got, sd)
    assert proxy.count(fault="reset_mid") == 2 and proxy.count(fault="503") == 3 and proxy.count(fault="slow") == 1


def test_cli_says_how_to_give_credentials_when_the_store_denies(s3_proxy: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """A store that answers 403 (access denied) to the reads: the CLI's one error line names the
    object and says how to give the store's credentials."""
    from cli_utils import one_error_line, run_cli

    base, options, proxy = s3_proxy
    url = f"{base}/cli-denied-{uuid.uuid4().hex[:8]}"
    _save(state(4, mib=1), url, options)
    proxy.deny(_is_ranged_get)
    rc, out, err = run_cli(capsys, "verify", url, "--storage-options", json.dumps(options))
    line = one_error_line(err)
    assert rc == 2 and out == ""
    assert line.startswith(f"ucp-dcp: error: {url}/") and "PermissionError" in line, line
    assert line.endswith("; give the store's credentials with --storage-options JSON (e.g. "
                         "'{\"key\": \"...\", \"secret\": \"...\"}' for s3://) or the environment variable "
                         "UCP_DCP_STORAGE_OPTIONS"), line


def test_verify_reports_data_the_store_stops_serving(s3_proxy: Any) -> None:
    """Reads denied once a checkpoint is open: verify reports each chunk and value it could not
    read (file, tensor or value, byte range and the store's error) as a problem, not a crash."""
    from ucp_dcp import Checkpoint

    base, options, proxy = s3_proxy
    url = f"{base}/verify-denied-{uuid.uuid4().hex[:8]}"
    _save(state(5, mib=1), url, options)
    with Checkpoint(url, storage_options=options) as ck:
        # Headers (read from byte 0) still come; the data after them does not.
        proxy.deny(lambda m, p, h: _is_ranged_get(m, p, h) and not h["Range"].startswith("bytes=0-"))
        problems = ck.verify()
        (f,) = ck.source.paths
    whats = []
    for line in problems:
        m = re.fullmatch(rf"{re.escape(f)}: (.+): cannot read bytes \[\d+, \d+\): {re.escape(f)}: reading bytes "
                         r"\[\d+, \d+\) failed: PermissionError: Access Denied", line)
        assert m, line
        whats.append(m.group(1))
    assert sorted(whats) == ["tensor 'b' chunk at [0]", "tensor 'w' chunk at [0, 0]", "the block checksums", "value 'step'"]


def test_permanent_errors_name_the_url_and_leave_nothing_loadable(s3_proxy: Any) -> None:
    base, options, proxy = s3_proxy
    url = f"{base}/denied-{uuid.uuid4().hex[:8]}"
    proxy.deny(lambda m, p, h: m == "PUT" or m == "POST")
    with pytest.raises(CheckpointException) as e:
        _save(state(2), url, options)
    assert "StorageError" in str(e.value) and f"{url}/rank00000-" in str(e.value)
    assert "failed: PermissionError" in str(e.value)
    proxy.clear()
    assert "ucp_index.json" not in ObjectStore(url, options).list_sizes()
    with pytest.raises(CheckpointFormatError, match=re.escape(f"{url} is not a checkpoint: found none of ucp_index.json (ucp_dcp), ")):
        load_state_dict(url, storage_options=options)

    sd = state(3)
    _save(sd, url, options)
    proxy.deny(_is_ranged_get)
    with pytest.raises(StorageError) as err:
        load_state_dict(url, storage_options=options)
    assert str(err.value).startswith(f"{url}/rank00000-") and "PermissionError" in str(err.value)
    assert err.value.errno == 13
    proxy.clear()
    assert _equal(load_state_dict(url, storage_options=options), sd)


_CHILD = """
import json, sys, torch, torch.distributed.checkpoint as dcp
from ucp_dcp import UCPSavePlanner, UCPStorageWriter
url, options = sys.argv[1], json.loads(sys.argv[2])
g = torch.Generator().manual_seed(9)
sd = {"w": torch.randn(12 << 20, generator=g), "b": torch.randn(77, generator=g), "step": 9}
dcp.save(sd, storage_writer=UCPStorageWriter(url, storage_options=options), planner=UCPSavePlanner())
print("saved")
"""


def test_sigkill_mid_upload_leaves_the_previous_checkpoint(s3_proxy: Any) -> None:
    base, options, proxy = s3_proxy
    url = f"{base}/killed-{uuid.uuid4().hex[:8]}"
    sd = state(4)
    _save(sd, url, options)
    before = sorted(ObjectStore(url, options).list_sizes())
    proxy.reset_records()
    # The first part of the new save reaches the server, then its answer is held back: the
    # child is killed while its multipart upload is open.
    proxy.inject("slow", count=1, match=_is_part, delay_s=30.0)
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, url, json.dumps(options)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while proxy.pending() and time.monotonic() < deadline:  # the slow fault fires on the first part
            assert child.poll() is None, child.communicate()
            time.sleep(0.05)
        assert not proxy.pending(), "the child never started its upload"
        time.sleep(0.5)  # the part is forwarded to the server; its answer is held back
        assert child.poll() is None
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL
    # Nothing of the killed save is listed, and the committed checkpoint loads as it was.
    assert sorted(ObjectStore(url, options).list_sizes()) == before
    assert _equal(load_state_dict(url, storage_options=options), sd)


@pytest.mark.parametrize("parallel", [4, 1])
def test_parts_upload_in_parallel_and_a_discard_aborts(s3_proxy: Any, parallel: int) -> None:
    base, options, proxy = s3_proxy
    store = ObjectStore(f"{base}/parts-{uuid.uuid4().hex[:8]}", options, write_block_bytes=5 << 20,
                        upload_parallel=parallel)
    data = torch.randn(30 << 18).numpy().tobytes()  # 30 MiB: 6 parts of 5 MiB
    proxy.inject("slow", count=6, match=_is_part, delay_s=0.3)  # each part held long enough to overlap
    out = store.open_write("obj")
    for o in range(0, len(data), 3 << 20):  # writes that do not line up with parts
        out.write(data[o : o + (3 << 20)])
    out.close()
    assert store.read("obj") == data
    parts = [r for r in proxy.select("PUT") if "partNumber" in r.params]
    assert sum(r.request_bytes for r in parts) == len(data)
    if parallel > 1:
        assert sorted(int(r.params["partNumber"][0]) for r in parts) == [1, 2, 3, 4, 5, 6]
        assert all(r.request_bytes == 5 << 20 for r in parts)
    # Parts of one object in flight at once: `parallel` of them (fsspec's buffered file: one).
    assert proxy.max_in_flight("PUT") == parallel

    # A discarded upload is aborted: no object, no upload left open.
    out = store.open_write("gone")
    out.write(data[: 12 << 20])
    from ucp_dcp.byteio.objstore import discard

    discard(out)
    assert "gone" not in store.list_sizes()
    bucket = base.split("://", 1)[1]
    uploads = store.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])
    assert not [u for u in uploads if u["Key"].endswith("/gone")]


def test_a_discard_after_a_failed_part_still_aborts(s3_proxy: Any) -> None:
    """A part that failed is waited for and its error dropped by the discard (which reports
    nothing), the upload is aborted, and closing or discarding again does nothing."""
    from ucp_dcp.byteio.objstore import discard

    base, options, proxy = s3_proxy
    store = ObjectStore(f"{base}/failed-part-{uuid.uuid4().hex[:8]}", options, write_block_bytes=5 << 20,
                        upload_parallel=2)
    proxy.deny(_is_part)
    out = store.open_write("gone")
    out.write(bytes(6 << 20))  # one 5 MiB part goes out (and is denied), 1 MiB stays pending
    discard(out)
    discard(out)
    out.close()  # already abandoned: no PUT of what was pending, no completion
    proxy.clear()
    assert "gone" not in store.list_sizes()
    bucket = base.split("://", 1)[1]
    uploads = store.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])
    assert not [u for u in uploads if u["Key"].endswith("/gone")]
    assert not [r for r in proxy.select("PUT") if "partNumber" not in r.params]
    assert len(proxy.select("POST")) == 1  # the create; no complete
