"""Every merge rule of ds_to_universal, read in place, on a real DeepSpeed TP=2 x DP=2 checkpoint.

``tp2_dp2_zero1`` (tests/fixtures/deepspeed/pipe, written by DeepSpeed) holds real slices whose
two tensor-parallel ranks differ. Each test rewrites its ``universal_checkpoint_info`` to put
some parameters under one rule, loads the checkpoint in place, and compares every tensor (fp32
master, both Adam moments) bit for bit with what ``merge_tp_slices`` computes from the slices
DeepSpeed itself returned before the save (``safe_get_full_*``, in ``reference.safetensors``):
its formulas, written out below, are the specification. A key the reader does not know is
refused, naming it.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import bit_equal, run_ranks
from safetensors.torch import load_file
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from ucp_dcp import CheckpointFormatError, load_state_dict, ReadOptions, UCPLoadPlanner, UCPStorageReader
from ucp_dcp.adapters.rules import Averaged, Fused
from ucp_dcp.sources import DeepSpeedSource, open_source
from ucp_dcp.sources._ds_tp import INFO_KEYS

FIXTURE = Path(__file__).parent / "fixtures" / "deepspeed" / "pipe" / "tp2_dp2_zero1"
KINDS = ("fp32", "exp_avg", "exp_avg_sq")
Slices = dict[str, list[torch.Tensor]]


def _slices() -> dict[str, Slices]:
    """kind -> parameter -> its two tensor-parallel slices (DeepSpeed's own view)."""
    out: dict[str, Slices] = {k: {} for k in KINDS}
    for k, v in sorted(load_file(str(FIXTURE / "reference.safetensors")).items()):
        if k.startswith("slice/"):
            _, kind, rest = k.split("/", 2)
            name, t = rest.rsplit("/tp", 1)
            out[kind].setdefault(name, []).insert(int(t), v)
    return out


def _key(kind: str, name: str) -> str:
    return f"model.{name}" if kind == "fp32" else f"optim.state.{name}.{kind}"


def _rewritten(tmp_path: Path, edit: Callable[[dict[str, Any]], dict[str, Any]]) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(FIXTURE / "step2", d / "step2")
    (d / "latest").write_text("step2")
    for f in sorted((d / "step2").glob("mp_rank_*_model_states.pt")):
        sd = torch.load(f, weights_only=True)
        sd["universal_checkpoint_info"] = edit(dict(sd["universal_checkpoint_info"]))
        torch.save(sd, f)
    return d


# ds_to_universal's merge_tp_slices, branch by branch (deepspeed/checkpoint/ds_to_universal.py).
def _average(s: list[torch.Tensor]) -> torch.Tensor:
    return sum(s) / len(s)  # type: ignore[return-value]


def _two_sub(s: list[torch.Tensor]) -> torch.Tensor:
    chunks = [torch.chunk(x, 2, dim=0) for x in s]
    return torch.cat([torch.cat([c[0] for c in chunks]), torch.cat([c[1] for c in chunks])])


def _sub_params(widths: list[list[int]]) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    def merge(s: list[torch.Tensor]) -> torch.Tensor:
        offsets, merged = [0] * len(s), []
        for w in widths:
            pieces = []
            for t, x in enumerate(s):
                pieces.append(x.narrow(0, offsets[t], w[t]))
                offsets[t] += w[t]
            merged.append(torch.cat(pieces))
        return torch.cat(merged)

    return merge


def _check(
    got: dict[str, Any], merges: dict[str, Callable[[list[torch.Tensor]], torch.Tensor]]
) -> None:
    slices = _slices()
    for name, merge in merges.items():
        for kind in KINDS:
            want = merge(slices[kind][name])
            assert bit_equal(got[_key(kind, name)], want), (kind, name)


def test_averaged_slices_are_their_mean_bit_for_bit(tmp_path: Path) -> None:
    """parameter_to_average_patterns: sum(slices) / len(slices), in the slices' dtype; the
    mean's bytes are a computed file that every load reads like any other."""
    names = ["1.fc1.bias", "2.fc1.bias", "4.fc1.bias", "1.fc1.weight"]
    d = _rewritten(
        tmp_path,
        lambda i: {**i, "parameter_to_average_patterns": [r"\d+\.fc1\.bias$", r"1\.fc1\.weight$"]},
    )
    src = open_source(d)
    assert isinstance(src, DeepSpeedSource) and src.computed is not None
    assert src.index.tensors["model.1.fc1.weight"].shape == (7, 7)  # the slice's shape
    got = load_state_dict(d)
    _check(got, dict.fromkeys(names, _average))
    assert src.check_files() == []  # the computed file is on no storage, and not checked there


def test_replicated_slices_are_checked_equal_on_a_verified_load(tmp_path: Path) -> None:
    """tp_replicated_parameter_patterns: slice 0, once every other slice is found bit-equal to
    it (ds_to_universal asserts the same); slices that differ are refused naming the parameter
    and both ranks. verify=False reads slice 0 only."""
    got = load_state_dict(FIXTURE)
    _check(got, {"1.gain": lambda s: s[0], "4.fc2.bias": lambda s: s[0]})
    d = _rewritten(
        tmp_path, lambda i: {**i, "tp_replicated_parameter_patterns": [r"1\.fc1\.bias$"]}
    )
    with pytest.raises(CheckpointFormatError) as e:
        load_state_dict(d)
    assert f"{d / 'step2'}: model.1.fc1.bias is tensor-parallel replicated" in str(e.value)
    assert "tensor-parallel ranks 0 and 1 hold different values" in str(e.value)
    _check(load_state_dict(d, options=ReadOptions(verify=False)), {"1.fc1.bias": lambda s: s[0]})


def test_two_sub_params_re_cut_the_fused_halves(tmp_path: Path) -> None:
    """parameter_with_2_sub_params_cat_dim_0 (SwiGLU's dense_h_to_4h): slice k is
    [a_k; b_k] (torch.chunk: 7 rows are 4 + 3), the merged tensor [a_0; a_1; b_0; b_1]. Until
    this key was read by DeepSpeed's spelling it loaded as a plain concatenation, silently."""
    d = _rewritten(
        tmp_path,
        lambda i: {**i, INFO_KEYS["PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0"]: [r"\d+\.fc1\.weight$"]},
    )
    got = load_state_dict(d)
    _check(got, dict.fromkeys(["1.fc1.weight", "2.fc1.weight", "4.fc1.weight"], _two_sub))
    # fc1.bias is still joined along 0: a plain concatenation
    _check(got, {"1.fc1.bias": lambda s: torch.cat(s)})


def test_sub_param_shapes_re_cut_each_ranks_share(tmp_path: Path) -> None:
    """parameter_with_sub_params (a fused QKV under GQA), version 0.4: along partition_dim 0
    each rank holds its share (sub_param_shard_widths) of every sub-parameter."""
    sub = {"patterns": [r"1\.fc1\.weight$"], "shape": [[8, 6], 7], "partition_dim": 0}
    widths = [[4, 4], [3, 3]]
    d = _rewritten(
        tmp_path,
        lambda i: {
            **i,
            "universal_checkpoint_version": 0.4,
            "parameter_with_sub_params": [sub],
            "sub_param_shard_widths": {r"1\.fc1\.weight$": widths},
        },
    )
    _check(load_state_dict(d), {"1.fc1.weight": _sub_params(widths)})
    # Before version 0.4, a count of equal parts, each split evenly: one part of 14 rows is a
    # plain concatenation; 2.fc1's 6 rows as two parts of 3 cannot be split over 2 ranks.
    old = {"patterns": [r"1\.fc1\.weight$"], "shape": [1, 7], "partition_dim": 0}
    d = _rewritten(tmp_path / "old", lambda i: {**i, "parameter_with_sub_params": [old]})
    _check(load_state_dict(d), {"1.fc1.weight": lambda s: torch.cat(s)})
    odd = {"patterns": [r"2\.fc1\.weight$"], "shape": [2, 7], "partition_dim": 0}
    d = _rewritten(tmp_path / "odd", lambda i: {**i, "parameter_with_sub_params": [odd]})
    with pytest.raises(CheckpointFormatError, match=r"sub-parameter sizes \[3, 3\] are not divis"):
        open_source(d)


def test_user_rules_state_the_same_merges(tmp_path: Path) -> None:
    """Averaged and Fused as tp_rules do what the checkpoint's patterns do."""
    rules = [
        Averaged(r"\.fc1\.bias$"),
        Fused(r"^1\.fc1\.weight$", dim=0, parts={"gate": 8, "up": 6}),
    ]
    got = load_state_dict(FIXTURE, options=ReadOptions(tp_rules=rules))
    widths = [[4, 4], [3, 3]]
    _check(
        got, {"1.fc1.bias": _average, "4.fc1.bias": _average, "1.fc1.weight": _sub_params(widths)}
    )


@pytest.mark.parametrize(
    "key",
    [
        "parameters_with_2_sub_params_cat_dim_0",
        "expert_parameter_patterns",
        "affine_params",
        "universal_checkpoint_info",
    ],
)
def test_a_key_the_reader_does_not_know_is_refused_naming_it(tmp_path: Path, key: str) -> None:
    """The misspelled key the reader once looked for, a key of a newer DeepSpeed, an old name,
    the info's own name nested in it: never ignored. The message lists every key it knows."""
    d = _rewritten(tmp_path, lambda i: {**i, key: [r"\d+\.fc1\.weight$"]})
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    assert f"universal_checkpoint_info has key(s) {key!r} that this reader does not know" in str(
        e.value
    )
    assert str(d / "step2" / "mp_rank_00_model_states.pt") in str(e.value)
    known = str(e.value).split("(it knows ")[1].split(")")[0].split(", ")
    own = "universal_checkpoint_info"
    assert sorted(known) == sorted(v for v in INFO_KEYS.values() if v != own)


def test_the_pinned_key_table_spells_deepspeeds_constants() -> None:
    """The table against deepspeed.checkpoint.constants as DeepSpeed 0.19.8 defines them (the
    fixture generators assert it against the installed DeepSpeed)."""
    assert (
        INFO_KEYS["PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0"]
        == "parameter_with_2_sub_params_cat_dim_0"
    )
    assert INFO_KEYS["PARAMETER_WITH_SUB_PARAMS"] == "parameter_with_sub_params"
    assert INFO_KEYS["SUB_PARAM_SHARD_WIDTHS"] == "sub_param_shard_widths"
    assert INFO_KEYS["AFFINE_MAP"] == "affine_map"
    assert all(k.lower() == v for k, v in INFO_KEYS.items() if "VERSION" not in k)


def _averaged_into_3(rank: int, world: int, root: str, read_once: Any) -> None:
    """The averaged checkpoint into 3 ranks: fc1.bias (averaged) sharded 3 ways, the rest
    replicated; with the read-once exchange forced on, the computed bytes travel too."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    want = load_state_dict(root)
    state = {}
    for k, v in want.items():
        if not isinstance(v, torch.Tensor):
            continue
        placement = [Shard(0)] if "fc1.bias" in k and v.ndim == 1 else [Replicate()]
        state[k] = distribute_tensor(torch.full_like(v, 13), mesh, placement)
    dcp.load(
        state, storage_reader=UCPStorageReader(root, options=ReadOptions(read_once=read_once)), planner=UCPLoadPlanner()
    )
    for k, t in state.items():
        assert bit_equal(t.full_tensor(), want[k]), (rank, k)


@pytest.mark.parametrize("read_once", [False, True])
def test_averaged_tensors_load_on_3_ranks(tmp_path: Path, read_once: bool) -> None:
    d = _rewritten(tmp_path, lambda i: {**i, "parameter_to_average_patterns": [r"\d+\.fc1\.bias$"]})
    run_ranks(3, _averaged_into_3, str(d), read_once)
