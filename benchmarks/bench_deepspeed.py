#!/usr/bin/env python
"""DeepSpeed ZeRO-3 and Hugging Face checkpoints into FSDP2: ucp_dcp in place vs. convert-then-load.

Needs ``deepspeed`` (and ``transformers``), which neither ucp_dcp nor its
tests need: run it with a venv that has them, e.g.::

    DS_ACCELERATOR=cpu .venv-ds/bin/python benchmarks/bench_deepspeed.py

Setup (not timed):

* a ZeRO-3 checkpoint written by real DeepSpeed (CPU accelerator, gloo,
  ``--ds-world`` ranks under torchrun): a stack of ``Linear(H, H)`` layers,
  fp32, torch AdamW in two parameter groups, two training steps, then
  ``engine.save_checkpoint``. Next to it, ``reference.safetensors`` holds
  DeepSpeed's own full fp32 weights and Adam moments of a few parameters
  (``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``);
* a Hugging Face ``save_pretrained`` directory of a randomly initialised
  transformers Llama, in several safetensors shards.

Timed, every step starting from a cold page cache (its input files fsynced
and evicted with ``POSIX_FADV_DONTNEED``), loads on ``--world`` gloo ranks
into an FSDP2 (``fully_shard``) model and its AdamW state
(``get_state_dict(model, optim)``):

* ``ucp``: ``dcp.load`` straight from the DeepSpeed directory with
  ``UCPStorageReader`` (weights + optimizer state);
* ``ds_to_universal``: DeepSpeed's ``ds_to_universal`` (subprocess,
  ``--inject_missing_state``), then the universal folder loaded with
  ucp_dcp's DeepSpeed Universal source (DeepSpeed's own universal loading
  needs a DeepSpeed engine, not an FSDP2 model);
* ``ucp weights``: the same as ``ucp`` for the model weights only;
* ``zero_to_fp32``: ``python -m deepspeed.utils.zero_to_fp32
  --safe_serialization`` (weights only: it drops the optimizer state), then
  rank 0 reads the safetensors file and ``set_model_state_dict(...,
  full_state_dict=True, broadcast_from_rank0=True)`` shards it, the usual
  way to load a full state dict into FSDP2;
* ``hf ucp`` / ``hf dcp``: the Hugging Face directory with
  ``UCPStorageReader(dir, prefix="model.")`` and with DCP's
  ``HuggingFaceStorageReader``.

Per step: wall time (a load's slowest rank; a conversion's subprocess plus
an fsync of its output), bytes read from storage (``/proc/self/io``
``read_bytes`` summed over ranks for a load; ``ru_inblock`` of the whole
process tree for a conversion), peak memory (a load: RSS growth over the
rank's baseline, the preallocated state excluded, summed over ranks; a
conversion: the peak PSS of its process tree, less that of a process that
only imports the same module) and disk space the step wrote. After each load, a few tensors are
compared bit-exactly with DeepSpeed's (or the safetensors files') own.

``--pipeline`` benchmarks a pipeline-parallel run instead: DeepSpeed writes a
``PipelineModule`` of the same layers on PP=2 x DP=``--ds-dp`` ranks under
ZeRO-1 (``benchmarks/results/deepspeed_pipeline.json``); ucp_dcp loads it in
place, into one process's plain state dict and into FSDP2 on ``--world``
ranks, against ``ds_to_universal`` and then its folder read as DeepSpeed's
own universal loading reads it (``torch.load`` of each parameter's files,
each rank keeping its slice; ``--universal-reader ucp``: ucp_dcp's source).

``--patterns`` benchmarks every tensor-parallel merge rule of ``ds_to_universal``
(``benchmarks/results/deepspeed_patterns.json``): DeepSpeed writes a
Megatron-DeepSpeed-style Llama on TP=``--tp`` x DP=``--ds-dp`` ranks under ZeRO-1
(fp32, a plain engine with the grid as ``mpu=``) with its
``universal_checkpoint_info``: RMSNorms under ``parameter_to_average_patterns``,
a GQA fused QKV under ``parameter_with_sub_params`` (version 0.4 widths), the
SwiGLU ``dense_h_to_4h`` under ``parameter_with_2_sub_params_cat_dim_0``,
row-parallel ``dense`` / ``dense_4h_to_h``, a padded vocabulary-parallel
embedding and output layer. On ``--world`` ranks, into DTensors re-cut from the
merged tensors (fused and the rest ``Shard(0)``, row-parallel ``Shard(1)``, norms
replicated): the bytes each rank's reader requests for the fused tensors
against the bytes of its pieces (``gap_bytes`` default and 0; the other roles
too), then cold rounds of the whole state in place against ``ds_to_universal``
+ the Universal folder's load, alternating which runs first, both compared bit
for bit after every load.

See benchmarks/README.md ("bench_deepspeed.py").
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from harness import (
    MB,
    PhaseProbe,
    ProcessTreeSampler,
    dir_bytes,
    evict_tree,
    fs_type,
    log,
    markdown_table,
    median,
    print_failures,
    rank_log,
    ratio,
    read_ahead_kb,
    set_rank_env,
    spawn_ranks,
    write_json,
)
from harness.memory import loadavg
from harness.report import default_out
from ucp_dcp import ReadOptions

REPO = Path(__file__).resolve().parent.parent
TAG = "step2"
MICRO_BATCH = 2
SEED = 1234


def _generate_module() -> Any:
    """tests/fixtures/deepspeed/generate.py: its parameter groups and DeepSpeed helpers (imports no deepspeed)."""
    path = REPO / "tests" / "fixtures" / "deepspeed" / "generate.py"
    spec = importlib.util.spec_from_file_location("ds_fixture_generate", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


GEN = _generate_module()


# ---------------------------------------------------------------- models


class LinearStack(nn.Module):
    """``layers`` Linear(H, H) with tanh between: the DeepSpeed-trained model."""

    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def stack_layers(size_mb: float, hidden: int) -> int:
    """Layers whose fp32 weights + two Adam moments come closest to ``size_mb`` (at least 2)."""
    per_layer = 3 * 4 * (hidden * hidden + hidden)
    return max(2, round(size_mb * MB / per_layer))


def llama_config(size_mb: float) -> Any:
    """A Llama config whose fp32 weights come to about ``size_mb`` (hidden 512, untied head)."""
    from transformers import LlamaConfig

    hidden, inter, vocab = 512, 1376, 16000
    per_layer = 4 * (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden)
    fixed = 4 * (2 * vocab * hidden + hidden)
    layers = max(1, round((size_mb * MB - fixed) / per_layer))
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256,
                       tie_word_embeddings=False)


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- setup (not timed)


def ds_worker(out: Path, hidden: int, layers: int) -> None:
    """One DeepSpeed rank (under torchrun): two ZeRO-3 steps, save, DeepSpeed's own reference tensors."""
    deepspeed = GEN.import_deepspeed_for_gloo()
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from safetensors.torch import save_file

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(SEED)
    model = LinearStack(hidden, layers)
    opt = torch.optim.AdamW(GEN.param_groups(model), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10_000,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    g = torch.Generator().manual_seed(SEED + rank)
    for _ in range(2):
        loss = engine(torch.randn(MICRO_BATCH, hidden, generator=g)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    # A few parameters, gathered by DeepSpeed itself (collectives: every rank calls).
    names = [n for n, _ in engine.module.named_parameters()]
    picks = sorted({names[0], names[1], names[len(names) // 2], names[-2], names[-1]})
    ref: dict[str, torch.Tensor] = {}
    for name, p in engine.module.named_parameters():
        if name not in picks:
            continue
        ref[f"model.{name}"] = safe_get_full_fp32_param(p).detach().clone().contiguous()
        for key in ("exp_avg", "exp_avg_sq"):
            ref[f"optim.state.{name}.{key}"] = safe_get_full_optimizer_state(p, key).detach().clone().contiguous()
    engine.save_checkpoint(str(out), tag=TAG)
    dist.barrier()
    if rank == 0:
        save_file(ref, str(out.parent / "reference.safetensors"))
    dist.barrier()
    dist.destroy_process_group()


def _torchrun(ckpt: Path, nproc: int, *args: str) -> None:
    """Run this script with ``args`` on ``nproc`` DeepSpeed CPU ranks under torchrun, writing
    ``ckpt`` afresh (DeepSpeed's zero_to_fp32.py copy, not part of the state, removed)."""
    shutil.rmtree(ckpt, ignore_errors=True)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    torchrun = Path(sys.executable).with_name("torchrun")
    port = 29500 + os.getpid() % 1000
    cmd = [str(torchrun), "--nproc-per-node", str(nproc), "--master-port", str(port), __file__, *args]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL if not _VERBOSE else None)
    for script in ckpt.glob("*.py"):
        script.unlink()


def write_deepspeed_checkpoint(ckpt: Path, hidden: int, layers: int, world: int) -> None:
    """Run :func:`ds_worker` on ``world`` ranks under torchrun."""
    _torchrun(ckpt, world, "--ds-worker", str(ckpt), "--hidden", str(hidden), "--layers", str(layers))


class TanhLinear(nn.Linear):
    """``tanh(Linear(x))``: one layer of the pipeline model (a ``LayerSpec`` each)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(super().forward(x))


def pipe_names(layers: int) -> list[str]:
    """The pipeline engine module's parameter names: layer ``i`` is the submodule ``i``."""
    return [f"{i}.{k}" for i in range(layers) for k in ("weight", "bias")]


def pipe_worker(out: Path, hidden: int, layers: int, dp: int) -> None:
    """One DeepSpeed rank (under torchrun): PP=2 x DP=``dp`` ZeRO-1, two ``train_batch`` steps,
    save, DeepSpeed's own full fp32 params and moments of a few parameters (gathered to rank 0)."""
    deepspeed = GEN.import_deepspeed_for_gloo()
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from safetensors.torch import save_file

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(SEED)
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=dp)
    module = PipelineModule(
        layers=[LayerSpec(TanhLinear, hidden, hidden) for _ in range(layers)],
        topology=topo,
        loss_fn=lambda y, t: (y - t).pow(2).mean(),
        partition_method="uniform",
    )
    opt = torch.optim.AdamW(GEN.param_groups(module), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10_000,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=opt, config=cfg)
    g = torch.Generator().manual_seed(SEED + engine.grid.get_data_parallel_id())
    for _ in range(2):
        data = [
            (
                torch.randn(MICRO_BATCH, hidden, generator=g),
                torch.randn(MICRO_BATCH, hidden, generator=g),
            )
            for _ in range(2)
        ]
        engine.train_batch(data_iter=iter(data))
    inner = engine.optimizer
    if hasattr(inner, "_hp_optimizer_states_linked"):
        # DeepSpeed 0.19.8 links the Adam state of the first group only (see generate.py).
        inner._hp_optimizer_states_linked = False
        inner._lazy_init_hp_params_optimizer_state()
    names = pipe_names(layers)
    picks = {
        names[0],
        names[1],
        names[len(names) // 2],
        names[len(names) // 2 + 1],
        names[-2],
        names[-1],
    }
    ref: dict[str, torch.Tensor] = {}
    for name, p in engine.module.named_parameters():
        if name in picks:  # each stage holds its own layers
            ref[f"model.{name}"] = safe_get_full_fp32_param(p).detach().clone().contiguous()
            for key in ("exp_avg", "exp_avg_sq"):
                ref[f"optim.state.{name}.{key}"] = (
                    safe_get_full_optimizer_state(p, key).detach().clone().contiguous()
                )
    engine.save_checkpoint(str(out), tag=TAG)
    gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(ref, gathered, dst=0)
    if rank == 0 and gathered is not None:
        merged = {k: v for r in gathered for k, v in r.items()}
        save_file(merged, str(out.parent / "reference.safetensors"))
    dist.barrier()
    dist.destroy_process_group()


def write_pipeline_checkpoint(ckpt: Path, hidden: int, layers: int, dp: int) -> None:
    """Run :func:`pipe_worker` on 2 x ``dp`` ranks under torchrun."""
    _torchrun(ckpt, 2 * dp, "--pipe-worker", str(ckpt), "--hidden", str(hidden), "--layers",
              str(layers), "--ds-dp", str(dp))


def write_hf_model(path: Path, size_mb: float, shard_mb: int) -> int:
    """A random Llama, ``save_pretrained`` in fp32 safetensors shards; its parameter count."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(SEED)
    model = LlamaForCausalLM(llama_config(size_mb))
    shutil.rmtree(path, ignore_errors=True)
    model.save_pretrained(str(path), max_shard_size=f"{shard_mb}MB", safe_serialization=True)
    return _params(model)


# ---------------------------------------------------------------- conversions (timed, subprocesses)


def _children_read_bytes() -> int:
    # ru_inblock counts 512-byte blocks of the block layer (Linux: read_bytes >> 9)
    # of every waited-for descendant, worker pools included.
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock * 512


def run_conversion(name: str, cmd: list[str], inputs: Path, output: Path) -> dict[str, Any]:
    """One cold conversion: evict its inputs, run ``cmd``, fsync its output; time, bytes, memory, disk."""
    shutil.rmtree(output, ignore_errors=True)
    evict_tree(inputs)
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    rb0 = _children_read_bytes()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with ProcessTreeSampler(proc.pid) as mem:
        text, _ = proc.communicate()
    t_run = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{text[-4000:]}")
    # Durable like a checkpoint save: the output's dirty pages reach the disk.
    evict_tree(output)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "run_seconds": t_run, "read_bytes": _children_read_bytes() - rb0,
            "peak_bytes": mem.peak, "disk_bytes": dir_bytes(output), "cmd": cmd}


def import_floor(module: str) -> int:
    """Peak PSS of a Python process that only imports ``module``: the floor under a conversion's peak."""
    proc = subprocess.Popen([sys.executable, "-c", f"import {module}; import time; time.sleep(0.5)"],
                            env=dict(os.environ, DS_ACCELERATOR="cpu"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    with ProcessTreeSampler(proc.pid) as mem:
        proc.wait()
    return mem.peak


# ---------------------------------------------------------------- loads (timed, on spawned ranks)


def _fsdp2_stack(
    hidden: int, layers: int, pipeline: bool = False
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The DeepSpeed model as FSDP2 on this world: built on meta, sharded, then materialised
    (``pipeline``: the pipeline model under its engine names, ``nn.Sequential`` of
    :class:`TanhLinear`)."""
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model: nn.Module = (
            nn.Sequential(*(TanhLinear(hidden, hidden) for _ in range(layers)))
            if pipeline
            else LinearStack(hidden, layers)
        )
    for layer in (model if pipeline else model.layers):
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    optim = torch.optim.AdamW(GEN.param_groups(model), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    return model, optim


def _fsdp2_llama(cfg: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    return model


def _full(t: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _flat(state: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(state)[0]


def _fill_nan(state: dict[str, Any]) -> None:
    from torch.distributed.tensor import DTensor

    for v in _flat(state).values():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            (v.to_local() if isinstance(v, DTensor) else v).fill_(float("nan"))


def _mismatches(flat: dict[str, Any], want: dict[str, torch.Tensor], what: str) -> list[str]:
    """Keys of ``want`` whose loaded tensor is not bit-equal (full_tensor: a collective, same order on all ranks)."""
    bad = []
    for k in sorted(want):
        got = _full(flat[k])
        if got.dtype != want[k].dtype or got.shape != want[k].shape or not torch.equal(got, want[k]):
            bad.append(f"{what}: {k} differs from the source")
    return bad


def _timed_load(files_root: Path, fn: Any) -> dict[str, Any]:
    """Evict ``files_root``, then time ``fn()`` on every rank between barriers."""
    if dist.get_rank() == 0:
        evict_tree(files_root)
    with PhaseProbe(barrier=dist.barrier) as probe:
        extra = fn() or {}
        dist.barrier()  # every rank's time is the slowest rank's
    return probe.record(**extra)


def _load_ds(variant: str, path: Path, hidden: int, layers: int, ref: dict[str, torch.Tensor]) -> dict[str, Any]:
    """ucp / ds_to_universal / ucp weights / zero_to_fp32 into FSDP2."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    from ucp_dcp import UCPLoadPlanner, UCPStorageReader

    model, optim = _fsdp2_stack(hidden, layers)
    msd, osd = get_state_dict(model, optim)
    weights_only = variant in ("ucp_weights", "zero_to_fp32")
    state: dict[str, Any] = {"model": msd} if weights_only else {"model": msd, "optim": osd}
    if variant == "ds_to_universal":
        # A universal folder records no optimizer hyperparameters, and one
        # converted from ZeRO-3 no per-parameter step (zero/<fqn>/step.pt):
        # load the moments; osd's dicts hold the same tensors, so
        # set_state_dict below gets them, with the fresh optimizer's step.
        state["optim"] = {"state": {fqn: {k: v for k, v in st.items() if k != "step"}
                                    for fqn, st in osd["state"].items()}}
    _fill_nan(state)
    reader = None

    def load() -> dict[str, Any]:
        nonlocal reader
        if variant == "zero_to_fp32":
            full = {}
            if dist.get_rank() == 0:
                for f in sorted(path.glob("*.safetensors")):
                    full.update(load_file(str(f)))
            set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                                       broadcast_from_rank0=True))
            return {}
        reader = UCPStorageReader(path)
        dcp.load(state, storage_reader=reader, planner=UCPLoadPlanner())
        if weights_only:
            set_model_state_dict(model, state["model"])
        else:
            set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
        return {"bytes_requested": reader.last_load.bytes_requested}

    rec = _timed_load(path, load)
    if variant == "zero_to_fp32":
        flat = {f"model.{k}": v for k, v in model.state_dict().items()}
    else:
        flat = _flat(state)
    want = {k: v for k, v in ref.items() if k.startswith("model.") or not weights_only}
    rec["failures"] = _mismatches(flat, want, variant)
    return rec


def _load_pp(
    variant: str,
    path: Path,
    hidden: int,
    layers: int,
    universal_reader: str,
    ref: dict[str, torch.Tensor],
) -> dict[str, Any]:
    """pp_ucp / pp_ds_to_universal: the pipeline run's weights and Adam moments into one process's
    plain state dict (what an export or a single-process resume holds), preallocated."""
    from ucp_dcp import UCPLoadPlanner, UCPStorageReader

    names = pipe_names(layers)
    model = {n: torch.empty((hidden, hidden) if n.endswith("weight") else (hidden,)) for n in names}
    optim = {
        n: {"exp_avg": torch.empty_like(t), "exp_avg_sq": torch.empty_like(t)}
        for n, t in model.items()
    }
    state: dict[str, Any] = {"model": model, "optim": {"state": optim}}
    _fill_nan(state)
    zero = path / f"{TAG}_universal" / "zero"

    def load() -> dict[str, Any]:
        if variant == "pp_ds_to_universal" and universal_reader == "torch":
            # As DeepSpeed's own universal loading reads it: each parameter's files whole
            # (torch.load, a dict with the full tensor under "param"), then copied in.
            for n in names:
                model[n].copy_(torch.load(zero / n / "fp32.pt", weights_only=False)["param"])
                for k in ("exp_avg", "exp_avg_sq"):
                    optim[n][k].copy_(torch.load(zero / n / f"{k}.pt", weights_only=False)["param"])
            return {}
        reader = UCPStorageReader(path)
        dcp.load(state, storage_reader=reader, planner=UCPLoadPlanner())
        return {"bytes_requested": reader.last_load.bytes_requested}

    rec = _timed_load(path, load)
    rec["failures"] = _mismatches(_flat(state), ref, variant)
    return rec


def _load_pp_fsdp2(
    variant: str,
    path: Path,
    hidden: int,
    layers: int,
    universal_reader: str,
    ref: dict[str, torch.Tensor],
) -> dict[str, Any]:
    """pp_ucp_fsdp2 / pp_ds_to_universal_fsdp2: the pipeline run into FSDP2 and its AdamW state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from ucp_dcp import UCPLoadPlanner, UCPStorageReader

    model, optim = _fsdp2_stack(hidden, layers, pipeline=True)
    msd, osd = get_state_dict(model, optim)
    # Both load the moments into osd's tensors; the universal folder has no hyperparameters.
    state: dict[str, Any] = {
        "model": msd,
        "optim": {
            "state": {
                n: {k: st[k] for k in ("exp_avg", "exp_avg_sq")} for n, st in osd["state"].items()
            }
        },
    }
    if variant == "pp_ucp_fsdp2":
        state["optim"]["param_groups"] = osd["param_groups"]
    _fill_nan(state)
    zero = path / f"{TAG}_universal" / "zero"
    rank, world = dist.get_rank(), dist.get_world_size()

    @torch.no_grad()  # msd holds the model's parameters
    def into(local: torch.Tensor, full: torch.Tensor) -> None:
        # FSDP2 shards dim 0 as torch.chunk does: this rank's rows of the full tensor.
        parts = full.chunk(world, dim=0)
        if rank < len(parts):
            local.copy_(parts[rank])

    def load() -> dict[str, Any]:
        if variant == "pp_ds_to_universal_fsdp2" and universal_reader == "torch":
            # As DeepSpeed's own universal loading does: every rank reads each parameter's
            # files whole and keeps its slice.
            for n, t in msd.items():
                into(t.to_local(), torch.load(zero / n / "fp32.pt", weights_only=False)["param"])
                for k in ("exp_avg", "exp_avg_sq"):
                    into(
                        osd["state"][n][k].to_local(),
                        torch.load(zero / n / f"{k}.pt", weights_only=False)["param"],
                    )
            set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
            return {}
        reader = UCPStorageReader(path)
        dcp.load(state, storage_reader=reader, planner=UCPLoadPlanner())
        set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
        return {"bytes_requested": reader.last_load.bytes_requested}

    rec = _timed_load(path, load)
    rec["failures"] = _mismatches(_flat(state), ref, variant)
    return rec


def _load_hf(variant: str, path: Path, cfg: Any) -> dict[str, Any]:
    """hf_ucp / hf_dcp: the Hugging Face directory into an FSDP2 Llama."""
    from safetensors import safe_open
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from ucp_dcp import UCPLoadPlanner, UCPStorageReader

    model = _fsdp2_llama(cfg)
    msd = get_model_state_dict(model)
    _fill_nan(msd)

    def load() -> dict[str, Any]:
        if variant == "hf_ucp":
            reader = UCPStorageReader(path, prefix="model.")
            dcp.load({"model": msd}, storage_reader=reader, planner=UCPLoadPlanner())
            return {"bytes_requested": reader.last_load.bytes_requested}
        dcp.load(msd, storage_reader=HuggingFaceStorageReader(str(path)))
        return {}

    rec = _timed_load(path, load)
    keys = sorted(msd)
    picks = {keys[0], keys[1], keys[len(keys) // 2], keys[-1]}
    want = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            want.update({f"model.{k}": sf.get_tensor(k) for k in sf.keys() if k in picks})
    rec["failures"] = _mismatches({f"model.{k}": v for k, v in msd.items()}, want, variant)
    return rec


def rank_main(rank: int, world: int, jobs: list[dict[str, Any]], ds: dict[str, Any],
              hf_cfg: dict[str, Any] | None, ref_path: str, repeats: int, warmup: bool) -> dict[str, Any]:
    """Every load job on this rank: an untimed warm-up round, then ``repeats`` cold timed rounds."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    ref = load_file(ref_path)
    cfg = None
    if hf_cfg:  # --pipeline runs need no transformers
        from transformers import LlamaConfig

        cfg = LlamaConfig(**hf_cfg)
    out: dict[str, list[dict[str, Any]]] = {j["name"]: [] for j in jobs}

    def one(job: dict[str, Any]) -> dict[str, Any]:
        if job["name"].endswith("_fsdp2"):
            return _load_pp_fsdp2(job["name"], Path(job["path"]), ds["hidden"], ds["layers"],
                                  ds["universal_reader"], ref)
        if job["name"].startswith("pp_"):
            return _load_pp(job["name"], Path(job["path"]), ds["hidden"], ds["layers"],
                            ds["universal_reader"], ref)
        if job["name"].startswith("hf_"):
            return _load_hf(job["name"], Path(job["path"]), cfg)
        return _load_ds(job["name"], Path(job["path"]), ds["hidden"], ds["layers"], ref)

    if warmup:  # lazy imports and first collectives are charged to no variant
        for job in jobs:
            one(job)
    for r in range(repeats):
        for job in jobs:
            rank_log(f"repeat {r + 1}/{repeats}: {job['name']}")
            out[job["name"]].append(one(job))
    return out


# ---------------------------------------------------------------- report


ROWS = [
    # name, label, what is loaded, conversion step (or None), baseline row for ratios
    ("ucp", "ucp_dcp: DeepSpeed dir -> FSDP2", "weights + Adam", None, None),
    ("ds_to_universal", "ds_to_universal + load (ucp_dcp universal source)", "weights + Adam", "ds_to_universal",
     "ucp"),
    ("ucp_weights", "ucp_dcp: DeepSpeed dir -> FSDP2", "weights", None, None),
    ("zero_to_fp32", "zero_to_fp32 + rank 0 load_file + set_model_state_dict", "weights", "zero_to_fp32",
     "ucp_weights"),
    ("hf_ucp", "HF dir: ucp_dcp UCPStorageReader(prefix='model.')", "weights", None, None),
    ("hf_dcp", "HF dir: DCP HuggingFaceStorageReader", "weights", None, "hf_ucp"),
    ("pp_ucp", "ucp_dcp: PP x ZeRO-1 DeepSpeed dir -> one process", "weights + Adam", None, None),
    ("pp_ds_to_universal", "ds_to_universal + load (torch.load per parameter file)",
     "weights + Adam", "pp_ds_to_universal", "pp_ucp"),
    ("pp_ucp_fsdp2", "ucp_dcp: PP x ZeRO-1 DeepSpeed dir -> FSDP2", "weights + Adam", None, None),
    ("pp_ds_to_universal_fsdp2",
     "ds_to_universal + load (each rank: torch.load per file, its slice)",
     "weights + Adam", "pp_ds_to_universal", "pp_ucp_fsdp2"),
]


def summarise(loads: dict[str, list[list[dict[str, Any]]]], convs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per variant: medians over repeats of the slowest rank's time, sums over ranks of bytes and memory."""
    rows = {}
    for name, label, what, conv, base in ROWS:
        reps = loads.get(name)
        if not reps:
            continue
        per_rep = [{"seconds": max(r["seconds"] for r in ranks),
                    "read_bytes": sum(r["read_bytes"] for r in ranks),
                    "peak_rss_sum": sum(r["peak_rss"] for r in ranks),
                    "peak_rss_max": max(r["peak_rss"] for r in ranks),
                    "bytes_requested": sum(r.get("bytes_requested", 0) for r in ranks)} for ranks in reps]
        load = {k: median([p[k] for p in per_rep]) for k in per_rep[0]}
        load["seconds_all"] = [p["seconds"] for p in per_rep]
        c = convs.get(conv) if conv else None
        row = {"label": label, "loads": what, "load": load, "convert": c, "baseline": base,
               "total_seconds": load["seconds"] + (c["seconds"] if c else 0.0),
               "total_read_bytes": load["read_bytes"] + (c["read_bytes"] if c else 0),
               # The two steps run one after the other: the larger peak is what the pipeline
               # needs. A conversion's peak counts above its interpreter and imports alone.
               "peak_bytes": max(load["peak_rss_sum"], c["peak_extra_bytes"] if c else 0),
               "disk_bytes": c["disk_bytes"] if c else 0}
        rows[name] = row
    for row in rows.values():
        b = rows.get(row["baseline"]) if row["baseline"] else None
        row["vs"] = None if b is None else {
            "time": ratio(row["total_seconds"], b["total_seconds"]),
            "read": ratio(row["total_read_bytes"], b["total_read_bytes"]),
                # Against a peak under 1 MB (a load filling tensors in place) a ratio means nothing.
            "peak": ratio(row["peak_bytes"], b["peak_bytes"]) if b["peak_bytes"] >= MB else None,
        }
    return rows


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / MB:.0f}"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def table(rows: dict[str, Any]) -> str:
    """The markdown table the README quotes."""
    header = ["variant", "loads", "convert s", "load s", "total s", "read MB (convert + load)",
              "convert peak MB", "load peak MB", "extra disk MB", "total time vs ucp", "read vs ucp"]
    out = []
    for name, r in rows.items():
        c = r["convert"]
        vs = r["vs"] or {}
        load = r["load"]
        read = f"{_mb(c['read_bytes'])} + {_mb(load['read_bytes'])}" if c else _mb(load["read_bytes"])
        out.append([f"`{name}`: {r['label']}", r["loads"], _s(c["seconds"]) if c else "-", _s(load["seconds"]),
                    _s(r["total_seconds"]), read, _mb(c["peak_extra_bytes"]) if c else "-",
                    f"{load['peak_rss_sum'] / MB:.1f}", _mb(r["disk_bytes"]) if c else "0",
                    _x(vs.get("time")), _x(vs.get("read"))])
    return markdown_table(header, out)


# ---------------------------------------------------------------- --patterns: every TP merge rule

# A Megatron-DeepSpeed-style Llama under its engine module's names: "0" the vocabulary-parallel
# embedding, "1".."L" blocks, "L+1" the final RMSNorm, "L+2" the untied vocabulary-parallel
# output layer (as tests/fixtures/deepspeed/generate_megatron_ds.py's llama_tp2_dp2, bigger).
PAT_HEADS, PAT_KV_HEADS = 16, 4
PAT_QKV = r"\d+\.self_attention\.query_key_value\.weight$"
PAT_SWIGLU = r"\d+\.mlp\.dense_h_to_4h\.weight$"
PAT_ROW = [r"\d+\.self_attention\.dense\.weight$", r"\d+\.mlp\.dense_4h_to_h\.weight$"]
PAT_AVERAGED = [
    r"\d+\.input_layernorm\.weight$",
    r"\d+\.post_attention_layernorm\.weight$",
    r"\d+\.final_layernorm\.weight$",
]
PAT_VOCAB = [r"\d+\.word_embeddings\.weight$", r"\d+\.output_layer\.weight$"]
PAT_VOCAB_PAD = 77  # padding rows of the vocabulary (Megatron pads to a multiple of 128 x TP)


def patterns_dims(size_mb: float, hidden: int, tp: int) -> dict[str, int]:
    """The Llama whose checkpoint comes to about ``size_mb`` on disk: 16 bytes a parameter (fp32
    module weights in ``mp_rank_*``, fp32 master + two Adam moments in ``zero_pp_rank_*``). GQA 16
    query / 4 KV heads of ``hidden // 16``, SwiGLU inner size Llama's ``8/3 hidden`` rounded up to
    256; as many whole blocks as fit with at least 1024 vocabulary rows, the vocabulary (padded to a
    multiple of 128 x ``tp``) filling the rest."""
    head_dim = hidden // PAT_HEADS
    ffn = 256 * math.ceil(8 * hidden / 3 / 256)
    q_rows, kv_rows = PAT_HEADS * head_dim, PAT_KV_HEADS * head_dim
    per_layer = hidden * (q_rows + 2 * kv_rows) + q_rows * hidden + 3 * hidden * ffn + 2 * hidden
    budget = size_mb * MB / 16 - hidden  # the final norm
    layers = max(1, int((budget - 2 * 1024 * hidden) // per_layer))
    step = 128 * tp
    padded = max(
        1024 // step * step or step,
        int((budget - layers * per_layer) / (2 * hidden)) // step * step,
    )
    return {
        "hidden": hidden,
        "heads": PAT_HEADS,
        "kv_heads": PAT_KV_HEADS,
        "head_dim": head_dim,
        "q_rows": q_rows,
        "kv_rows": kv_rows,
        "ffn": ffn,
        "layers": layers,
        "tp": tp,
        "padded_vocab": padded,
        "vocab": padded - PAT_VOCAB_PAD,
        "params": layers * per_layer + 2 * padded * hidden + hidden,
    }


def patterns_info(d: dict[str, int]) -> dict[str, Any]:
    """The ``universal_checkpoint_info`` Megatron-DeepSpeed saves for this Llama (keys and format
    as generate_megatron_ds.py's LLAMA_INFO: universal_checkpoint_version 0.4, sub-parameter
    shapes as tuples at ``partition_dim``, every sub-parameter's rows per TP rank)."""
    tp = d["tp"]
    return {
        "universal_checkpoint_version": 0.4,
        "original_vocab_size": d["vocab"],
        "padded_vocab_size": d["padded_vocab"],
        "vocabulary_parameter_patterns": PAT_VOCAB,
        "pipeline_replicated_parameter_patterns": [],
        "tp_replicated_parameter_patterns": [],
        "parameter_to_average_patterns": PAT_AVERAGED,
        "parameter_with_row_parallelism_patterns": PAT_ROW,
        "parameter_with_2_sub_params_cat_dim_0": [PAT_SWIGLU],
        "parameter_with_sub_params": [
            {
                "patterns": [PAT_QKV],
                "shape": ((d["q_rows"], d["kv_rows"], d["kv_rows"]), d["hidden"]),
                "partition_dim": 0,
            }
        ],
        "sub_param_shard_widths": {
            PAT_QKV: [
                [d["q_rows"] // tp] * tp,
                [d["kv_rows"] // tp] * tp,
                [d["kv_rows"] // tp] * tp,
            ]
        },
    }


def patterns_model(d: dict[str, int], tp_rank: int) -> nn.Module:
    """Tensor-parallel rank ``tp_rank``'s slices (each rank its own random values, the averaged
    RMSNorms included). The forward pass touches every parameter with plain local math (no
    tensor-parallel collectives: the values, not the model's correctness, are what is saved)."""
    tp, hidden, hd = d["tp"], d["hidden"], d["head_dim"]
    nq, nkv, ffn = d["heads"] // tp, d["kv_heads"] // tp, d["ffn"] // tp
    vocab_rows = d["padded_vocab"] // tp

    def weight(*shape: int, scale: float) -> nn.Parameter:
        p = nn.Parameter(torch.randn(*shape) * scale)
        # A TP slice: DeepSpeed's gradient norm counts it on every TP rank.
        p.tensor_model_parallel = True  # type: ignore[attr-defined]
        return p

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    class Norm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(1.0 + 0.3 * torch.randn(hidden))

    class Lin(nn.Module):
        def __init__(self, out: int, inp: int, scale: float = 0.0) -> None:
            super().__init__()
            self.weight = weight(out, inp, scale=scale or 1 / math.sqrt(inp))

    class Embedding(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.word_embeddings = Lin(vocab_rows, hidden, 0.5)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            local = tokens - tp_rank * vocab_rows
            inside = ((local >= 0) & (local < vocab_rows)).unsqueeze(-1)
            w = self.word_embeddings.weight
            return nn.functional.embedding(local.clamp(0, vocab_rows - 1), w) * inside

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.query_key_value = Lin((nq + 2 * nkv) * hd, hidden)  # [q_k; k_k; v_k]
            self.dense = Lin(hidden, nq * hd)  # row-parallel

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            q, k, v = (h @ self.query_key_value.weight.t()).split([nq * hd, nkv * hd, nkv * hd], -1)
            b, t, _ = q.shape
            o = q.view(b, t, nkv, nq // nkv, hd) * torch.sigmoid(k + v).view(b, t, nkv, 1, hd)
            return o.reshape(b, t, nq * hd) @ self.dense.weight.t()

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dense_h_to_4h = Lin(2 * ffn, hidden)  # [gate_k; up_k]
            self.dense_4h_to_h = Lin(hidden, ffn)  # row-parallel

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            gate, up = (h @ self.dense_h_to_4h.weight.t()).chunk(2, dim=-1)
            return (nn.functional.silu(gate) * up) @ self.dense_4h_to_h.weight.t()

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.input_layernorm = Norm()
            self.self_attention = Attention()
            self.post_attention_layernorm = Norm()
            self.mlp = MLP()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.self_attention(rms(x, self.input_layernorm.weight))
            return x + self.mlp(rms(x, self.post_attention_layernorm.weight))

    class FinalNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.final_layernorm = Norm()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return rms(x, self.final_layernorm.weight)

    class Output(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.output_layer = Lin(vocab_rows, hidden)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.output_layer.weight.t()

    class Llama(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            mods = [Embedding(), *(Block() for _ in range(d["layers"])), FinalNorm(), Output()]
            for i, m in enumerate(mods):
                self.add_module(str(i), m)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = tokens
            for m in self.children():
                x = m(x)
            return x.pow(2).mean()  # the "loss"

    return Llama()


def patterns_worker(out: Path, d: dict[str, int], dp: int) -> None:
    """One DeepSpeed rank (under torchrun) of TP=``d["tp"]`` x DP=``dp``: a plain engine with the
    grid as ``mpu=`` (Megatron-DeepSpeed without a pipeline), ZeRO-1 fp32, two steps, saved with
    its ``universal_checkpoint_info``."""
    deepspeed = GEN.import_deepspeed_for_gloo()
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid, PipeModelDataParallelTopology

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == d["tp"] * dp, (world, d["tp"], dp)
    topo = PipeModelDataParallelTopology(num_pp=1, num_mp=d["tp"], num_dp=dp)
    mpu = PipelineParallelGrid(topology=topo)
    tp_rank = topo.get_coord(rank).model
    torch.manual_seed(SEED + tp_rank)  # the TP ranks' slices (and averaged norms) differ
    model = patterns_model(d, tp_rank)
    opt = torch.optim.AdamW(GEN.param_groups(model), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10_000,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg, mpu=mpu)
    g = torch.Generator().manual_seed(SEED + mpu.get_data_parallel_id())
    for _ in range(2):
        loss = engine(torch.randint(0, d["vocab"], (MICRO_BATCH, 8), generator=g))
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(
        str(out), tag=TAG, client_state={"universal_checkpoint_info": patterns_info(d)}
    )
    dist.barrier()
    dist.destroy_process_group()


def pattern_role(key: str) -> str:
    """``fused`` (QKV, SwiGLU), ``row`` (row-parallel), ``averaged`` (RMSNorms) or ``other``
    (embedding, output layer) for a state key ``model.<name>`` / ``optim.state.<name>.<kind>``."""
    name = (
        key.removeprefix("model.")
        if key.startswith("model.")
        else key.removeprefix("optim.state.").rsplit(".", 1)[0]
    )
    if re.match(PAT_QKV, name) or re.match(PAT_SWIGLU, name):
        return "fused"
    if any(re.match(p, name) for p in PAT_ROW):
        return "row"
    if any(re.match(p, name) for p in PAT_AVERAGED):
        return "averaged"
    return "other"


def _pattern_state(specs: list[list[Any]], mesh: Any) -> dict[str, Any]:
    """``specs`` ([key, shape, role]) as NaN-filled DTensors on the 1-D ``mesh``: the fused
    tensors and the others Shard(0), row-parallel weights Shard(1), the norms replicated."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import empty as dt_empty

    state = {}
    for key, shape, role in specs:
        placement = {"row": Shard(1), "averaged": Replicate()}.get(role, Shard(0))
        t = dt_empty(*shape, device_mesh=mesh, placements=[placement], dtype=torch.float32)
        t.to_local().fill_(float("nan"))
        state[key] = t
    return state


def _local_bytes(state: dict[str, Any]) -> int:
    return sum(t.to_local().numel() * t.to_local().element_size() for t in state.values())


def _pattern_load(state: dict[str, Any], path: Path, gap_bytes: int | None = None) -> Any:
    from ucp_dcp import UCPLoadPlanner, UCPStorageReader

    reader = UCPStorageReader(path, options=ReadOptions(read_once=False, gap_bytes=gap_bytes))
    dcp.load(state, storage_reader=reader, planner=UCPLoadPlanner())
    return reader


def _unfilled(state: dict[str, Any]) -> list[str]:
    return [k for k, t in state.items() if torch.isnan(t.to_local()).any()]


def patterns_rank_main(
    rank: int,
    world: int,
    specs: list[list[Any]],
    picks: list[str],
    ckpt: str,
    uni: str,
    conv_cmd: list[str],
    repeats: int,
    warmup: bool,
) -> dict[str, Any]:
    """Bytes of the fused tensors, then ``repeats`` cold rounds of (a) the in-place load and
    (b) ``ds_to_universal`` (rank 0, a subprocess; the others wait at a broadcast) + the Universal
    folder's load, alternating which goes first; (a) and (b) compared bit for bit after each
    load."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    # Each load fills a part of what the checkpoint offers (no step, no param_groups): DCP says so.
    warnings.filterwarnings("ignore", message=r".*checkpoint key\(s\) not in the state dict")
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    ckpt_p, uni_p = Path(ckpt), Path(uni)
    out: dict[str, Any] = {"rank": rank}

    # --- bytes: the fused tensors (QKV, SwiGLU and their moments) alone, each of them alone,
    # and, to explain the whole state's, the tensors of each other role
    by_gap: dict[str, Any] = {}
    for label, gap in (("default", None), ("gap_bytes=0", 0)):
        by_gap[label] = {}
        for role in ("fused", "row", "averaged", "other"):
            group = [s for s in specs if s[2] == role]
            state = _pattern_state(group, mesh)
            reader = _pattern_load(state, ckpt_p, gap)
            rec = {
                "requested": reader.last_load.bytes_requested,
                "target": _local_bytes(state),
                "tensors": len(group),
                "unfilled": _unfilled(state),
            }
            rec["ratio"] = ratio(rec["requested"], rec["target"])
            if role == "fused":  # each tensor alone: which ones a rank over-reads
                rec["per_tensor"] = {}
                for spec in group:
                    single = _pattern_state([spec], mesh)
                    rec["per_tensor"][spec[0]] = {
                        "requested": _pattern_load(single, ckpt_p, gap).bytes_requested,
                        "target": _local_bytes(single),
                    }
            by_gap[label][role] = rec
    out["role_bytes"] = by_gap

    # --- times: the whole state, in place (a) and through ds_to_universal (b)
    states = {"ucp": _pattern_state(specs, mesh), "universal": _pattern_state(specs, mesh)}
    target_all = _local_bytes(states["ucp"])
    loaded: set[str] = set()
    failures: list[str] = []

    def compare(variant: str, when: str) -> dict[str, Any]:
        """Every local shard of (a) and (b) equal, and the picks' full tensors (collectives)."""
        a, b = states["ucp"], states["universal"]
        differ = [k for k in a if not torch.equal(a[k].to_local(), b[k].to_local())]
        full_differ = [k for k in picks if not torch.equal(a[k].full_tensor(), b[k].full_tensor())]
        bad = differ + [f"{k} (full)" for k in full_differ]
        failures.extend(f"{when}: {k}: in-place and ds_to_universal differ" for k in bad)
        return {"after": variant, "when": when, "local_differ": differ, "picks_differ": full_differ}

    def one(variant: str) -> dict[str, Any]:
        state = states[variant]
        for t in state.values():
            t.to_local().fill_(float("nan"))
        conv = None
        if variant == "universal":
            box: list[Any] = [None]
            if rank == 0:
                box[0] = run_conversion("ds_to_universal", conv_cmd, ckpt_p, uni_p)
                (uni_p / "latest_universal").write_text(f"{TAG}_universal")
            dist.broadcast_object_list(box, src=0)
            conv = box[0]
        reader: Any = None

        def load() -> dict[str, Any]:
            nonlocal reader
            reader = _pattern_load(state, uni_p if variant == "universal" else ckpt_p)
            return {"bytes_requested": reader.last_load.bytes_requested}

        rec = _timed_load(uni_p if variant == "universal" else ckpt_p, load)
        rec["target_bytes"] = target_all
        rec["convert"] = conv
        rec["loadavg"] = loadavg()
        rec["unfilled"] = _unfilled(state)
        failures.extend(f"{variant}: {k} not filled" for k in rec["unfilled"])
        loaded.add(variant)
        return rec

    if warmup:  # lazy imports, first collectives, the first conversion: charged to no round
        for variant in ("ucp", "universal"):
            one(variant)
        out["warmup_compare"] = compare("universal", "warm-up")
    rounds = []
    for r in range(repeats):
        order = ("ucp", "universal") if r % 2 == 0 else ("universal", "ucp")
        rnd: dict[str, Any] = {"order": list(order)}
        for variant in order:
            rank_log(f"round {r + 1}/{repeats}: {variant}")
            rnd[variant] = one(variant)
            if loaded == {"ucp", "universal"}:
                rnd.setdefault("compare", []).append(
                    compare(variant, f"round {r + 1} after {variant}")
                )
        rounds.append(rnd)
    out["rounds"] = rounds
    out["target_bytes_all"] = target_all
    out["failures"] = failures
    return out


def _pattern_specs(ckpt: Path) -> list[list[Any]]:
    """[key, shape, role] of every fp32 weight and Adam moment the DeepSpeed checkpoint offers."""
    from ucp_dcp import UCPStorageReader

    md = UCPStorageReader(ckpt).read_metadata().state_dict_metadata
    specs = []
    for key, m in md.items():
        if not (key.startswith("model.") or key.endswith((".exp_avg", ".exp_avg_sq"))):
            continue
        assert m.properties.dtype == torch.float32, (key, m.properties.dtype)
        specs.append([key, list(m.size), pattern_role(key)])
    return sorted(specs)


def _pattern_picks(specs: list[list[Any]]) -> list[str]:
    """One fused QKV, one SwiGLU, one averaged norm, each with both moments (the first block)."""
    names = [
        "1.self_attention.query_key_value.weight",
        "1.mlp.dense_h_to_4h.weight",
        "1.input_layernorm.weight",
    ]
    keys = {s[0] for s in specs}
    picks = [
        k
        for n in names
        for k in (f"model.{n}", f"optim.state.{n}.exp_avg", f"optim.state.{n}.exp_avg_sq")
    ]
    missing = [k for k in picks if k not in keys]
    assert not missing, missing
    return picks


def _pattern_tables(res: dict[str, Any]) -> str:
    """The markdown tables: bytes per rank, times per round, the summary."""
    bt = []
    for r in res["bytes_per_rank"]:
        d, z = r["default"], r["gap_bytes=0"]
        bt.append(
            [
                r["rank"],
                f"{d['target'] / MB:.2f}",
                f"{d['requested'] / MB:.2f}",
                _x(d["ratio"]),
                f"{z['requested'] / MB:.2f}",
                _x(z["ratio"]),
                f"{r['full_target'] / MB:.2f}",
                f"{r['full_requested'] / MB:.2f}",
                _x(r["full_ratio"]),
                _x(r["full_ratio_gap0"]),
            ]
        )
    md = markdown_table(
        [
            "rank",
            "fused pieces MB",
            "requested MB",
            "ratio",
            "requested MB (gap_bytes=0)",
            "ratio (gap_bytes=0)",
            "whole state: pieces MB",
            "requested MB",
            "ratio",
            "ratio (gap_bytes=0, per-role loads)",
        ],
        bt,
    )
    rt = []
    for role, what in (
        ("fused", "QKV + SwiGLU, Shard(0)"),
        ("row", "dense + dense_4h_to_h, Shard(1)"),
        ("averaged", "RMSNorms, replicated (mean of the TP slices)"),
        ("other", "embedding + output layer, Shard(0)"),
    ):
        d0 = [r["by_role"]["default"][role] for r in res["bytes_per_rank"]]
        z0 = [r["by_role"]["gap_bytes=0"][role] for r in res["bytes_per_rank"]]
        rt.append(
            [
                role,
                what,
                d0[0]["tensors"],
                f"{sum(x['target'] for x in d0) / MB:.2f}",
                f"{sum(x['requested'] for x in d0) / MB:.2f}",
                _x(max(x["ratio"] for x in d0)),
                f"{sum(x['requested'] for x in z0) / MB:.2f}",
                _x(max(x["ratio"] for x in z0)),
            ]
        )
    md += "\n\n" + markdown_table(
        [
            "role",
            "tensors (with moments)",
            "n",
            "pieces MB (all ranks)",
            "requested MB",
            "worst rank",
            "requested MB (gap_bytes=0)",
            "worst rank (gap_bytes=0)",
        ],
        rt,
    )
    tt = []
    for i, rnd in enumerate(res["rounds"]):
        tt.append(
            [
                i + 1,
                " then ".join(rnd["order"]),
                _s(rnd["ucp_seconds"]),
                _s(rnd["convert_seconds"]),
                _s(rnd["universal_load_seconds"]),
                _s(rnd["universal_total_seconds"]),
                _x(rnd["ratio"]),
                _mb(rnd["ucp_read_bytes"]),
                f"{_mb(rnd['convert']['read_bytes'])} + {_mb(rnd['universal_read_bytes'])}",
                " ".join(rnd["loadavg"] or []),
            ]
        )
    s = res["summary"]
    tt.append(
        [
            "median",
            "",
            _s(s["ucp_seconds"]),
            _s(s["convert_seconds"]),
            _s(s["universal_load_seconds"]),
            _s(s["universal_total_seconds"]),
            _x(s["ratio"]),
            _mb(s["ucp_read_bytes"]),
            f"{_mb(s['convert_read_bytes'])} + {_mb(s['universal_read_bytes'])}",
            "",
        ]
    )
    md += "\n\n" + markdown_table(
        [
            "round",
            "order",
            "(a) ucp in place s",
            "ds_to_universal s",
            "universal load s",
            "(b) total s",
            "(b)/(a)",
            "(a) read MB",
            "(b) read MB (convert + load)",
            "load average",
        ],
        tt,
    )
    return md


def patterns_main(args: argparse.Namespace) -> int:
    """--patterns: every ds_to_universal merge rule in a TP x DP ZeRO-1 Llama, in place vs
    ds_to_universal + load."""
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_ds_patterns_", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_before = loadavg()
    hidden = 256 if args.quick and args.hidden == 1024 else args.hidden
    d = patterns_dims(args.size_mb, hidden, args.tp)
    ckpt, uni = work / "ds", work / "universal"
    try:
        log(
            f"setup: DeepSpeed TP={args.tp} x DP={args.ds_dp} ZeRO-1 fp32 on "
            f"{args.tp * args.ds_dp} ranks: Llama hidden {hidden}, {d['layers']} block(s), GQA "
            f"{d['heads']}/{d['kv_heads']} heads of {d['head_dim']}, SwiGLU {d['ffn']}, "
            f"vocabulary {d['vocab']} padded to {d['padded_vocab']}"
        )
        _torchrun(
            ckpt,
            args.tp * args.ds_dp,
            "--patterns-worker",
            str(ckpt),
            "--patterns-dims",
            json.dumps(d),
            "--ds-dp",
            str(args.ds_dp),
        )
        evict_tree(ckpt)
        tag_dir = ckpt / TAG
        specs = _pattern_specs(ckpt)
        picks = _pattern_picks(specs)
        roles: dict[str, int] = {}
        for _, _, role in specs:
            roles[role] = roles.get(role, 0) + 1
        setup = {
            "dims": d,
            "universal_checkpoint_info": json.loads(json.dumps(patterns_info(d))),
            "tp": args.tp,
            "dp": args.ds_dp,
            "zero_stage": 1,
            "dtype": "float32",
            "ds_checkpoint_bytes": dir_bytes(ckpt),
            "ds_files": sorted(f.name for f in tag_dir.iterdir()),
            "tensors": len(specs),
            "tensors_by_role": roles,
            "state_bytes": sum(4 * math.prod(s[1]) for s in specs),
            "fused_state_bytes": sum(4 * math.prod(s[1]) for s in specs if s[2] == "fused"),
            "placements": {
                "fused": "Shard(0)",
                "row": "Shard(1)",
                "averaged": "Replicate()",
                "other": "Shard(0)",
            },
            "load_world": args.world,
            "picks": picks,
        }
        log(
            f"setup: DeepSpeed checkpoint {setup['ds_checkpoint_bytes'] / MB:.0f} MB in "
            f"{len(setup['ds_files'])} files; {len(specs)} tensors "
            f"({setup['state_bytes'] / MB:.0f} MB) to load, "
            f"{setup['fused_state_bytes'] / MB:.0f} MB of them fused"
        )
        conv_cmd = GEN.ds_to_universal_cmd(tag_dir, uni / f"{TAG}_universal", args.convert_workers)
        log(
            f"loads on {args.world} ranks: fused-tensor bytes, then {args.repeats} cold "
            "round(s) of "
            "(a) in place and (b) ds_to_universal + load, alternating"
            + ("" if args.no_warmup else ", after a warm-up")
        )
        per_rank = spawn_ranks(
            patterns_rank_main,
            args.world,
            specs,
            picks,
            str(ckpt),
            str(uni),
            conv_cmd,
            args.repeats,
            not args.no_warmup,
            timeout_min=30,
        )
        conv_disk = dir_bytes(uni)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    failures = sorted({f for r in per_rank for f in r["failures"]})
    for r in per_rank:
        for label, roles_ in r["role_bytes"].items():
            for role, rec in roles_.items():
                failures += [
                    f"{role}-only load ({label}), rank {r['rank']}: {k} not filled"
                    for k in rec["unfilled"]
                ]
    bytes_rows = []
    over = []
    for r in per_rank:
        full_req = median([rnd["ucp"]["bytes_requested"] for rnd in r["rounds"]])
        fused_ = {label: r["role_bytes"][label]["fused"] for label in r["role_bytes"]}
        row = {
            "rank": r["rank"],
            **{
                k: {kk: vv for kk, vv in v.items() if kk != "per_tensor"} for k, v in fused_.items()
            },
            "per_tensor": {k: v["per_tensor"] for k, v in fused_.items()},
            "by_role": {
                label: {
                    role: {kk: vv for kk, vv in rec.items() if kk != "per_tensor"}
                    for role, rec in roles_.items()
                }
                for label, roles_ in r["role_bytes"].items()
            },
            "full_target": r["target_bytes_all"],
            "full_requested": full_req,
            "full_ratio": ratio(full_req, r["target_bytes_all"]),
            # The whole state with gap_bytes=0: the sum of the per-role loads (not one load).
            "full_requested_gap0": sum(
                rec["requested"] for rec in r["role_bytes"]["gap_bytes=0"].values()
            ),
        }
        row["full_ratio_gap0"] = ratio(row["full_requested_gap0"], r["target_bytes_all"])
        bytes_rows.append(row)
        for label, pt in row["per_tensor"].items():
            for key, v in pt.items():
                if v["requested"] > 1.05 * v["target"]:
                    over.append(
                        f"rank {r['rank']} ({label}): {key}: {v['requested']} bytes requested "
                        f"for {v['target']} bytes of pieces"
                    )
    rounds = []
    for i in range(args.repeats):
        rs = [r["rounds"][i] for r in per_rank]
        a = max(x["ucp"]["seconds"] for x in rs)
        load_b = max(x["universal"]["seconds"] for x in rs)
        conv = rs[0]["universal"]["convert"]
        rounds.append(
            {
                "order": rs[0]["order"],
                "ucp_seconds": a,
                "convert_seconds": conv["seconds"],
                "universal_load_seconds": load_b,
                "universal_total_seconds": conv["seconds"] + load_b,
                "ratio": ratio(conv["seconds"] + load_b, a),
                "loadavg": rs[0]["ucp"]["loadavg"],
                "ucp_read_bytes": sum(x["ucp"]["read_bytes"] for x in rs),
                "universal_read_bytes": sum(x["universal"]["read_bytes"] for x in rs),
                "convert": conv,
                "per_rank": [
                    {
                        "ucp": x["ucp"],
                        "universal": {k: v for k, v in x["universal"].items() if k != "convert"},
                    }
                    for x in rs
                ],
            }
        )
    summary: dict[str, Any] = {
        k: median([rnd[k] for rnd in rounds])
        for k in (
            "ucp_seconds",
            "convert_seconds",
            "universal_load_seconds",
            "universal_total_seconds",
            "ratio",
            "ucp_read_bytes",
            "universal_read_bytes",
        )
    }
    summary["convert_read_bytes"] = median([rnd["convert"]["read_bytes"] for rnd in rounds])
    summary["convert_peak_bytes"] = median([rnd["convert"]["peak_bytes"] for rnd in rounds])
    summary["convert_disk_bytes"] = conv_disk
    summary["fused_ratio_max"] = {
        label: max(r[label]["ratio"] for r in bytes_rows) for label in ("default", "gap_bytes=0")
    }
    summary["bit_exact"] = not [f for f in failures if "differ" in f]
    summary["compared"] = (
        "every tensor's local shard on every rank, and the full tensors of: " + ", ".join(picks)
    )
    summary["targets"] = {"fused_bytes_ratio_max": 1.05, "time_ratio_min": 10.0}
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started": started,
        **_environment(work),
        "loadavg_before_after": [load_before, loadavg()],
        "args": {
            k: v
            for k, v in vars(args).items()
            if k not in ("ds_worker", "pipe_worker", "patterns_worker", "patterns_dims", "layers")
        },
        "setup": setup,
        "bytes_per_rank": bytes_rows,
        "over_reading": over,
        "rounds": rounds,
        "summary": summary,
        "warmup_compare": [r.get("warmup_compare") for r in per_rank],
        "failures": failures,
    }
    md = _pattern_tables(result)
    result["table"] = md
    print()
    print(md)
    print(
        "\nfused tensors: requested / pieces, worst rank: "
        f"{_x(summary['fused_ratio_max']['default'])} "
        f"(gap_bytes=0: {_x(summary['fused_ratio_max']['gap_bytes=0'])}); target <= 1.05x"
    )
    print(
        f"(b)/(a): {_x(summary['ratio'])} (median of {args.repeats}); target >= 10x; "
        f"bit-exact: {summary['bit_exact']}; load average before {load_before}, after {loadavg()}"
    )
    for line in over:
        print(f"  over-reading: {line}")
    path = write_json(args.out, result)
    print(f"\nresults: {path}")
    print_failures(failures, bar=True)
    return 1 if failures else 0


# ---------------------------------------------------------------- main


_VERBOSE = False


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=float, default=None,
                   help="DeepSpeed state (fp32 weights + 2 Adam moments), default 280 (30 with "
                   "--quick); --patterns: the checkpoint on disk, default 320 (40 with --quick)")
    p.add_argument("--hidden", type=int, default=1024, help="Linear width of the DeepSpeed model (default 1024)")
    p.add_argument("--hf-size-mb", type=float, default=None,
                   help="fp32 weights of the Hugging Face Llama, default 150 (20 with --quick)")
    p.add_argument("--hf-shard-mb", type=int, default=50, help="save_pretrained max_shard_size in MB (default 50)")
    p.add_argument("--ds-world", type=int, default=2, help="DeepSpeed ranks that write the checkpoint (default 2)")
    p.add_argument("--world", type=int, default=None,
                   help="ranks that load (default 3; 4 with --patterns)")
    p.add_argument("--convert-workers", type=int, default=os.cpu_count() or 1,
                   help="ds_to_universal --num_extract_workers/--num_merge_workers (default: CPU count)")
    p.add_argument("--repeats", type=int, default=None, help="cold timed rounds of the loads (default 3, 1 with --quick)")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up round of loads")
    p.add_argument("--quick", action="store_true", help="small smoke run")
    p.add_argument("--workdir", default=None, help="where checkpoints go (disk-backed; default a fresh /tmp dir)")
    p.add_argument("--keep", action="store_true", help="keep the workdir")
    p.add_argument("--verbose", action="store_true", help="progress lines from the ranks and DeepSpeed output")
    p.add_argument("--out", default=None, help="result JSON (default benchmarks/results/deepspeed.json; "
                   "out/bench_deepspeed_quick.json with --quick)")
    p.add_argument("--pipeline", action="store_true",
                   help="instead: a PP=2 x DP=--ds-dp ZeRO-1 checkpoint, in place vs "
                   "ds_to_universal, into one process and into FSDP2 on --world ranks (0: none)")
    p.add_argument("--ds-dp", type=int, default=2,
                   help="--pipeline: data-parallel ranks per stage (default 2)")
    p.add_argument("--universal-reader", choices=("torch", "ucp"), default="torch",
                   help="--pipeline: read the universal folder with torch.load per file "
                   "(default) or ucp_dcp")
    p.add_argument("--patterns", action="store_true",
                   help="instead: a Megatron-DeepSpeed-style Llama on TP=--tp x DP=--ds-dp "
                   "ZeRO-1 with every ds_to_universal merge rule; bytes each rank reads of the "
                   "fused QKV/SwiGLU re-cut to --world ranks, and in place vs "
                   "ds_to_universal + load")
    p.add_argument("--tp", type=int, default=2,
                   help="--patterns: tensor-parallel degree of the save (default 2)")
    p.add_argument("--ds-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--patterns-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--patterns-dims", default=None, help=argparse.SUPPRESS)
    p.add_argument("--pipe-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.size_mb is None:
        if args.patterns:
            args.size_mb = 40.0 if args.quick else 320.0
        else:
            args.size_mb = 30.0 if args.quick else 280.0
    if args.world is None:
        args.world = 4 if args.patterns else 3
    if args.hf_size_mb is None:
        args.hf_size_mb = 20.0 if args.quick else 150.0
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.out is None:
        name = ("deepspeed_patterns" if args.patterns
                else "deepspeed_pipeline" if args.pipeline else "deepspeed")
        args.out = default_out(f"{name}.json", args.quick, f"bench_{name}_quick.json")
    return args


def _environment(work: Path) -> dict[str, Any]:
    """Machine and versions, for the result JSON."""
    import deepspeed

    machine: dict[str, Any] = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "fs": fs_type(str(work)),
        "read_ahead_kb": None,
    }
    try:
        machine["read_ahead_kb"] = read_ahead_kb(str(REPO))
    except OSError:
        pass
    return {
        "machine": machine,
        "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__},
    }


def pipeline_main(args: argparse.Namespace) -> int:
    """--pipeline: a PP=2 x DP ZeRO-1 checkpoint in place vs ds_to_universal + load."""
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_ds_pipe_", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_before = loadavg()
    try:
        layers = stack_layers(args.size_mb, args.hidden)
        ckpt, uni = work / "ds", work / "universal"
        log(
            f"setup: DeepSpeed PP=2 x DP={args.ds_dp} ZeRO-1 on {2 * args.ds_dp} ranks, "
            f"{layers} x Linear({args.hidden}, {args.hidden})"
        )
        write_pipeline_checkpoint(ckpt, args.hidden, layers, args.ds_dp)
        evict_tree(ckpt)
        tag_dir = ckpt / TAG
        setup = {
            "ds_layers": layers,
            "ds_hidden": args.hidden,
            "pp": 2,
            "dp": args.ds_dp,
            "zero_stage": 1,
            "ds_params": layers * (args.hidden * args.hidden + args.hidden),
            "ds_checkpoint_bytes": dir_bytes(ckpt),
            "ds_files": sorted(f.name for f in tag_dir.iterdir()),
        }
        log(
            f"setup: DeepSpeed checkpoint {setup['ds_checkpoint_bytes'] / MB:.0f} MB "
            f"in {len(setup['ds_files'])} files"
        )
        log("convert: ds_to_universal (cold)")
        conv = run_conversion(
            "ds_to_universal",
            GEN.ds_to_universal_cmd(tag_dir, uni / f"{TAG}_universal", args.convert_workers),
            ckpt,
            uni,
        )
        (uni / "latest_universal").write_text(f"{TAG}_universal")
        conv["import_floor_bytes"] = import_floor("deepspeed.checkpoint.ds_to_universal")
        conv["peak_extra_bytes"] = max(0, conv["peak_bytes"] - conv["import_floor_bytes"])
        convs = {"pp_ds_to_universal": conv}
        jobs = [
            {"name": "pp_ucp", "path": str(ckpt)},
            {"name": "pp_ds_to_universal", "path": str(uni)},
        ]
        log(
            f"loads in one process: {args.repeats} paired cold round(s)"
            + ("" if args.no_warmup else " after a warm-up")
        )
        per_rank = spawn_ranks(
            rank_main,
            1,
            jobs,
            {"hidden": args.hidden, "layers": layers, "universal_reader": args.universal_reader},
            None,
            str(work / "reference.safetensors"),
            args.repeats,
            not args.no_warmup,
            timeout_min=30,
        )
        loads = {
            j["name"]: [[per_rank[0][j["name"]][i]] for i in range(args.repeats)] for j in jobs
        }
        if args.world > 0:
            jobs = [
                {"name": "pp_ucp_fsdp2", "path": str(ckpt)},
                {"name": "pp_ds_to_universal_fsdp2", "path": str(uni)},
            ]
            log(f"loads into FSDP2 on {args.world} ranks: {args.repeats} paired cold round(s)")
            per_rank = spawn_ranks(
                rank_main,
                args.world,
                jobs,
                {
                    "hidden": args.hidden,
                    "layers": layers,
                    "universal_reader": args.universal_reader,
                },
                None,
                str(work / "reference.safetensors"),
                args.repeats,
                not args.no_warmup,
                timeout_min=30,
            )
            loads.update(
                {
                    j["name"]: [
                        [per_rank[r][j["name"]][i] for r in range(args.world)]
                        for i in range(args.repeats)
                    ]
                    for j in jobs
                }
            )
        failures = sorted(
            {f for reps in loads.values() for ranks in reps for r in ranks for f in r["failures"]}
        )
        rows = summarise(loads, convs)
        if args.universal_reader == "ucp":
            for uni_row in ("pp_ds_to_universal", "pp_ds_to_universal_fsdp2"):
                if uni_row in rows:
                    rows[uni_row]["label"] = "ds_to_universal + load (ucp_dcp universal source)"
        for uni_row, ucp_row in (
            ("pp_ds_to_universal", "pp_ucp"),
            ("pp_ds_to_universal_fsdp2", "pp_ucp_fsdp2"),
        ):
            if (
                uni_row in rows
            ):  # per round: the universal load against the in-place load of the same round
                rows[uni_row]["load_vs_ucp_per_round"] = [
                    ratio(max(r["seconds"] for r in u), max(r["seconds"] for r in p))
                    for u, p in zip(loads[uni_row], loads[ucp_row])
                ]
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    md = table(rows)
    print()
    print(md)
    print(
        f"ds_to_universal: peak PSS of the process tree {conv['peak_bytes'] / MB:.0f} MB, of which "
        f"{conv['import_floor_bytes'] / MB:.0f} MB a process importing it alone; "
        f"{conv['read_bytes'] / MB:.0f} MB read, {conv['disk_bytes'] / MB:.0f} MB written"
    )
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started": started,
        **_environment(work),
        "loadavg_before_after": [load_before, loadavg()],
        "args": {
            k: v for k, v in vars(args).items()
            if k not in ("ds_worker", "pipe_worker", "patterns_worker", "patterns_dims", "layers")
        },
        "setup": setup,
        "conversions": convs,
        "rows": rows,
        "loads_per_rank": loads,
        "table": md,
        "failures": failures,
    }
    path = write_json(args.out, result)
    print(f"\nresults: {path}")
    print_failures(failures, bar=True)
    return 1 if failures else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Set up, convert, load, report; non-zero exit on a tensor that differs from the source."""
    global _VERBOSE
    args = parse_args(argv)
    if args.ds_worker:
        ds_worker(Path(args.ds_worker), args.hidden, args.layers)
        return 0
    if args.pipe_worker:
        pipe_worker(Path(args.pipe_worker), args.hidden, args.layers, args.ds_dp)
        return 0
    if args.patterns_worker:
        patterns_worker(Path(args.patterns_worker), json.loads(args.patterns_dims), args.ds_dp)
        return 0
    _VERBOSE = args.verbose
    for mod in ("deepspeed",) if args.pipeline or args.patterns else ("deepspeed", "transformers"):
        if importlib.util.find_spec(mod) is None:
            print(f"bench_deepspeed needs {mod} (not a dependency of ucp_dcp): run it with a venv that has it, "
                  "e.g. DS_ACCELERATOR=cpu .venv-ds/bin/python benchmarks/bench_deepspeed.py", file=sys.stderr)
            return 2
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    set_rank_env(args.verbose)
    if args.patterns:
        return patterns_main(args)
    if args.pipeline:
        return pipeline_main(args)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_ds_", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_before = loadavg()  # a shared machine: how busy it was says how far to trust the times
    try:
        layers = stack_layers(args.size_mb, args.hidden)
        ckpt, hf_dir = work / "ds", work / "hf"
        log(f"setup: DeepSpeed ZeRO-3 on {args.ds_world} ranks, {layers} x Linear({args.hidden}, {args.hidden})")
        write_deepspeed_checkpoint(ckpt, args.hidden, layers, args.ds_world)
        evict_tree(ckpt)
        cfg = llama_config(args.hf_size_mb)
        log(f"setup: Hugging Face Llama ({cfg.num_hidden_layers} layers) save_pretrained")
        hf_params = write_hf_model(hf_dir, args.hf_size_mb, args.hf_shard_mb)
        evict_tree(hf_dir)
        setup = {"ds_layers": layers, "ds_hidden": args.hidden,
                 "ds_params": layers * (args.hidden * args.hidden + args.hidden),
                 "ds_checkpoint_bytes": dir_bytes(ckpt), "hf_params": hf_params, "hf_bytes": dir_bytes(hf_dir),
                 "hf_files": len(list(hf_dir.glob("*.safetensors")))}
        log(f"setup: DeepSpeed checkpoint {setup['ds_checkpoint_bytes'] / MB:.0f} MB, "
            f"HF directory {setup['hf_bytes'] / MB:.0f} MB in {setup['hf_files']} files")

        convs: dict[str, dict[str, Any]] = {}
        uni = work / "universal"
        log("convert: ds_to_universal (cold)")
        convs["ds_to_universal"] = run_conversion(
            "ds_to_universal", GEN.ds_to_universal_cmd(ckpt / TAG, uni / f"{TAG}_universal", args.convert_workers),
            ckpt, uni)
        (uni / "latest_universal").write_text(f"{TAG}_universal")
        fp32 = work / "fp32"
        log("convert: zero_to_fp32 (cold)")
        convs["zero_to_fp32"] = run_conversion(
            "zero_to_fp32", [sys.executable, "-m", "deepspeed.utils.zero_to_fp32", str(ckpt), str(fp32),
                             "--safe_serialization"], ckpt, fp32)
        floors = {"ds_to_universal": import_floor("deepspeed.checkpoint.ds_to_universal"),
                  "zero_to_fp32": import_floor("deepspeed.utils.zero_to_fp32")}
        for name, c in convs.items():
            c["import_floor_bytes"] = floors[name]
            c["peak_extra_bytes"] = max(0, c["peak_bytes"] - floors[name])

        jobs = [{"name": "ucp", "path": str(ckpt)}, {"name": "ds_to_universal", "path": str(uni)},
                {"name": "ucp_weights", "path": str(ckpt)}, {"name": "zero_to_fp32", "path": str(fp32)},
                {"name": "hf_ucp", "path": str(hf_dir)}, {"name": "hf_dcp", "path": str(hf_dir)}]
        log(f"loads on {args.world} ranks: {args.repeats} cold round(s)" + ("" if args.no_warmup else " after a warm-up"))
        per_rank = spawn_ranks(rank_main, args.world, jobs, {"hidden": args.hidden, "layers": layers},
                               cfg.to_dict(), str(work / "reference.safetensors"), args.repeats,
                               not args.no_warmup, timeout_min=30)
        loads = {j["name"]: [[per_rank[r][j["name"]][i] for r in range(args.world)] for i in range(args.repeats)]
                 for j in jobs}
        failures = sorted({f for reps in loads.values() for ranks in reps for r in ranks for f in r["failures"]})
        rows = summarise(loads, convs)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    md = table(rows)
    print()
    print(md)
    for name, c in convs.items():
        print(f"{name}: peak PSS of the process tree {c['peak_bytes'] / MB:.0f} MB, of which "
              f"{c['import_floor_bytes'] / MB:.0f} MB a process importing it alone; "
              f"{c['read_bytes'] / MB:.0f} MB read, {c['disk_bytes'] / MB:.0f} MB written")
    import deepspeed

    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started": started,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "fs": fs_type(str(work)),
                    "read_ahead_kb": None},
        "loadavg_before_after": [load_before, loadavg()],
        "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
                     "transformers": importlib.import_module("transformers").__version__},
        "args": {k: v for k, v in vars(args).items()
                 if k not in ("ds_worker", "pipe_worker", "patterns_worker", "patterns_dims",
                              "layers")},
        "setup": setup,
        "conversions": convs,
        "import_floor_bytes": floors,
        "rows": rows,
        "loads_per_rank": loads,
        "table": md,
        "failures": failures,
    }
    try:
        result["machine"]["read_ahead_kb"] = read_ahead_kb(str(REPO))
    except OSError:
        pass
    path = write_json(args.out, result)
    print(f"\nresults: {path}")
    print_failures(failures, bar=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
