"""A real S3-compatible server for tests: moto's server on loopback, once per session.

Import the fixture into a test module (``from s3_server import s3_bucket``)
and request ``s3_bucket``: it yields ``(url, storage_options)`` for an empty
bucket, e.g. ``("s3://ucp-test-1a2b3c", {"key": ..., "secret": ...,
"client_kwargs": {"endpoint_url": "http://127.0.0.1:PORT"}})``. Tests that
need it are skipped (with the reason) when ``moto[server]`` or ``s3fs`` is
not installed. Nothing leaves the machine: the server listens on 127.0.0.1
only, and the fake credentials are set in the environment only while the
fixture is alive.
"""

from __future__ import annotations

import importlib.util
import uuid
from typing import Any, Iterator

import pytest

SKIP_REASON = "S3 tier tests need moto[server] and s3fs (pip install -e '.[test]')"


def _have_s3() -> bool:
    try:
        return all(importlib.util.find_spec(m) is not None for m in ("boto3", "moto.server", "s3fs", "flask"))
    except ImportError:  # a parent package is missing
        return False


@pytest.fixture(scope="session")
def s3_bucket() -> Iterator[tuple[str, dict[str, Any]]]:
    """Start moto's S3 server on 127.0.0.1 (free port), create a bucket, yield ``(url, storage_options)``."""
    if not _have_s3():
        pytest.skip(SKIP_REASON)
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request drowns test output

    with pytest.MonkeyPatch.context() as mp:
        for k, v in {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_SECURITY_TOKEN": "testing",
            "AWS_SESSION_TOKEN": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }.items():
            mp.setenv(k, v)
        for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            mp.delenv(k, raising=False)
        # No user configuration or credentials may leak in.
        mp.setenv("AWS_CONFIG_FILE", "/dev/null")
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
        # Loopback must not go through a proxy configured for the outside world.
        for k in ("NO_PROXY", "no_proxy"):
            mp.setenv(k, "127.0.0.1,localhost")
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            host, port = server.get_host_and_port()
            endpoint = f"http://{host}:{port}"
            bucket = f"ucp-test-{uuid.uuid4().hex[:8]}"
            boto3.client(
                "s3",
                endpoint_url=endpoint,
                aws_access_key_id="testing",
                aws_secret_access_key="testing",
                region_name="us-east-1",
            ).create_bucket(Bucket=bucket)
            options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}
            yield f"s3://{bucket}", options
        finally:
            server.stop()
