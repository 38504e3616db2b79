"""Fuzzing: a damaged or hostile checkpoint never crashes a reader, and never loads silently wrong.

A small checkpoint is saved once from 2 ranks (a DTensor sharded over both,
tensors written as several pieces, plain tensors of a few dtypes, one large
enough to be aligned behind padding, values, a rank-local value). Each case
copies it, applies random mutations (``random.Random`` seeded per case) and
reads the result three ways in this process, without a process group:

* ``Checkpoint(path).verify()``;
* ``load_state_dict(path, rank_local=True)`` (no checksum check on tensors);
* ``dcp.load`` with ``UCPStorageReader(verify=True)`` and ``UCPLoadPlanner``.

The mutations: byte flips anywhere (data, header JSON, the header length,
the index), truncation, appended bytes, deletion of a data file or of the
index, and edits of index and header JSON fields (wrong types, huge,
negative and shifted numbers, other names, deleted and renamed keys). An
edited index either keeps its now stale digest, drops it, or gets a new one
(a hostile edit that passes the digest check).

Every outcome must be a library error (an instance of ``ucp_dcp.UCPError``:
no raw ``OSError``, ``KeyError``, ``MemoryError``, ... and no hang) or data
bit-identical to the original (tensors bitwise, values with ``==``).
``load_state_dict`` checks no tensor checksum, so it may return changed
data, but then ``verify`` must report a problem; the verified ``dcp.load``
must never return changed data, unless a hostile index edit also fixed the
digest (then too ``verify`` must report it).

``UCP_FUZZ_CASES`` sets the number of cases (default 300), ``UCP_FUZZ_SEED``
the seed. The outcome counts of each reader are printed at the end
(``pytest -s``). See docs/format.md, "Damaged and hostile input".
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import struct
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dist_utils import bit_equal, run_ranks
from ucp_dcp import (
    ReadOptions,
    Checkpoint,
    Piece,
    RankLocal,
    TensorPieces,
    UCPError,
    UCPLoadPlanner,
    UCPSavePlanner,
    UCPStorageReader,
    UCPStorageWriter,
    load_state_dict,
)
from ucp_dcp.format import INDEX_FILE

pytestmark = [
    pytest.mark.multiproc,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]

CASES = int(os.environ.get("UCP_FUZZ_CASES", "300"))
SEED = int(os.environ.get("UCP_FUZZ_SEED", "1"))
CASE_SECONDS = 60  # a case that takes longer than this is a hang


# ---------------------------------------------------------------- the checkpoint


def _state(rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)  # the same global tensors on every rank
    sharded = torch.randn(8, 6, generator=g)
    rows = torch.arange(24, dtype=torch.int32).reshape(4, 6) * -7
    return {
        "model": {
            "sharded": sharded,
            "rows": rows,  # written as pieces: two rows per rank, one piece per row
            "emb": torch.randn(5, 3, generator=g).to(torch.bfloat16),
            "big": torch.randn(1100, generator=g),  # >= 4 KiB: aligned, after a pad entry
            "ids": torch.arange(7, dtype=torch.int64) - 3,
            "scalar": torch.tensor(2.5),
        },
        "step": 7,
        "cfg": {"lr": 1e-3, "betas": (0.9, 0.999), "name": "adamw", "eps": [1e-8, float("inf")]},
        "rng": RankLocal({"rank": rank, "seed": 1000 + rank}),
    }


def _save_two_ranks(rank: int, world: int, path: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    sd = _state(rank)
    model = sd["model"]
    model["sharded"] = distribute_tensor(model["sharded"], mesh, [Shard(0)])
    rows = model.pop("rows")
    model["rows"] = TensorPieces([Piece("model.rows", (4, 6), (r, 0), rows[r:r + 1].clone())
                                  for r in (2 * rank, 2 * rank + 1)])
    dcp.save(sd, storage_writer=UCPStorageWriter(path), planner=UCPSavePlanner())


def _all_ranks(key: str, values: dict[int, Any], rank: int, world: int) -> Any:
    return dict(values)  # every saved rank's value: comparable whatever the world size


def _dcp_target() -> dict[str, Any]:
    want = _state(0)
    model = {k: torch.full_like(v, 3) for k, v in want["model"].items()}
    return {"model": model, "step": None, "cfg": {k: None for k in want["cfg"]},
            "rng": RankLocal(None, reshard=_all_ranks)}


# ---------------------------------------------------------------- reading it


class Raw(Exception):
    """An exception that is not a library error (the test fails on it)."""


def _library_error(e: BaseException) -> bool:
    if isinstance(e, CheckpointException):  # DCP wraps what a rank raised
        failures = list(e.failures.values())
        return bool(failures) and all(_library_error(f[0] if isinstance(f, tuple) else f) for f in failures)
    return isinstance(e, UCPError)


def _attempt(fn: Callable[[], Any]) -> tuple[str, Any]:
    """("ok", result) or ("error", message); anything but a library error is raised as Raw."""
    try:
        return "ok", fn()
    except BaseException as e:  # classifying every outcome is the point
        if isinstance(e, _Hang):
            raise
        if _library_error(e):
            return "error", str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        raise Raw(f"{type(e).__name__}: {e}") from e


def _verify(path: Path) -> list[str]:
    with Checkpoint(path) as ck:
        return ck.verify()


def _load_dcp(path: Path) -> dict[str, Any]:
    target = _dcp_target()
    reader = UCPStorageReader(path, options=ReadOptions(verify=True))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(target, storage_reader=reader, planner=UCPLoadPlanner())
    except CheckpointException as e:
        # DCP turns an exception of read_metadata into an AssertionError that
        # keeps only its text: ask the reader again to see what it raised.
        if any(isinstance(f[0], AssertionError) and str(f[0]).startswith("metadata is None")
               for f in e.failures.values()):
            reader.read_metadata()
            raise AssertionError("read_metadata failed inside dcp.load but not outside it") from e
        raise
    target["rng"] = target["rng"].value
    return target


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and bit_equal(got, want)
    if isinstance(want, dict):
        return isinstance(got, dict) and set(got) == set(want) and all(_same(got[k], want[k]) for k in want)
    if isinstance(want, (list, tuple)):
        return type(got) is type(want) and len(got) == len(want) and all(_same(a, b) for a, b in zip(got, want))
    return type(got) is type(want) and got == want


# ---------------------------------------------------------------- mutations


def _digest(doc: dict[str, Any]) -> str:
    """The index digest as docs/format.md defines it: xxh3-128 of the canonical JSON without it."""
    body = {k: v for k, v in doc.items() if k != "digest"}
    return xxhash.xxh3_128_hexdigest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _nodes(obj: Any, out: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """Every (container, key) pair of a JSON tree."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in list(items):
        out.append((obj, k))
        _nodes(v, out)
    return out


