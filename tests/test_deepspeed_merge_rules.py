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


def test_two_sub_params_split_by_a_zero_partition_boundary(tmp_path: Path) -> None:
    """1.fc2.weight's fp32 master straddles the two data-parallel partitions (row 6, column 5):
    each partition's piece of row 6 lies in one sub-parameter only, and still lands where
    merge_tp_slices puts it."""
    d = _rewritten(
        tmp_path,
        lambda i: {**i, INFO_KEYS["PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0"]: [r"1\.fc2\.weight$"]},
    )
    _check(load_state_dict(d), {"1.fc2.weight": _two_sub})


def test_a_vocabulary_cut_inside_rank_0s_slice_drops_rank_1s(tmp_path: Path) -> None:
    """original_vocab_size 5 of 12 padded rows: the merged embedding is rank 0's first 5 rows;
    rank 1's slice is all padding and places nothing."""
    d = _rewritten(tmp_path, lambda i: {**i, "original_vocab_size": 5})
    _check(load_state_dict(d), {"tied_modules.embed.weight": lambda s: s[0][:5]})


def test_a_sub_param_shape_of_minus_one_is_sized_from_the_slices(tmp_path: Path) -> None:
    """A SubparamShape dimension of -1 takes the size its slices' elements leave (98 / 14)."""
    sub = {"patterns": [r"1\.fc1\.weight$"], "shape": [[8, 6], -1], "partition_dim": 0}
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
    assert open_source(d).index.tensors["model.1.fc1.weight"].shape == (14, 7)
    _check(load_state_dict(d), {"1.fc1.weight": _sub_params(widths)})


def _sub(shape: list[Any], version: float = 0.4, widths: Any = ((4, 4), (3, 3))) -> Any:
    """An edit putting 1.fc1.weight under one SubparamShape of ``shape`` (along 0)."""
    pattern = r"1\.fc1\.weight$"
    sub = {"patterns": [pattern], "shape": shape, "partition_dim": 0}
    extra = {"sub_param_shard_widths": {pattern: [list(w) for w in widths]}} if widths else {}
    return lambda i: {
        **i,
        "universal_checkpoint_version": version,
        "parameter_with_sub_params": [sub],
        **extra,
    }


_INFO = "universal_checkpoint_info"
_SUBS = f"{_INFO}['parameter_with_sub_params']"


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda i: {**i, "tp_replicated_parameter_patterns": r"\d+\.gain$"},
            f"{_INFO}['tp_replicated_parameter_patterns'] is not a list of patterns",
        ),
        (
            lambda i: {**i, "parameter_with_row_parallelism_patterns": [1]},
            f"{_INFO}['parameter_with_row_parallelism_patterns']: [1] are not patterns (strings)",
        ),
        (
            lambda i: {**i, "parameter_with_row_parallelism_patterns": ["fc2(weight"]},
            f"{_INFO}['parameter_with_row_parallelism_patterns']: 'fc2(weight': missing ), "
            "unterminated subpattern at position 3",
        ),
        (
            lambda i: {**i, "parameter_with_sub_params": "1.fc1.weight"},
            f"{_SUBS} is not a list or ['sub_param_shard_widths'] not a dict",
        ),
        (
            lambda i: {**i, "parameter_with_sub_params": [{"patterns": ["x"]}]},
            f"{_SUBS}[0] is not a SubparamShape (patterns, shape, partition_dim): "
            "{'patterns': ['x']}",
        ),
        (
            lambda i: {
                **i,
                "parameter_with_sub_params": [
                    {"patterns": ["x"], "shape": [1, 7], "partition_dim": 2}
                ],
            },
            f"{_SUBS}[0]: shape [1, 7] with partition_dim 2 is not a shape and one of its "
            "dimensions",
        ),
        (_sub([1, 0], 0.2, None), f"{_SUBS}[0]: shape [1, 0] has a dimension not a size"),
        (
            _sub([2, 7]),
            f"{_SUBS}[0]: shape[0] 2 is neither the sub-parameters' sizes nor (before version "
            "0.4) their number",
        ),
        (_sub([[8, -1], 7], 0.2, None), f"{_SUBS}[0]: sub-parameter sizes [8, -1] are not sizes"),
        (
            _sub([[8, 6], 7], 0.4, None),
            f"{_SUBS}[0]: universal checkpoint version 0.4 records no 'sub_param_shard_widths' "
            "for its patterns ['1\\\\.fc1\\\\.weight$']",
        ),
        (
            _sub([[8, 6], 7], 0.4, ("x",)),
            f"{_SUBS}[0]: 'sub_param_shard_widths' [['x']] is not a list of widths",
        ),
        (
            lambda i: {**i, "universal_checkpoint_version": "0.4"},
            f"{_INFO}['universal_checkpoint_version'] '0.4' is not a number",
        ),
        (
            lambda i: {**i, "original_vocab_size": 0},
            f"{_INFO}['original_vocab_size'] 0 is not a positive integer",
        ),
        (
            lambda i: {**i, "autotp_unsupported_parameter_patterns": ["1.gain"]},
            f"{_INFO}['autotp_unsupported_parameter_patterns'] is not a dict of patterns",
        ),
        (
            lambda i: {k: v for k, v in i.items() if k != "original_vocab_size"},
            f"'tied_modules.embed.weight' matches vocabulary_parameter_patterns but {_INFO} has "
            "no original_vocab_size",
        ),
        (
            lambda i: {**i, "parameter_with_row_parallelism_patterns": [r"1\.fc1\.bias$"]},
            "'1.fc1.bias' of shape (7,) cannot be joined along dimension 1",
        ),
        (
            _sub([3, 7], 0.2, None),
            "'1.fc1.weight': 3 sub-parameters do not evenly divide its 14 elements along "
            "dimension 0",
        ),
        (
            _sub([[8, 6], 7], 0.4, ((4, 4), (3, 2))),
            f"'1.fc1.weight': {_INFO}['sub_param_shard_widths'] [[4, 4], [3, 2]] does not give "
            "each of the sub-parameters of sizes [8, 6] one width per tensor-parallel rank (2), "
            "adding up to its size",
        ),
        (
            _sub([[9, 6], -1], 0.4, ((5, 4), (3, 3))),
            "'1.fc1.weight': sub-parameter shape [15, -1] (sub-parameters of sizes [9, 6] along "
            "dimension 0) does not fit its 98 elements",
        ),
        (
            _sub([[8, 6], 8]),
            "tensor-parallel rank 0 holds 49 elements of '1.fc1.weight' (shape [7, 7]), but its "
            "parameter_with_sub_params widths describe a shape of [7, 8]",
        ),
    ],
)
def test_a_malformed_universal_checkpoint_info_is_refused_naming_the_entry(
    tmp_path: Path, edit: Callable[[dict[str, Any]], dict[str, Any]], message: str
) -> None:
    """Each entry of universal_checkpoint_info that is not what ds_to_universal reads (a wrong
    type, a pattern that does not compile, sizes and widths that do not fit the slices) is
    refused naming the model states file and the entry, not read as some other merge."""
    d = _rewritten(tmp_path, edit)
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    assert str(e.value) == f"{d / 'step2' / 'mp_rank_00_model_states.pt'}: {message}"


