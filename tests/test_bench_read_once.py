"""Smoke test of the read-once benchmark: its JSON and its byte ratios, never its timings.

Runs ``benchmarks/bench_read_once.py --quick --targets replicated,hsdp2x2``
from this process once (~8 MB state saved dp4, 4 gloo ranks; replicated and
HSDP 2x2 targets on the local disk, HSDP from moto's S3 behind
the capped proxy where moto and s3fs are installed; DCP and ucp with
``read_once`` False, True and ``"auto"``) and checks that every number
docs/read-once.md quotes is recorded, that every load was exact, and the
bytes: with ``read_once=True`` the job reads at most 1.05x the unique bytes
on every target, without it a replicated target reads each byte about once
per rank. Also checks the proxy's cap (``harness.objstore.TokenBucket``)
on a fake clock, and that ``read_once="auto"`` on a local disk does no
read-once work (no needs are computed: its cost is ``read_once=False``'s).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from s3_server import _have_s3

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_read_once  # noqa: E402  (benchmarks/)
from harness.objstore import TokenBucket  # noqa: E402

from ucp_dcp.sources.native import head_request_bytes  # noqa: E402
from ucp_dcp import ReadOptions

WAY_KEYS = {
    "storage_bytes",
    "storage_bytes_per_rank",
    "bytes_over_unique",
    "requests",
    "s",
    "s_runs",
    "cpu_s",
    "positions",
    "peak_anon_growth_max",
    "peak_anon_growth_per_rank",
    "mismatches",
    "error",
}


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench") / "read_once.json"
    # Two of the four local targets (the default suite's time): columns and dp3 are exchanged
    # bit-exact in tests/test_read_once.py; the full --quick run is the benchmark's own.
    args = ["--quick", "--targets", "replicated,hsdp2x2", "--out", str(out)]
    args += ["--workdir", str(tmp_path_factory.mktemp("ckpt"))]
    if not _have_s3():
        args.append("--no-s3")
    return bench_read_once.main(args)


@pytest.mark.multiproc
def test_quick_run_records_every_number_and_reads_each_byte_once(quick: dict[str, Any]) -> None:
    doc = quick
    assert doc["failures"] == []
    assert set(doc["load_avg"]) == {"start", "end"} and len(doc["load_avg"]["start"]) == 3
    parts = [("local", doc["local"])] + ([("s3", doc["s3"])] if doc["s3"] else [])
    objects = doc["s3"]["data_objects"] if doc["s3"] else {}
    assert set(doc["local"]["targets"]) == {"replicated", "hsdp2x2"}
    for part, res in parts:
        for name, rec in res["targets"].items():
            assert rec["unique_bytes"] > 0.9 * doc["state_bytes"]
            assert rec["ranks"] == (3 if name == "dp3" else 4)
            assert set(rec["ways"]) == set(bench_read_once.WAYS)
            for way, e in rec["ways"].items():
                assert WAY_KEYS <= set(e), (part, name, way, WAY_KEYS - set(e))
                assert e["error"] is None and e["mismatches"] == []
                assert len(e["s_runs"]) == 1 and len(e["storage_bytes_per_rank"]) == rec["ranks"]
            once, direct = rec["ways"]["once"], rec["ways"]["ucp"]
            where = f"{part} {name}"
            assert (
                once["decision"]["exchange"]
                and once["exchange"]["read"] == once["decision"]["unique_bytes"]
            )
            assert direct["decision"] is None  # read_once=False: no policy asked
            if part == "local":  # the process's preadv/pread calls: the reader's data and more
                assert once["bytes_over_unique"] <= 1.05, where  # every needed byte read once
                assert once["exchange"]["read"] <= once["reader_bytes"] <= once["os_bytes"], where
                assert once["os_bytes"] == once["storage_bytes"], where
                assert rec["ways"]["dcp"]["storage_bytes"] == rec["ways"]["dcp"]["os_bytes"] > 0
                assert not rec["ways"]["auto"]["decision"][
                    "exchange"
                ]  # a local disk: read directly
            else:
                assert rec["ways"]["auto"]["decision"]["exchange"]  # an object store, replicas
                # at the proxy: the data once, plus every rank's first request of each data
                # object (its header and block checksums)
                heads = rec["ranks"] * sum(head_request_bytes(n) for n in objects.values())
                assert once["storage_bytes"] <= rec["unique_bytes"] * 1.05 + heads, where
                assert rec["limit_s"] == rec["unique_bytes"] / doc["s3"]["cap_bytes_per_s"]
            if name == "replicated":  # each rank reads everything itself
                assert (
                    direct["bytes_over_unique"] >= 3.9
                    and rec["ways"]["dcp"]["bytes_over_unique"] >= 3.9
                )
            if name == "hsdp2x2":
                assert direct["bytes_over_unique"] >= 1.9
    if doc["s3"]:
        assert (
            doc["s3"]["probe_bytes_per_s"] > 0 and len(doc["s3"]["probe"]) == bench_read_once.WORLD
        )
    verdicts = {v["what"]: v["verdict"] for v in doc["verdicts"]}
    assert all(v in ("met", "MISSED", "-") for v in verdicts.values())
    assert sum("once bytes/unique" in w for w in verdicts) == sum(
        len(r["targets"]) for _, r in parts
    )
    # met on the local disk; on S3 every rank's header requests weigh on a state this small
    assert all(verdicts[w] == "met" for w in verdicts if "once bytes/unique" in w and "local" in w)
    assert {"local", "local_ratios"} <= set(doc["tables_md"])
    assert Path(doc["config"]["out"]).is_file()


def test_token_bucket_caps_the_total_rate_in_arrival_order() -> None:
    """On a fake clock: the burst passes at once, then every take waits its bytes at the rate, and
    after an idle spell the burst is back (not more)."""
    now = [100.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    bucket = TokenBucket(1000.0, burst_bytes=500, clock=lambda: now[0], sleep=sleep)
    assert bucket.take(500) == 0.0  # within the burst
    assert bucket.take(1000) == pytest.approx(1.0)  # 1000 bytes at 1000 B/s
    assert bucket.take(250) == pytest.approx(0.25)
    now[0] += 10.0  # idle: the burst again, no more
    assert bucket.take(500) == 0.0
    assert bucket.take(100) == pytest.approx(0.1)
    assert sum(slept) == pytest.approx(1.35)
    with pytest.raises(ValueError):
        TokenBucket(0)


def _auto_on_local_disk(rank: int, world: int, root: str) -> None:
    from ucp_dcp import UCPLoadPlanner, UCPSavePlanner, UCPStorageReader, UCPStorageWriter
    from ucp_dcp.dcp import reader as reader_module

    state = {"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64) + rank * 0}
    dcp.save(state, storage_writer=UCPStorageWriter(root), planner=UCPSavePlanner())
    dist.barrier()

    class Refused:
        def __init__(self, *a: Any, **k: Any) -> None:
            raise AssertionError("read_once='auto' on a local disk computed its needs")

    reader_module.LocalNeeds = Refused  # type: ignore[misc,assignment]
    target = {"w": torch.zeros(64, 64)}
    reader = UCPStorageReader(root, options=ReadOptions(read_once="auto"))
    dcp.load(target, storage_reader=reader, planner=UCPLoadPlanner())
    assert torch.equal(target["w"], state["w"])
    decision = reader.last_load.read_once
    assert decision is not None and not decision.exchange and "local storage" in decision.reason


@pytest.mark.multiproc
def test_auto_on_a_local_disk_computes_no_needs(tmp_path: Path) -> None:
    run_ranks(2, _auto_on_local_disk, str(tmp_path / "ckpt"))
