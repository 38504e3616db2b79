"""Save a Megatron-style model under TP 2 x PP 2, load it under other TP x PP layouts.

What this shows
---------------
Megatron-style state is not made of DTensors: each tensor-parallel rank
holds a fused QKV weight (per KV-head group: its query heads, its key head,
its value head), a fused SwiGLU ``gate_up`` weight, column slices of the
row-parallel ``o``/``down`` weights, and a vocabulary embedding and output
head padded to a multiple of ``4 * tp`` rows; every pipeline stage numbers
its own layers from 0. A :class:`ucp_dcp.LayoutSpec` says so in
six rules, and the checkpoint then holds canonical tensors
(``model.layers.3.attn.k.weight``, 37 vocabulary rows) that any other layout
loads through its own spec.

The driver spawns 4 CPU ranks (gloo) that save the model as TP 2 x PP 2,
then load it as TP 1 x PP 1 (rank 0 alone), TP 3 x PP 1 (ranks 0-2),
TP 4 x PP 1 and TP 1 x PP 4 (all 4), each target's ranks loading through a process group of
their own (``dcp.load(..., process_group=...)``), as a separate job would.
Every loaded rank compares each piece with the same box of the reference
model and reports the max abs difference per logical tensor, and of the
padding rows against 0 (the saved padding held NaN). It prints a table and exits
non-zero if anything differs.

Run it
------
    python examples/layout_demo.py        # ~20 s on 2 CPU cores
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from ucp_dcp import UCPLoadPlanner, UCPSavePlanner, UCPStorageReader, UCPStorageWriter
from ucp_dcp import Fused, LayoutSpec, Reindex, Replicated, Shard, VocabPad
from ucp_dcp.core.pieces import TensorPieces

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 37, 16, 24, 12, 1, 24, 4  # TP 1, 2, 3, 4 all divide
PAD_MULTIPLE = 4  # vocabulary padded to a multiple of 4 * tp rows (Megatron: 128 * tp)
SAVE = (2, 2)  # (tp, pp)
TARGETS = [(1, 1), (3, 1), (4, 1), (1, 4)]


# ----------------------------------------------------------------------------
# The model: a reference of full tensors, and what one rank holds of it
# ----------------------------------------------------------------------------


def reference() -> dict[str, torch.Tensor]:
    """Full, unfused tensors under global names."""
    g = torch.Generator().manual_seed(0)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes = {"embed.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        shapes.update({
            p + "input_norm.weight": (HIDDEN,), p + "attn.q.weight": (q, HIDDEN),
            p + "attn.k.weight": (kv, HIDDEN), p + "attn.v.weight": (kv, HIDDEN), p + "attn.o.weight": (HIDDEN, q),
            p + "post_norm.weight": (HIDDEN,), p + "mlp.gate.weight": (FFN, HIDDEN),
            p + "mlp.up.weight": (FFN, HIDDEN), p + "mlp.down.weight": (HIDDEN, FFN),
        })
    shapes.update({"final_norm.weight": (HIDDEN,), "head.weight": (VOCAB, HIDDEN)})
    return {k: torch.randn(*s, generator=g) for k, s in shapes.items()}


def stage_layers(pp: int, stage: int) -> range:
    per = LAYERS // pp
    return range(stage * per, (stage + 1) * per)


def local_tensors(ref: dict[str, torch.Tensor], tp_rank: int, tp: int, stage: int, pp: int,
                  pad: float) -> dict[str, torch.Tensor]:
    """What rank (tp_rank, stage) holds: Megatron's fused/padded/stage-local tensors."""
    out: dict[str, torch.Tensor] = {}
    qpg, hd, groups, f = HEADS // KV_HEADS, HEAD_DIM, KV_HEADS // tp, FFN // tp
    padded = -(-VOCAB // (PAD_MULTIPLE * tp)) * PAD_MULTIPLE * tp
    rows = padded // tp

    def vocab(t: torch.Tensor) -> torch.Tensor:
        full = torch.full((padded, HIDDEN), pad)
        full[:VOCAB] = t
        return full[tp_rank * rows : (tp_rank + 1) * rows].clone()

    if stage == 0:
        out["embed.weight"] = vocab(ref["embed.weight"])
    for local, i in enumerate(stage_layers(pp, stage)):
        s, d = f"layers.{i}.", f"layers.{local}."
        q, k, v = (ref[f"{s}attn.{n}.weight"] for n in "qkv")
        out[d + "attn.qkv.weight"] = torch.cat([
            blk for g in range(tp_rank * groups, (tp_rank + 1) * groups)
            for blk in (q[g * qpg * hd : (g + 1) * qpg * hd], k[g * hd : (g + 1) * hd], v[g * hd : (g + 1) * hd])
        ])
        cols = HEADS * hd // tp
        out[d + "attn.o.weight"] = ref[s + "attn.o.weight"][:, tp_rank * cols : (tp_rank + 1) * cols].clone()
        mine = slice(tp_rank * f, (tp_rank + 1) * f)  # this rank's gate rows, then its up rows
        out[d + "mlp.gate_up.weight"] = torch.cat([ref[s + "mlp.gate.weight"][mine], ref[s + "mlp.up.weight"][mine]])
        out[d + "mlp.down.weight"] = ref[s + "mlp.down.weight"][:, tp_rank * f : (tp_rank + 1) * f].clone()
        out[d + "input_norm.weight"] = ref[s + "input_norm.weight"].clone()
        out[d + "post_norm.weight"] = ref[s + "post_norm.weight"].clone()
    if stage == pp - 1:
        out["final_norm.weight"] = ref["final_norm.weight"].clone()
        out["head.weight"] = vocab(ref["head.weight"])
    return out


def layout(tp_rank: int, tp: int, stage: int, pp: int) -> LayoutSpec:
    """The whole layout language needed for this model."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    return LayoutSpec(
        [
            Reindex(r"layers\.(\d+)\.", offset=stage_layers(pp, stage)[0]),  # stage-local -> global
            Fused(r"\.qkv\.", dim=0, parts={".q.": q, ".k.": kv, ".v.": kv}, groups=KV_HEADS, axis="tp"),
            Fused(r"\.gate_up\.", dim=0, parts={".gate.": FFN, ".up.": FFN}, axis="tp"),
            Shard(r"\.(o|down)\.weight", dim=1, axis="tp"),
            VocabPad(r"(embed|head)\.weight", dim=0, size=VOCAB, axis="tp", optional=True),
            Replicated(r"norm", axis="tp"),
        ],
        axes={"tp": (tp_rank, tp)},
    )


# ----------------------------------------------------------------------------
# Ranks
# ----------------------------------------------------------------------------


def _load_and_compare(rank: int, tp: int, pp: int, path: str, group: dist.ProcessGroup) -> dict[str, float]:
    """Load as rank ``rank`` of TP ``tp`` x PP ``pp`` into garbage-filled tensors; max abs diff per tensor."""
    tp_rank, stage = rank % tp, rank // tp
    ref = reference()
    spec = layout(tp_rank, tp, stage, pp)
    garbage = {k: torch.full_like(v, 1e6) for k, v in local_tensors(ref, tp_rank, tp, stage, pp, 0.0).items()}
    sd = {"model": garbage, "step": 0}
    applied = spec.apply(sd)
    dcp.load(applied, storage_reader=UCPStorageReader(path), planner=UCPLoadPlanner(), process_group=group)
    spec.update_values(sd, applied)  # the step counter landed in `applied`; tensors loaded in place
    diffs: dict[str, float] = defaultdict(float)
    for obj in applied["model"].values():
        assert isinstance(obj, TensorPieces)
        for p in obj.pieces:  # each piece: a box of a logical tensor, viewing the loaded local tensor
            name = p.fqn.removeprefix("model.")
            want = ref[name]
            for d, (o, n) in enumerate(zip(p.offsets, p.data.shape)):
                want = want.narrow(d, o, n)
            diffs[name] = max(diffs[name], (p.data - want).abs().max().item())
        for f in obj.fill:  # padding rows
            diffs["(padding rows vs 0)"] = max(diffs["(padding rows vs 0)"], f.abs().max().item())
    diffs["(step counter vs 100)"] = abs(sd["step"] - 100)
    return dict(diffs)


def _rank(rank: int, world: int, init: str, path: str, result: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        t0 = time.time()
        tp, pp = SAVE
        tp_rank, stage = rank % tp, rank // tp
        # Padding rows hold NaN: they must not reach the checkpoint.
        sd = {"model": local_tensors(reference(), tp_rank, tp, stage, pp, pad=float("nan")), "step": 100}
        spec = layout(tp_rank, tp, stage, pp)
        dcp.save(spec.apply(sd, record=True), storage_writer=UCPStorageWriter(path), planner=UCPSavePlanner())
        if rank == 0:
            print(f"saved as TP {tp} x PP {pp} ({world} ranks) in {time.time() - t0:.1f}s", flush=True)
        columns: dict[str, dict[str, float]] = {}
        for tp, pp in TARGETS:
            # The first tp * pp ranks load as a world of their own (a process group); the others wait.
            n, t = tp * pp, time.time()
            group = dist.new_group(list(range(n)))
            diffs = _load_and_compare(rank, tp, pp, path, group) if rank < n else {}
            gathered: list[dict[str, float] | None] = [None] * world
            dist.all_gather_object(gathered, diffs)
            merged: dict[str, float] = defaultdict(float)
            for g in gathered:
                for k, v in (g or {}).items():
                    merged[k] = max(merged[k], v)
            columns[f"TP{tp}xPP{pp}"] = dict(merged)
            if rank == 0:
                print(f"loaded as TP {tp} x PP {pp} ({n} ranks) in {time.time() - t:.1f}s", flush=True)
        if rank == 0:
            torch.save(columns, result)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def main() -> int:
    t0 = time.time()
    tp, pp = SAVE
    world = max([tp * pp] + [t * p for t, p in TARGETS])
    with tempfile.TemporaryDirectory() as root:
        result = os.path.join(root, "result.pt")
        mp.spawn(_rank, args=(world, os.path.join(root, "init"), os.path.join(root, "ckpt"), result),
                 nprocs=world, join=True)
        columns: dict[str, dict[str, float]] = torch.load(result)
    names = sorted(set().union(*columns.values()), key=_order)
    width = max(len(n) for n in names)
    print(f"\nmax abs difference vs the reference, per logical tensor\n{'tensor':<{width}}  "
          + "  ".join(f"{c:>9}" for c in columns))
    bad = []
    for n in names:
        cells = []
        for c, col in columns.items():
            v = col.get(n)
            cells.append(f"{'-' if v is None else f'{v:.3g}':>9}")
            if v is None:
                bad.append(f"{n} not loaded under {c}")
            elif not v == 0:  # NaN too
                bad.append(f"{n} differs under {c}: {v}")
        print(f"{n:<{width}}  " + "  ".join(cells))
    print(f"\n{len(names)} rows, {time.time() - t0:.1f}s in all")
    if bad:
        print("FAILED:\n  " + "\n  ".join(bad))
        return 1
    print("OK: every layout loaded every tensor bit-exactly, padding rows zeroed")
    return 0


def _order(name: str) -> tuple[int, int, str]:
    parts = name.split(".")
    if name.startswith("("):
        return (3, 0, name)
    if parts[0] == "layers":
        return (1, int(parts[1]), name)
    return (0 if "embed" in name else 2, 0, name)


if __name__ == "__main__":
    sys.exit(main())