def _strings(obj: Any) -> list[str]:
    """Every string and key of a JSON tree (the names an edit may swap in)."""
    if isinstance(obj, dict):
        return [s for k, v in obj.items() for s in (k, *_strings(v))]
    if isinstance(obj, list):
        return [s for v in obj for s in _strings(v)]
    return [obj] if isinstance(obj, str) else []


def _hostile_value(rng: random.Random, old: Any, names: list[str]) -> Any:
    kind = rng.choice(["type", "huge", "negative", "shift", "name", "structure"])
    if kind == "type":
        return rng.choice([True, False, None, "1", "", [], {}, 1.5, [1, 2], {"a": 1}, float("nan")])
    if kind == "huge":
        return rng.choice([10**9, 2**31, 2**32 + 1, 2**62, 2**63, 2**64, 10**30, 10**400])
    if kind == "negative":
        return rng.choice([-1, -2, -(2**31), -(2**63), -(10**30)])
    if kind == "shift" and isinstance(old, int) and not isinstance(old, bool):
        return old + rng.choice([-4096, -8, -2, -1, 1, 2, 8, 4096])
    if kind == "name" and names:
        new = rng.choice(names)
        return rng.choice([new, new + "x", "../" + new, "/" + new, new[:-1]]) if new else "x"
    if isinstance(old, list) and old:
        out = list(old)
        rng.choice([lambda: out.pop(rng.randrange(len(out))), lambda: out.append(out[0]),
                    lambda: out.reverse(), lambda: out.insert(0, 0)])()
        return out
    return rng.choice([[old], {"v": old}, str(old)])


def _edit_json(rng: random.Random, doc: Any, avoid: tuple[str, ...] = ()) -> str:
    """One random hostile edit of ``doc`` in place; returns what it did."""
    nodes = [(c, k) for c, k in _nodes(doc, []) if k not in avoid]
    if not nodes:
        return "nothing to edit"
    c, k = rng.choice(nodes)
    names = _strings(doc)
    op = rng.random()
    if op < 0.15:
        del c[k]
        return f"delete {k!r}"
    if op < 0.3 and isinstance(c, dict):
        new = rng.choice([s for s in names if s != k] or ["x"]) if rng.random() < 0.5 else k + rng.choice(["x", "."])
        c[new] = c.pop(k)
        return f"rename key {k!r} -> {new!r}"
    old = c[k]
    c[k] = _hostile_value(rng, old, names)
    return f"set {k!r}: {_short(old)} -> {_short(c[k])}"


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) < 40 else s[:37] + "..."


