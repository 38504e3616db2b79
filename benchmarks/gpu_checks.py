#!/usr/bin/env python3
"""Bit-exact round trips through the CUDA paths, one named check at a time (issue 35).

Each check saves a state that lives on ``--device`` and loads it back into
tensors on that device that hold other bits, then compares every byte
(on the CPU, as ``uint8``: NaN payloads, -0.0 and all) with the state it
saved; loads must land in place (same storage, same device). The checks:

``dcp_tensors``
    ``dcp.save`` of plain device tensors (fp32, bf16, fp16, fp64, int64,
    int32, uint8, bool, a 0-d tensor, a non-contiguous view) with
    ``UCPStorageWriter``/``UCPSavePlanner`` (placement digests on), then
    ``dcp.load`` with ``UCPStorageReader``/``UCPLoadPlanner``
    (``verify_placement``) into device tensors, and ``dcp.load`` of the same
    checkpoint with a 1 MiB read buffer (many staged slabs per tensor).
``dcp_tensors_async``
    ``dcp.async_save`` of the same state; the sources are overwritten as soon
    as it returns (the saved bits must be those from before), then loaded.
``dtensor``
    CUDA DTensors (``Shard(0)``, ``Shard(1)``, ``Replicate()``) on a 1-rank
    mesh (``init_device_mesh``) in a process group ``cpu:gloo,cuda:nccl``
    (``gloo`` on CPU) over a file store: ``dcp.save`` and ``dcp.load``.
``dtensor_async``
    The same with ``dcp.async_save``, sources overwritten after it returns.
``manager``
    ``CheckpointManager`` with a local and a persistent tier: ``save`` of a
    device state (sources overwritten once it returns: the snapshot into
    pinned host buffers), ``wait``, ``load`` into device tensors, then a load
    from the persistent tier alone (a second manager without the local one).
``manager_dtensor``
    The manager with DTensors on the 1-rank mesh.
``deepspeed_source``
    A DeepSpeed ZeRO-2 checkpoint written by DeepSpeed
    (``tests/fixtures/deepspeed/zero2_fp32_w2``) loaded straight into device
    tensors with ``dcp.load`` and with ``load_state_dict(device=...)``,
    compared with its CPU load.
``hf_source``
    A Hugging Face ``model.safetensors`` made here (bf16, fp32, fp16; nothing
    downloaded) loaded straight into device tensors the same two ways.

Usage::

    python benchmarks/gpu_checks.py --out out/gpu_checks.json            # on a CUDA machine
    python benchmarks/gpu_checks.py --device cpu --out /tmp/checks.json  # self-test of the checks' logic
    python benchmarks/gpu_checks.py --dry-run                            # lists the checks, runs none

Without CUDA (or with ``--dry-run``) every check is listed as skipped and
the exit status is 0. Otherwise it is 1 when a check failed. The result
JSON is rewritten after every check, so a run that is killed (a hung
collective) still leaves the checks before it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import harness  # noqa: E402,F401  (first: puts the checkout's src/ on sys.path)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from ucp_dcp import (  # noqa: E402
    CheckpointManager,
    ReadOptions,
    UCPLoadPlanner,
    UCPSavePlanner,
    UCPStorageReader,
    UCPStorageWriter,
    load_state_dict,
)

DEEPSPEED_FIXTURE = REPO / "tests" / "fixtures" / "deepspeed" / "zero2_fp32_w2"

warnings.filterwarnings("ignore", module=r"torch\.distributed.*")


class CheckFailed(AssertionError):
    """A check's result differs from what it saved."""


# ---------------------------------------------------------------- states and comparison


