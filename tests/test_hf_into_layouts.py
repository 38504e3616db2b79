"""A ``save_pretrained`` directory loaded straight into FSDP2 and into a Megatron-style TP layout.

No conversion: ``dcp.load`` reads the Hugging Face safetensors files
through ``UCPStorageReader`` with offset reads. A tiny real ``transformers``
Llama (hidden 64, ffn 96, 2 layers, 8 query / 4 KV heads, vocabulary 128,
untied head) is saved with ``max_shard_size="20KB"``, so its 21 tensors lie
in 14 files, some files holding several tensors. Every parameter is
re-drawn from a seeded normal before saving, so no two tensors (norms
included) hold the same bytes and a swapped or misplaced tensor cannot
pass.

- FSDP2 on 3 gloo ranks: ``fully_shard`` per decoder layer and on the
  model, keys from ``get_state_dict(model, optim)`` (``model.`` + the file's
  names, so ``prefix="model."``). Row shards are uneven (64 rows over 3 is
  22/22/20, 96 is 32 each, 128 is 43/43/42).
- Megatron-core names and layout on 2 of the ranks (TP 2): fused GQA
  ``linear_qkv`` (per KV group: its 2 query heads, its key head, its value
  head; 2 groups per rank, so the grouped order is not [q; k; v]), fused
  SwiGLU ``linear_fc1`` ([gate rows; up rows] of this rank), column-split
  ``linear_proj``/``linear_fc2``, the layer norms folded into the linear
  layers, and the embedding/output layer padded to 144 rows
  (``make_vocab_size_divisible_by=36`` times TP 2: 72 rows per rank, the
  last 16 of rank 1 padding). A :class:`LayoutSpec` maps it onto the file's names.
- One process, no process group: ``load_state_dict`` and
  ``dcp.load(..., no_dist=True)`` into the whole model and into one TP rank.

The expected tensors are read from the files by the ``safetensors``
package and cut by explicit arithmetic written independently of the layout
rules; every comparison is bit for bit. Each rank's reads are counted by
the reader's own accounting (``UCPStorageReader.bytes_requested``: every
byte asked of storage, gaps merged into a read included) and, separately,
by counting every byte ``os.pread``/``os.preadv`` return in the process,
safetensors headers included. "Needed" is the bytes of the file's tensors
the rank's destination holds: the local shards' bytes for FSDP2; for TP
the local tensors' bytes less the padding rows (which no file holds).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dist_utils import bit_equal, run_ranks
from ucp_dcp.byteio.rangeio import RangeReader
from ucp_dcp import CheckpointKeyError, LayoutSpec, load_state_dict, ReadOptions, UCPLoadPlanner, UCPStorageReader
from ucp_dcp import Fused, Rename, Replicated, Shard, VocabPad

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the model comes from a local config
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

CONFIG = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=32,
    tie_word_embeddings=False,
)
HEAD_DIM = CONFIG["hidden_size"] // CONFIG["num_attention_heads"]  # 8
TP = 2
VOCAB_DIVISOR = 36  # Megatron's make_vocab_size_divisible_by: at TP 2, 128 rows pad to a multiple of 72, 144
MAX_RATIO = 1.05


def _padded_vocab(tp: int) -> int:
    m = VOCAB_DIVISOR * tp
    return -(-CONFIG["vocab_size"] // m) * m


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sharded ``save_pretrained`` directory of a tiny Llama with every tensor random."""
    root = tmp_path_factory.mktemp("hf_layouts") / "llama"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():  # norms start as ones: make them distinct too
            p.copy_(torch.randn(p.shape, generator=g))
    model.save_pretrained(root, max_shard_size="20KB")
    files = sorted(f for f in os.listdir(root) if f.endswith(".safetensors"))
    assert (root / "model.safetensors.index.json").exists() and len(files) >= 10, files
    return root