def _dump(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def _header(path: Path) -> tuple[int, dict[str, Any]]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8:8 + n])


def _write_header(path: Path, n: int, doc: dict[str, Any]) -> str:
    """Write header ``doc`` into the file: in place (space-padded) when it fits, else moving the data."""
    raw = bytearray(path.read_bytes())
    new = _dump(doc)
    if len(new) <= n:
        raw[8:8 + n] = new + b" " * (n - len(new))
        path.write_bytes(bytes(raw))
        return "in place"
    path.write_bytes(struct.pack("<Q", len(new)) + new + bytes(raw[8 + n:]))
    return "data moved"


def _flip(rng: random.Random, path: Path, lo: int, hi: int) -> str:
    raw = bytearray(path.read_bytes())
    hi = min(hi, len(raw))
    if hi <= lo:
        return f"nothing to flip in {path.name}"
    pos = rng.randrange(lo, hi)
    mask = rng.choice([1, 2, 4, 8, 16, 32, 64, 128, rng.randrange(1, 256)])
    raw[pos] ^= mask
    path.write_bytes(bytes(raw))
    return f"flip {path.name}[{pos}] ^= {mask:#x}"


def mutate(rng: random.Random, path: Path) -> tuple[str, bool]:
    """One random mutation of the checkpoint at ``path``: (description, whether it re-signed the index)."""
    data = sorted(path.glob("*.safetensors"))
    index = path / INDEX_FILE
    kind = rng.choices(
        ["flip_data", "flip_header", "flip_length", "flip_index", "truncate", "append", "delete",
         "index_edit", "header_edit", "metadata_edit"],
        weights=[14, 12, 5, 10, 6, 3, 4, 22, 10, 14],
    )[0]
    if kind in ("flip_data", "flip_header", "flip_length"):
        f = rng.choice(data)
        n, _ = _header(f)
        lo, hi = {"flip_data": (8 + n, f.stat().st_size), "flip_header": (8, 8 + n), "flip_length": (0, 8)}[kind]
        return _flip(rng, f, lo, hi), False
    if kind == "flip_index":
        return _flip(rng, index, 0, index.stat().st_size), False
    if kind in ("truncate", "append", "delete"):
        f = rng.choice([*data, index])
        if kind == "delete":
            f.unlink()
            return f"delete {f.name}", False
        raw = f.read_bytes()
        if kind == "append":
            f.write_bytes(raw + bytes(rng.randrange(256) for _ in range(rng.choice([1, 7, 4096]))))
            return f"append to {f.name}", False
        cut = rng.randrange(len(raw))
        f.write_bytes(raw[:cut])
        return f"truncate {f.name} to {cut} of {len(raw)} bytes", False
    if kind == "index_edit":
        doc = json.loads(index.read_bytes())
        what = _edit_json(rng, doc, avoid=("digest",))
        mode = rng.choice(["stale digest", "re-signed", "re-signed", "digest dropped"])
        if mode == "re-signed" and isinstance(doc, dict):
            doc["digest"] = _digest(doc)
        elif mode == "digest dropped" and isinstance(doc, dict):
            doc.pop("digest", None)
        index.write_bytes(_dump(doc))
        return f"index: {what} ({mode})", mode != "stale digest"
    f = rng.choice(data)
    n, doc = _header(f)
    if kind == "header_edit":
        what = _edit_json(rng, doc, avoid=("__metadata__", "ucp_dcp"))
    else:  # the ucp_dcp metadata: a JSON document inside a JSON string
        md = json.loads(doc["__metadata__"]["ucp_dcp"])
        what = "metadata: " + _edit_json(rng, md)
        doc["__metadata__"]["ucp_dcp"] = json.dumps(md, separators=(",", ":"))
    return f"{f.name} header: {what}, {_write_header(f, n, doc)}", False