def rand_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A CPU tensor of random bits (every pattern, NaNs included; bools 0/1)."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).bool()
    raw = torch.randint(0, 256, (n * dtype.itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


SPECS: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "layers.0.w": ((257, 129), torch.float32),
    "layers.0.b": ((129,), torch.float32),
    "layers.1.w": ((300, 64), torch.bfloat16),
    "layers.1.h": ((33, 17, 5), torch.float16),
    "layers.1.d": ((65,), torch.float64),
    "embed.ids": ((100,), torch.int64),
    "stats.count": ((7, 3), torch.int32),
    "stats.bytes": ((1000,), torch.uint8),
    "mask": ((63,), torch.bool),
    "scalar": ((), torch.float32),
}


def reference_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """The state every plain-tensor check saves, on the CPU (the reference)."""
    return {k: rand_tensor(shape, dtype, seed + i) for i, (k, (shape, dtype)) in enumerate(SPECS.items())}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes on the CPU, in logical (row-major) order."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.reshape(-1).view(torch.uint8)


def assert_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Same shape, dtype and bytes, or :class:`CheckFailed` naming ``what``."""
    if got.shape != want.shape or got.dtype != want.dtype:
        raise CheckFailed(f"{what}: {got.dtype}{list(got.shape)} vs {want.dtype}{list(want.shape)}")
    if not torch.equal(bits(got), bits(want)):
        raise CheckFailed(f"{what}: bits differ")


def on_device(ref: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Device copies of ``ref``; one of them a non-contiguous view (a transposed 2-D tensor)."""
    out = {k: v.to(device, copy=True) for k, v in ref.items()}  # copies on CPU too: the checks overwrite them
    out["layers.0.w"] = ref["layers.0.w"].t().contiguous().to(device).t()  # same values, strides (1, 257)
    assert not out["layers.0.w"].is_contiguous()
    return out


def garbage_like(ref: Mapping[str, torch.Tensor], device: torch.device, seed: int = 1000) -> dict[str, torch.Tensor]:
    """Tensors of ``ref``'s shapes and dtypes on ``device`` holding other bits (bools negated)."""
    out = {}
    for i, (k, v) in enumerate(ref.items()):
        out[k] = (~v if v.dtype == torch.bool else rand_tensor(tuple(v.shape), v.dtype, seed + i)).to(device)
    return out


def overwrite(state: Mapping[str, Any], seed: int = 2000) -> None:
    """Overwrite every tensor of ``state`` in place (DTensors: their local shards)."""
    from torch.distributed.tensor import DTensor

    for i, v in enumerate(state.values()):
        local = v.to_local() if isinstance(v, DTensor) else v
        if isinstance(local, torch.Tensor):
            other = ~local.cpu() if local.dtype == torch.bool else rand_tensor(tuple(local.shape), local.dtype, seed + i)
            local.copy_(other.to(local.device))


def assert_loaded(got: Mapping[str, Any], want: Mapping[str, torch.Tensor], device: torch.device,
                  ptrs: Mapping[str, int] | None = None) -> None:
    """Every tensor of ``want`` in ``got``, bit for bit, on ``device`` (and, given ``ptrs``, in place)."""
    from torch.distributed.tensor import DTensor

    for k, w in want.items():
        t = got[k]
        local = t.to_local() if isinstance(t, DTensor) else t
        if local.device.type != device.type:
            raise CheckFailed(f"{k}: loaded on {local.device}, not {device}")
        if ptrs is not None and local.data_ptr() != ptrs[k]:
            raise CheckFailed(f"{k}: not loaded in place")
        assert_bits(t.full_tensor() if isinstance(t, DTensor) else t, w, k)


def data_ptrs(state: Mapping[str, Any]) -> dict[str, int]:
    """The storage address of every tensor (DTensors: their local shard)."""
    from torch.distributed.tensor import DTensor

    return {k: (v.to_local() if isinstance(v, DTensor) else v).data_ptr() for k, v in state.items()}


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wait_async(resp: Any) -> None:
    """Wait for a ``dcp.async_save`` to finish (a Future, or an AsyncSaveResponse in newer torch)."""
    getattr(resp, "upload_completion", resp).result()


# ---------------------------------------------------------------- the 1-rank process group


@contextmanager
def one_rank_group(device: torch.device, tmp: Path) -> Iterator[Any]:
    """A 1-rank process group (``cpu:gloo,cuda:nccl`` on CUDA, ``gloo`` on CPU) over a file store,
    and a 1-rank device mesh on ``device``; destroyed on exit."""
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized")
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # One rank on a machine without a network: NCCL's bootstrap on loopback (gloo uses the file store).
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, init_method=f"file://{tmp / 'pg_store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh(device.type, (1,))
    finally:
        dist.destroy_process_group()


def dtensor_state(ref: Mapping[str, torch.Tensor], mesh: Any, device: torch.device) -> dict[str, Any]:
    """``ref``'s floating tensors of 1 and 2 dimensions as DTensors on ``mesh`` (Shard(0), Shard(1),
    Replicate() in turn), the rest as plain device tensors."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    kinds = [[Shard(0)], [Replicate()], [Shard(1)]]
    out: dict[str, Any] = {}
    i = 0
    for k, v in ref.items():
        if v.is_floating_point() and v.dim() in (1, 2):
            placements = kinds[i % 3] if v.dim() == 2 else kinds[i % 2]
            out[k] = distribute_tensor(v.to(device, copy=True), mesh, placements)
            i += 1
        else:
            out[k] = v.to(device, copy=True)
    return out


# ---------------------------------------------------------------- the checks


def _save(state: Mapping[str, Any], path: Path, asynchronous: bool, **writer: Any) -> None:
    w = UCPStorageWriter(str(path), **writer)
    if asynchronous:
        resp = dcp.async_save(dict(state), storage_writer=w, planner=UCPSavePlanner())
        overwrite(state)  # the save must have taken its copy before returning
        wait_async(resp)
    else:
        dcp.save(dict(state), storage_writer=w, planner=UCPSavePlanner())


def _load(target: dict[str, Any], path: Path, **options: Any) -> None:
    reader = UCPStorageReader(str(path), options=ReadOptions(**options)) if options else UCPStorageReader(str(path))
    dcp.load(target, storage_reader=reader, planner=UCPLoadPlanner())


def _tensors(device: torch.device, tmp: Path, asynchronous: bool) -> str:
    ref = reference_state()
    _save(on_device(ref, device), tmp / "ckpt", asynchronous, placement_digests=True)
    target = garbage_like(ref, device)
    ptrs = data_ptrs(target)
    _load(target, tmp / "ckpt", verify_placement=True)
    sync(device)
    assert_loaded(target, ref, device, ptrs)
    target = garbage_like(ref, device, seed=3000)
    _load(target, tmp / "ckpt", max_buffer_bytes=1 << 20)
    sync(device)
    assert_loaded(target, ref, device)
    return f"{len(ref)} tensors, {sum(v.nbytes for v in ref.values())} B, placement verified"


def check_dcp_tensors(device: torch.device, tmp: Path) -> str:
    """dcp.save from device tensors, dcp.load into device tensors (UCP classes), bit-exact and in place."""
    return _tensors(device, tmp, asynchronous=False)


def check_dcp_tensors_async(device: torch.device, tmp: Path) -> str:
    """dcp.async_save from device tensors overwritten once it returns; dcp.load back, bit-exact."""
    return _tensors(device, tmp, asynchronous=True)


def _dtensors(device: torch.device, tmp: Path, asynchronous: bool) -> str:
    ref = reference_state()
    with one_rank_group(device, tmp) as mesh:
        _save(dtensor_state(ref, mesh, device), tmp / "ckpt", asynchronous)
        target = dtensor_state(garbage_like(ref, torch.device("cpu")), mesh, device)
        ptrs = data_ptrs(target)
        _load(target, tmp / "ckpt")
        sync(device)
        assert_loaded(target, ref, device, ptrs)
        backend = dist.get_backend()
    n = sum(1 for v in target.values() if type(v).__name__ == "DTensor")
    return f"{n} DTensors on a 1-rank {device.type} mesh, backend {backend}"


def check_dtensor(device: torch.device, tmp: Path) -> str:
    """DTensors on a 1-rank mesh: dcp.save and dcp.load, bit-exact and in place."""
    return _dtensors(device, tmp, asynchronous=False)


def check_dtensor_async(device: torch.device, tmp: Path) -> str:
    """DTensors on a 1-rank mesh: dcp.async_save (sources overwritten after it returns), dcp.load."""
    return _dtensors(device, tmp, asynchronous=True)


def _manager(state: dict[str, Any], ref: Mapping[str, torch.Tensor], make_target: Callable[[], dict[str, Any]],
             device: torch.device, tmp: Path) -> str:
    root, local = tmp / "persistent", tmp / "local"
    with CheckpointManager(str(root), local=str(local)) as mgr:
        mgr.save(5, {"model": state, "step": 5})
        overwrite(state)  # the snapshot was taken before save returned
        mgr.wait()
        target = make_target()
        ptrs = data_ptrs(target)
        out = {"model": target, "step": 0}
        step = mgr.load(out)
        sync(device)
        if step != 5 or out["step"] != 5:
            raise CheckFailed(f"load returned step {step}, state step {out['step']}")
        assert_loaded(target, ref, device, ptrs)
        tiers = list(mgr.stats()[-1].tiers)
    with CheckpointManager(str(root)) as mgr:  # the persistent tier alone
        target = make_target()
        out = {"model": target, "step": 0}
        if mgr.load(out) != 5:
            raise CheckFailed("persistent tier: wrong step")
        sync(device)
        assert_loaded(target, ref, device)
    return f"saved to {tiers}, restored from the local tier and from the persistent tier alone"


def check_manager(device: torch.device, tmp: Path) -> str:
    """CheckpointManager save (snapshot of device tensors) and load into device tensors, both tiers."""
    ref = reference_state()
    return _manager(on_device(ref, device), ref, lambda: garbage_like(ref, device), device, tmp)


def check_manager_dtensor(device: torch.device, tmp: Path) -> str:
    """CheckpointManager save and load of DTensors on a 1-rank device mesh, both tiers."""
    ref = reference_state()
    with one_rank_group(device, tmp) as mesh:
        return _manager(dtensor_state(ref, mesh, device), ref,
                        lambda: dtensor_state(garbage_like(ref, torch.device("cpu")), mesh, device), device, tmp)


def _source(path: Path, device: torch.device) -> str:
    ref = {k: v for k, v in load_state_dict(path).items() if isinstance(v, torch.Tensor)}
    if not ref:
        raise CheckFailed(f"{path}: no tensors")
    target = garbage_like(ref, device)
    ptrs = data_ptrs(target)
    dcp.load(target, storage_reader=UCPStorageReader(str(path)), planner=UCPLoadPlanner(), no_dist=True)
    sync(device)
    assert_loaded(target, ref, device, ptrs)
    direct = load_state_dict(path, device=device)
    assert_loaded({k: direct[k] for k in ref}, ref, device)
    return f"{len(ref)} tensors, {sum(v.nbytes for v in ref.values())} B"


def check_deepspeed_source(device: torch.device, tmp: Path) -> str:
    """A DeepSpeed ZeRO-2 checkpoint (tests' fixture) loaded straight into device tensors."""
    if not (DEEPSPEED_FIXTURE / "latest").is_file():
        raise SkipCheck(f"fixture {DEEPSPEED_FIXTURE} not in this checkout")
    return _source(DEEPSPEED_FIXTURE, device)


def check_hf_source(device: torch.device, tmp: Path) -> str:
    """A Hugging Face model.safetensors (made here) loaded straight into device tensors."""
    from safetensors.torch import save_file

    model = tmp / "hf"
    model.mkdir()
    tensors = {"model.embed_tokens.weight": rand_tensor((96, 32), torch.bfloat16, 1),
               "model.layers.0.mlp.up_proj.weight": rand_tensor((64, 32), torch.bfloat16, 2),
               "model.layers.0.input_layernorm.weight": rand_tensor((32,), torch.float32, 3),
               "lm_head.weight": rand_tensor((96, 32), torch.float16, 4)}
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return _source(model, device)


class SkipCheck(Exception):
    """A check that cannot run here (its reason is the message)."""


CHECKS: dict[str, Callable[[torch.device, Path], str]] = {
    "dcp_tensors": check_dcp_tensors,
    "dcp_tensors_async": check_dcp_tensors_async,
    "dtensor": check_dtensor,
    "dtensor_async": check_dtensor_async,
    "manager": check_manager,
    "manager_dtensor": check_manager_dtensor,
    "deepspeed_source": check_deepspeed_source,
    "hf_source": check_hf_source,
}


def run_check(name: str, device: torch.device) -> dict[str, Any]:
    """Run one check in a fresh temporary directory: ``{"name", "status": pass|fail|skipped, "detail", "seconds"}``."""
    fn = CHECKS[name]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"gpu_check_{name}_") as d:
        try:
            detail = fn(device, Path(d))
            status = "pass"
        except SkipCheck as e:
            status, detail = "skipped", str(e)
        except Exception as e:  # recorded: the other checks still run
            status = "fail"
            detail = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=12)}"
        finally:
            if dist.is_initialized():  # a check that failed inside its group
                dist.destroy_process_group()
    return {"name": name, "doc": (fn.__doc__ or "").strip(), "status": status, "detail": detail,
            "seconds": time.perf_counter() - t0}