def file_tensors(hf: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of the directory, read by the ``safetensors`` package (the reference)."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(hf)):
        if f.endswith(".safetensors"):
            out.update(safetensors_torch.load_file(os.path.join(hf, f)))
    return out


# ---------------------------------------------------------------- Megatron-style TP layout


def megatron_local(ref: dict[str, torch.Tensor], tp_rank: int, tp: int) -> tuple[dict[str, torch.Tensor], int]:
    """What TP rank ``tp_rank`` of ``tp`` holds under Megatron-core names, and its padding bytes.

    Explicit arithmetic (not the layout rules): GQA ``linear_qkv`` is, per
    KV group this rank owns, [that group's query heads; its key head; its
    value head]; ``linear_fc1`` is [this rank's gate rows; its up rows].
    """
    nq, nkv, hd = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"], HEAD_DIM
    qpg, ffn, vocab = nq // nkv, CONFIG["intermediate_size"], CONFIG["vocab_size"]
    groups, f = nkv // tp, ffn // tp
    out: dict[str, torch.Tensor] = {}
    pad_bytes = 0

    def padded(t: torch.Tensor) -> torch.Tensor:
        nonlocal pad_bytes
        rows = _padded_vocab(tp) // tp
        full = torch.zeros(_padded_vocab(tp), t.shape[1], dtype=t.dtype)
        full[:vocab] = t
        start = tp_rank * rows
        pad_bytes += max(0, start + rows - max(start, vocab)) * t.shape[1] * t.element_size()
        return full[start : start + rows].clone()

    out["embedding.word_embeddings.weight"] = padded(ref["model.embed_tokens.weight"])
    for i in range(CONFIG["num_hidden_layers"]):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = (ref[f"{hf}self_attn.{n}_proj.weight"] for n in "qkv")
        blocks = []
        for grp in range(tp_rank * groups, (tp_rank + 1) * groups):
            blocks += [q[grp * qpg * hd : (grp + 1) * qpg * hd], k[grp * hd : (grp + 1) * hd],
                       v[grp * hd : (grp + 1) * hd]]
        out[mg + "self_attention.linear_qkv.weight"] = torch.cat(blocks)
        out[mg + "self_attention.linear_qkv.layer_norm_weight"] = ref[hf + "input_layernorm.weight"].clone()
        cols = nq * hd // tp
        out[mg + "self_attention.linear_proj.weight"] = (
            ref[hf + "self_attn.o_proj.weight"][:, tp_rank * cols : (tp_rank + 1) * cols].clone())
        out[mg + "mlp.linear_fc1.weight"] = torch.cat(
            [ref[hf + "mlp.gate_proj.weight"][tp_rank * f : (tp_rank + 1) * f],
             ref[hf + "mlp.up_proj.weight"][tp_rank * f : (tp_rank + 1) * f]])
        out[mg + "mlp.linear_fc1.layer_norm_weight"] = ref[hf + "post_attention_layernorm.weight"].clone()
        out[mg + "mlp.linear_fc2.weight"] = (
            ref[hf + "mlp.down_proj.weight"][:, tp_rank * f : (tp_rank + 1) * f].clone())
    out["decoder.final_layernorm.weight"] = ref["model.norm.weight"].clone()
    out["output_layer.weight"] = padded(ref["lm_head.weight"])
    return out, pad_bytes


def megatron_spec(tp_rank: int, tp: int) -> LayoutSpec:
    """Megatron-core names and TP layout -> the Hugging Face file's tensors."""
    nq, nkv, hd = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"], HEAD_DIM
    ffn = CONFIG["intermediate_size"]
    return LayoutSpec(
        [
            # Names first (every Rename that matches applies, in order) ...
            Rename(r"^embedding\.word_embeddings\.", "model.embed_tokens."),
            Rename(r"^output_layer\.", "lm_head."),
            Rename(r"^decoder\.final_layernorm\.", "model.norm."),
            Rename(r"^decoder\.layers\.", "model.layers."),
            # Transformer Engine folds the pre-norms into the linear layers that follow them.
            Rename(r"self_attention\.linear_qkv\.layer_norm_weight$", "input_layernorm.weight"),
            Rename(r"mlp\.linear_fc1\.layer_norm_weight$", "post_attention_layernorm.weight"),
            Rename(r"self_attention\.linear_proj\.", "self_attn.o_proj."),
            Rename(r"mlp\.linear_fc2\.", "mlp.down_proj."),
            # ... then the first layout rule that matches cuts the tensor into pieces of the file's tensors.
            Fused(r"self_attention\.linear_qkv\.", dim=0, groups=nkv, axis="tp",
                  parts={"self_attn.q_proj.": nq * hd, "self_attn.k_proj.": nkv * hd,
                         "self_attn.v_proj.": nkv * hd}),
            Fused(r"linear_fc1\.", dim=0, parts={"gate_proj.": ffn, "up_proj.": ffn}, axis="tp"),
            Shard(r"(o_proj|down_proj)\.weight$", dim=1, axis="tp"),
            VocabPad(r"^(model\.embed_tokens|lm_head)\.weight$", dim=0, size=CONFIG["vocab_size"], axis="tp"),
            Replicated(r"norm", axis="tp"),
        ],
        axes={"tp": (tp_rank, tp)},
    )


# ---------------------------------------------------------------- counting reads

PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class Reads:
    """What one load read: the reader's own count, every byte the process read, and the pages touched."""

    requested: int = 0  # UCPStorageReader.bytes_requested: ranges asked of storage, merged gaps included
    everything: int = 0  # every byte os.pread/os.preadv returned, safetensors headers included
    pages: set[tuple[int, int, int]] = field(default_factory=set)  # (device, inode, page) touched


class _CountAllReads:
    """Counts every ``os.pread``/``os.preadv`` of this process while active, and the file pages they touch;
    and every span a reader copies out of a file mapped into memory (``RangeReader.read_mapped``: the
    span's pages are asked of storage)."""

    def __init__(self, reads: Reads) -> None:
        self.reads = reads
        self._lock = threading.Lock()  # the reader's I/O threads call preadv concurrently

    def _add(self, fd: int, off: int, n: int) -> None:
        st = os.fstat(fd)
        with self._lock:
            self.reads.everything += n
            first, last = off // PAGE, (off + n - 1) // PAGE
            self.reads.pages.update((st.st_dev, st.st_ino, p) for p in range(first, last + 1))

    def __enter__(self) -> "_CountAllReads":
        self._real = os.pread, os.preadv
        real_pread, real_preadv = self._real

        def pread(fd: int, n: int, off: int) -> bytes:
            data = real_pread(fd, n, off)
            self._add(fd, off, len(data))
            return data

        def preadv(fd: int, bufs: Any, off: int) -> int:
            n = real_preadv(fd, bufs, off)
            self._add(fd, off, n)
            return n

        os.pread, os.preadv = pread, preadv  # type: ignore[assignment]
        real_mapped = self._real_mapped = RangeReader.read_mapped
        counter = self

        def read_mapped(reader: RangeReader, file: int, spans: Any) -> bool:
            done = real_mapped(reader, file, spans)
            if done:
                for span in spans:
                    counter._add(reader.fd(file), span.start, span.nbytes)
            return done

        RangeReader.read_mapped = read_mapped  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        os.pread, os.preadv = self._real  # type: ignore[assignment]
        RangeReader.read_mapped = self._real_mapped  # type: ignore[method-assign]


def _counted_load(
    state: dict[str, Any], hf: str, prefix: str, gap_bytes: int | None = None, **load_kw: Any
) -> Reads:
    """``dcp.load`` from the Hugging Face directory, counting its reads."""
    reader = UCPStorageReader(hf, prefix=prefix, options=ReadOptions(gap_bytes=gap_bytes))
    reads = Reads()
    with _CountAllReads(reads):
        dcp.load(state, storage_reader=reader, planner=UCPLoadPlanner(), **load_kw)
    reads.requested = reader.last_load.bytes_requested
    return reads


def _row(what: str, rank: int, needed: int, exact: Reads, default: Reads, column_split: bool) -> dict[str, Any]:
    """Check and report one load's reads.

    ``exact`` (``gap_bytes=0``): the reader asks storage for exactly the
    needed bytes, at most 5% more with the headers. ``default`` (the default
    ``gap_bytes``, one page less a byte): neighbouring ranges less than a
    page apart are merged into one read. It must touch no file page the
    exact reads do not, and ask for at most 5% more than needed unless the
    layout splits columns (``column_split``: this tiny model's 256- and
    384-byte rows leave sub-page gaps between a rank's pieces of
    consecutive rows, which merging reads into scratch).
    """
    row = {"what": what, "rank": rank, "needed": needed, "requested": exact.requested,
           "all_reads": exact.everything}
    assert exact.requested == needed, row  # offset reads: not one byte more or less than the rank needs
    assert exact.everything <= MAX_RATIO * needed, row
    row.update(default_requested=default.requested, default_all_reads=default.everything)
    assert needed <= default.requested, row
    assert default.pages == exact.pages, (row, len(default.pages), len(exact.pages))
    if not column_split:
        assert default.requested <= MAX_RATIO * needed, row
    elif default.requested > MAX_RATIO * needed:
        row["note"] = "merged sub-page gaps"
    return row


# ---------------------------------------------------------------- ranks


def _load_both_ways(
    tensors: list[torch.Tensor], check: Callable[[], None], state: dict[str, Any], hf: str, prefix: str,
    **load_kw: Any,
) -> tuple[Reads, Reads]:
    """Load twice into NaN-filled ``tensors`` (exact reads, then the default gap merging), checking each time."""
    out = []
    for gap in (0, None):
        for t in tensors:
            t.fill_(float("nan"))  # NaN: no stale byte may stay behind
        out.append(_counted_load(state, hf, prefix, gap_bytes=gap, **load_kw))
        check()
    return out[0], out[1]


def _fsdp2(rank: int, world: int, hf: str, group: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(100 + rank)  # other weights on every rank: the load must replace them
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    msd, osd = get_state_dict(model, optim)
    # A save_pretrained directory holds no optimizer state: asking for it fails on every rank with a
    # CheckpointKeyError naming the missing keys (DCP gathers the ranks' errors in a CheckpointException).
    with pytest.raises(CheckpointException) as failed:
        dcp.load({"model": msd, "optim": osd}, storage_reader=UCPStorageReader(hf, prefix="model."),
                 planner=UCPLoadPlanner())
    err = failed.value.failures[rank][0]
    assert isinstance(err, CheckpointKeyError), err
    assert "missing from the checkpoint" in str(err) and "'optim.state.lm_head.weight.exp_avg'" in str(err), err
    ref = file_tensors(hf)
    assert set(msd) == set(ref), sorted(set(msd) ^ set(ref))
    assert all(isinstance(v, DTensor) for v in msd.values())

    def check() -> None:
        for k, v in msd.items():
            assert bit_equal(v.full_tensor(), ref[k]), (rank, k)
        # The model's own parameters hold the file's bytes (the load wrote into them in place).
        for k, p in model.named_parameters():
            assert bit_equal(p.to_local(), msd[k].to_local()), (rank, k)

    locals_ = [v.to_local() for v in msd.values()]
    exact, default = _load_both_ways(locals_, check, {"model": msd}, hf, "model.")
    needed = sum(t.numel() * t.element_size() for t in locals_)
    return _row("FSDP2 x3", rank, needed, exact, default, column_split=False)


def _megatron_tp(rank: int, world: int, hf: str, group: Any) -> dict[str, Any]:
    want, pad = megatron_local(file_tensors(hf), rank, world)
    state = {k: torch.full_like(v, float("nan")) for k, v in want.items()}
    applied = megatron_spec(rank, world).apply(state)

    def check() -> None:
        bad = [k for k in want if not bit_equal(state[k], want[k])]
        assert not bad, (rank, bad)

    exact, default = _load_both_ways(list(state.values()), check, applied, hf, "", process_group=group)
    needed = sum(v.numel() * v.element_size() for v in want.values()) - pad
    return _row(f"Megatron TP {world}", rank, needed, exact, default, column_split=True)


def _phases(
    rank: int, world: int, hf: str, out: str, phases: list[tuple[int, Callable[..., dict[str, Any]]]]
) -> None:
    """Run each phase on ranks ``0..n-1`` through a group of their own (one spawn for all phases)."""
    rows = []
    for n, fn in phases:
        group = dist.group.WORLD if n == world else dist.new_group(list(range(n)))  # every rank calls new_group
        if rank < n:
            rows.append(fn(rank, n, hf, group))
        dist.barrier()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(rows, f)


def _report(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        line = (f"{r['what']:>18} rank {r['rank']}: needed {r['needed']} B; gap_bytes=0: reader requested "
                f"{r['requested']} B ({r['requested'] / r['needed']:.4f}x), all reads incl. headers "
                f"{r['all_reads']} B ({r['all_reads'] / r['needed']:.4f}x)")
        if "default_requested" in r:
            d, a = r["default_requested"], r["default_all_reads"]
            line += f"; default gap_bytes: {d} B ({d / r['needed']:.4f}x), all {a} B ({a / r['needed']:.4f}x)"
        print(line + (f" [{r['note']}]" if "note" in r else ""))


@pytest.mark.multiproc
def test_hf_dir_into_fsdp2_and_megatron_tp(hf_dir: Path, tmp_path: Path) -> None:
    """FSDP2 on 3 ranks, then Megatron-style TP 2 on 2 of them, straight from the files, bit-exact,
    each rank reading <= 1.05x the bytes it needs."""
    run_ranks(3, _phases, str(hf_dir), str(tmp_path), [(3, _fsdp2), (TP, _megatron_tp)])
    rows = [r for i in range(3) for r in json.loads((tmp_path / f"rank{i}.json").read_text())]
    assert sorted((r["what"], r["rank"]) for r in rows) == sorted(
        [("FSDP2 x3", i) for i in range(3)] + [(f"Megatron TP {TP}", i) for i in range(TP)])
    _report(rows)


# ---------------------------------------------------------------- one process


def test_hf_dir_in_one_process(hf_dir: Path) -> None:
    """No process group: load_state_dict, dcp.load(no_dist=True) into the whole model and into TP rank 1."""
    ref = file_tensors(hf_dir)
    got = load_state_dict(hf_dir, prefix="model.")
    assert set(got) == {f"model.{k}" for k in ref}
    assert all(bit_equal(got[f"model.{k}"], v) for k, v in ref.items())

    torch.manual_seed(7)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    msd = model.state_dict()

    def check_model() -> None:
        bad = [k for k, p in model.named_parameters() if not bit_equal(p, ref[k])]
        assert not bad, bad

    exact, default = _load_both_ways(list(msd.values()), check_model, {"model": msd}, str(hf_dir), "model.",
                                     no_dist=True)
    total = sum(v.numel() * v.element_size() for v in ref.values())
    rows = [_row("whole, no_dist", 0, total, exact, default, column_split=False)]

    want, pad = megatron_local(ref, 1, TP)
    state = {k: torch.full_like(v, float("nan")) for k, v in want.items()}

    def check_tp() -> None:
        bad = [k for k in want if not bit_equal(state[k], want[k])]
        assert not bad, bad

    exact, default = _load_both_ways(list(state.values()), check_tp, megatron_spec(1, TP).apply(state),
                                     str(hf_dir), "", no_dist=True)
    needed = sum(v.numel() * v.element_size() for v in want.values()) - pad
    rows.append(_row("TP rank 1, no_dist", 1, needed, exact, default, column_split=True))
    _report(rows)


def test_bf16_files_into_fp32_tp_rank(tmp_path: Path) -> None:
    """A bf16 ``save_pretrained`` directory into float32 TP rank 0 (every read cast through staging), in one
    process: each value is the file's bf16 value exactly, and the reader asks for exactly the bf16 bytes needed."""
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16", max_shard_size="10KB")
    ref = file_tensors(tmp_path / "bf16")
    assert {v.dtype for v in ref.values()} == {torch.bfloat16}
    want, pad = megatron_local(ref, 0, TP)
    state = {k: torch.full(v.shape, float("nan")) for k, v in want.items()}

    def check() -> None:
        bad = [k for k in want if not bit_equal(state[k], want[k].float())]
        assert not bad, bad

    with pytest.warns(UserWarning, match=r"21 tensor\(s\) are cast .*bfloat16 -> float32"):  # said, not silent
        exact, default = _load_both_ways(list(state.values()), check, megatron_spec(0, TP).apply(state),
                                         str(tmp_path / "bf16"), "", no_dist=True)
    needed = sum(v.numel() * v.element_size() for v in want.values()) - pad  # bf16 bytes
    _report([_row("bf16 -> fp32 TP rank 0", 0, needed, exact, default, column_split=True)])