def _mutate_or_flip(rng: random.Random, path: Path) -> tuple[str, bool]:
    """:func:`mutate`, or a flip in some file when an earlier mutation left nothing it can parse."""
    try:
        return mutate(rng, path)
    except (ValueError, KeyError, TypeError, IndexError, struct.error, FileNotFoundError):
        files = sorted(path.iterdir())
        if not files:
            return "nothing left to mutate", False
        f = rng.choice(files)
        return _flip(rng, f, 0, f.stat().st_size), False


# ---------------------------------------------------------------- the test


class _Hang(BaseException):
    pass


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Hang()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """The saved checkpoint and what each of the two loads returns from it."""
    path = tmp_path_factory.mktemp("fuzz") / "pristine"
    run_ranks(2, _save_two_ranks, str(path))
    assert _verify(path) == []
    return path, load_state_dict(path, rank_local=True), _load_dcp(path)


def test_pristine_loads_the_saved_state(pristine: tuple[Path, dict[str, Any], dict[str, Any]]) -> None:
    """The baseline every case compares against is the state that was saved."""
    _, flat, nested = pristine
    want = _state(0)
    for k, v in want["model"].items():
        assert bit_equal(flat[f"model.{k}"], v) and bit_equal(nested["model"][k], v), k
    assert flat["step"] == nested["step"] == 7
    assert flat["cfg.betas"] == nested["cfg"]["betas"] == (0.9, 0.999)
    assert flat["rng"] == nested["rng"] == {0: {"rank": 0, "seed": 1000}, 1: {"rank": 1, "seed": 1001}}


def test_fuzz_checkpoint(pristine: tuple[Path, dict[str, Any], dict[str, Any]], tmp_path: Path) -> None:
    """Random damage and hostile edits: library errors or identical data, and verify sees every change."""
    src, want_flat, want_nested = pristine
    readers = {"load_state_dict": want_flat, "dcp.load(verify=True)": want_nested}
    counts: dict[str, Counter[str]] = {name: Counter() for name in ("verify", *readers)}
    kinds: Counter[str] = Counter()
    failures: list[str] = []
    old = signal.signal(signal.SIGALRM, _on_alarm)
    logging.disable(logging.WARNING)  # DCP logs every failed load with its traceback
    try:
        for case in range(CASES):
            rng = random.Random(SEED * 1_000_003 + case)
            path = tmp_path / f"case{case}"
            shutil.copytree(src, path)
            steps = [_mutate_or_flip(rng, path) for _ in range(1 if rng.random() < 0.8 else rng.randint(2, 3))]
            what = "; ".join(s for s, _ in steps)
            kinds["several mutations" if len(steps) > 1 else "index edit, digest fixed too" if steps[0][1] else
                  "one mutation"] += 1
            signal.alarm(CASE_SECONDS)
            try:
                results = {"verify": _attempt(lambda: _verify(path)),
                           "load_state_dict": _attempt(lambda: load_state_dict(path, rank_local=True)),
                           "dcp.load(verify=True)": _attempt(lambda: _load_dcp(path))}
            except Raw as e:
                failures.append(f"case {case} ({what}): {e}")
                continue
            except _Hang:
                failures.append(f"case {case} ({what}): took more than {CASE_SECONDS} s")
                continue
            finally:
                signal.alarm(0)
                shutil.rmtree(path, ignore_errors=True)
            status, problems = results["verify"]
            reported = status == "error" or bool(problems)
            counts["verify"]["library error" if status == "error" else "reported" if problems else "clean"] += 1
            for name, want in readers.items():
                status, got = results[name]
                if status == "error":
                    counts[name]["library error"] += 1
                elif _same(got, want):
                    counts[name]["identical"] += 1
                else:
                    counts[name]["changed, verify reported" if reported else "changed, verify clean"] += 1
                    if not reported:
                        failures.append(f"case {case} ({what}): {name} returned changed data and verify saw nothing")
                    elif "verify=True" in name and not steps[0][1]:
                        failures.append(f"case {case} ({what}): the verified {name} returned changed data")
    finally:
        signal.signal(signal.SIGALRM, old)
        logging.disable(logging.NOTSET)
    _report(counts, kinds)
    assert not failures, f"{len(failures)} of {CASES} cases failed:\n" + "\n".join(failures[:40])


def _report(counts: dict[str, Counter[str]], kinds: Counter[str]) -> None:
    columns = ["library error", "identical", "changed, verify reported", "changed, verify clean", "reported", "clean"]
    print(f"\nfuzz: {CASES} cases (seed {SEED}): " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())))
    for name, c in counts.items():
        print(f"  {name:22s} " + ", ".join(f"{k}: {c[k]}" for k in columns if k in c))