def test_a_buffer_no_user_rule_places_is_refused_naming_it(tmp_path: Path) -> None:
    """Without universal_checkpoint_info, user rules that place every trainable parameter but
    not a module entry (the frozen 3.frozen, the buffer 3.scale) are refused naming it."""
    from ucp_dcp import Replicated, Shard, VocabPad

    d = _rewritten(tmp_path, lambda i: None)  # type: ignore[arg-type,return-value]
    rules = [
        Shard(r"fc2\.weight$", dim=1),
        Replicated(r"(gain|fc2\.bias|^3\.proj\.bias)$"),
        Shard(r"(fc1|^3\.proj)\."),
        VocabPad(r"embed\.weight$", size=11),
    ]
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d, tp_rules=rules)
    assert str(e.value) == (
        f"{d / 'step2' / 'mp_rank_00_model_states.pt'}: tensor-parallel checkpoint without "
        "partitioning rules: universal_checkpoint_info is missing and tp_rules match none of "
        "3.frozen, so it is unknown which dimension each of them is split along (or whether it "
        "is replicated)"
    )


def test_a_scalar_under_the_two_sub_params_rule_is_refused() -> None:
    """A 0-d parameter (no fixture has one under tensor parallelism: the rules' own function)
    matched by parameter_with_2_sub_params_cat_dim_0 has no dimension 0 to cut in two."""
    from ucp_dcp.sources._ds_tp import tp_rules

    info = {INFO_KEYS["PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0"]: [r"layer\.scale$"]}
    rules = tp_rules(info, "states.pt", ["layer.scale"])
    with pytest.raises(CheckpointFormatError) as e:
        rules.slice_of("layer.scale", 0, 2, ())
    assert str(e.value) == (
        "states.pt: 'layer.scale' matches parameter_with_2_sub_params_cat_dim_0 but is a scalar"
    )


def test_a_replicated_vocabulary_cut_is_read_from_rank_0(tmp_path: Path) -> None:
    """The embedding both tensor-parallel replicated and a vocabulary cut to 5 of its 6 rows:
    ds_to_universal takes slice 0 and cuts it; rank 1's slice is not read (nor checked
    equal: the cut keeps rank 0's rows only)."""
    d = _rewritten(
        tmp_path,
        lambda i: {
            **i,
            "original_vocab_size": 5,
            "tp_replicated_parameter_patterns": [
                *i["tp_replicated_parameter_patterns"],
                r"tied_modules\.embed\.weight$",
            ],
        },
    )
    assert open_source(d).index.tensors["model.tied_modules.embed.weight"].shape == (5, 7)
    _check(load_state_dict(d), {"tied_modules.embed.weight": lambda s: s[0][:5]})


def test_an_averaged_parameter_one_rank_does_not_hold_is_refused(tmp_path: Path) -> None:
    """1.fc1.bias averaged over the tensor-parallel ranks, but rank 1's model states no longer
    list it: its mean cannot be computed; refused naming the parameter and the rank."""
    d = _rewritten(tmp_path, lambda i: {**i, "parameter_to_average_patterns": [r"1\.fc1\.bias$"]})
    f = d / "step2" / "mp_rank_01_model_states.pt"
    sd = torch.load(f, weights_only=True)
    for shapes in sd["param_shapes"]:
        shapes.pop("1.fc1.bias", None)
    torch.save(sd, f)
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    assert str(e.value) == (
        f"{d / 'step2'}: model.1.fc1.bias is merged from its tensor-parallel slices, but "
        "tensor-parallel rank(s) [1] hold none"
    )