def environment(device: torch.device | None) -> dict[str, Any]:
    """torch and CUDA versions, and the device's name and memory when it is a CUDA device."""
    env: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
                           "cuda_available": torch.cuda.is_available()}
    if device is not None and device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(device_name=p.name, device_memory_gib=p.total_memory / 2**30, capability=f"{p.major}.{p.minor}")
        try:
            nccl = torch.cuda.nccl.version()  # a tuple in recent torch, an int in older ones
            env["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        except Exception as e:  # recorded; the dtensor checks say whether NCCL works
            env["nccl"] = f"unknown: {type(e).__name__}: {e}"
    return env


def main(argv: Sequence[str] | None = None) -> int:
    """Run the checks (or list them, skipped), write the JSON; 1 if a check failed, else 0."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="where the states live (cpu: a self-test of the checks' logic)")
    p.add_argument("--dry-run", action="store_true", help="list every check as skipped; run none")
    p.add_argument("--only", default=None, help="comma-separated subset of: " + ", ".join(CHECKS))
    p.add_argument("--out", default=None, help="result JSON (default: none written)")
    args = p.parse_args(argv)
    names = list(CHECKS) if args.only is None else args.only.split(",")
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        p.error(f"unknown checks {unknown}; choose from {', '.join(CHECKS)}")
    skip = None
    if args.dry_run:
        skip = "dry run" + ("" if torch.cuda.is_available() else " (no CUDA)")
    elif args.device == "cuda" and not torch.cuda.is_available():
        skip = "no CUDA"
    device = None if skip else torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    doc: dict[str, Any] = {"device": args.device, "dry_run": args.dry_run, "env": environment(device), "checks": []}

    def write() -> None:
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(doc, indent=1))

    for name in names:
        if skip:
            res = {"name": name, "doc": (CHECKS[name].__doc__ or "").strip(), "status": "skipped",
                   "detail": skip, "seconds": 0.0}
        else:
            print(f"gpu_checks: {name} ...", flush=True)
            assert device is not None
            res = run_check(name, device)
        doc["checks"].append(res)
        write()
        print(f"gpu_checks: {name}: {res['status']}: {res['detail']}", flush=True)
    failed = [c["name"] for c in doc["checks"] if c["status"] == "fail"]
    print(f"gpu_checks: {sum(c['status'] == 'pass' for c in doc['checks'])} passed, {len(failed)} failed, "
          f"{sum(c['status'] == 'skipped' for c in doc['checks'])} skipped" + (f": {failed}" if failed else ""),
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
