"""Layout rules: the pieces each rule makes, the spec's JSON, and the errors.

Most tests run in one process without DCP: they check the pieces a rule
makes against tensors cut by independent Megatron arithmetic
(:mod:`megatron_block`). The last test saves with real ranks.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter

import pytest
import torch

from dist_utils import bit_equal, run_ranks
from megatron_block import (
    CFG, block_rules, block_spec, expert_local, expert_reference, expert_spec, local_state, reference,
    train_state,
)
from ucp_dcp import (
    Averaged, Fused, LayoutRuleError, LayoutSpec, RankLocal, Reindex, Rename, Replicated, Shard, VocabPad,
)
from ucp_dcp.adapters.rules import Rule
from ucp_dcp.format import LAYOUT_KEY
from ucp_dcp.core.pieces import Piece, TensorPieces
from ucp_dcp.core.values import decode_value, encode_value


def _pieces(sd: dict) -> list[tuple[TensorPieces, Piece]]:
    out = []

    def walk(x: object) -> None:
        if isinstance(x, TensorPieces):
            out.extend((x, p) for p in x.pieces)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)

    walk(sd)
    return out


def _shares_memory(view: torch.Tensor, base: torch.Tensor) -> bool:
    if view.numel() == 0:
        return True
    lo = base.data_ptr()
    hi = lo + base.numel() * base.element_size()
    return view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr() and lo <= view.data_ptr() < hi


def _box(t: torch.Tensor, p: Piece) -> torch.Tensor:
    for d, (o, s) in enumerate(zip(p.offsets, p.data.shape)):
        t = t.narrow(d, o, s)
    return t


# ------------------------------------------------------------------ pieces


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (3, 1), (4, 1), (6, 1), (2, 2), (1, 4)])
def test_megatron_pieces_tile_the_reference(tp: int, pp: int) -> None:
    """Over all ranks of a TP x PP layout, the pieces are views of the local tensors that hold
    exactly the reference's values and cover every logical tensor once (replicated ones once per rank)."""
    ref = reference()
    covered: Counter[str] = Counter()
    replicas: Counter[str] = Counter()
    for stage in range(pp):
        for r in range(tp):
            local = local_state(ref, r, tp, stage, pp, pad_value=7.0)
            sd = block_spec(r, tp, stage, pp).apply({"model": local})
            assert set(sd["model"]) == set(local)  # same keys
            for tp_obj, p in _pieces(sd):
                name = p.fqn.removeprefix("model.")
                assert p.shape == tuple(ref[name].shape), p.fqn
                assert bit_equal(p.data, _box(ref[name], p)), p.fqn
                if tp_obj.replicated:  # a full copy
                    replicas[p.fqn] += 1
                    assert p.offsets == (0,) * len(p.shape) and tuple(p.data.shape) == p.shape, p.fqn
                covered[p.fqn] += p.data.numel()
            for key, obj in sd["model"].items():
                for p in obj.pieces:
                    assert _shares_memory(p.data, local[key]), (key, p.fqn)
                for f in obj.fill:  # padding rows only
                    assert _shares_memory(f, local[key]) and bool((f == 7.0).all()), key
    for name, t in ref.items():
        fqn = "model." + name
        want = t.numel() * (replicas[fqn] or 1)
        assert covered[fqn] == want, (fqn, covered[fqn], want)
        if "norm" in name:
            assert replicas[fqn] == tp, fqn


def test_fused_gqa_offsets() -> None:
    """TP rank 1 of 2 holds the second half of the KV groups: per group its q rows, then k, then v, each a piece."""
    ref = reference()
    local = local_state(ref, 1, 2)
    sd = block_spec(1, 2).apply({"model": local})
    qkv = sd["model"]["layers.0.attn.qkv.weight"]
    got = [(p.fqn, p.offsets[0], p.data.shape[0]) for p in qkv.pieces]
    qg = CFG.heads // CFG.kv_heads * CFG.head_dim  # query rows per KV group
    kg = CFG.head_dim  # key (and value) rows per KV group
    want = []
    for g in range(CFG.kv_heads // 2, CFG.kv_heads):
        want += [("model.layers.0.attn.q.weight", qg * g, qg), ("model.layers.0.attn.k.weight", kg * g, kg),
                 ("model.layers.0.attn.v.weight", kg * g, kg)]
    assert got == want
    # Writing into a piece writes the local tensor (load is in place): piece 1 is the first group's k rows.
    qkv.pieces[1].data.fill_(3.5)
    assert bool((local["layers.0.attn.qkv.weight"][qg : qg + kg] == 3.5).all())


def test_fused_per_rank_and_shard() -> None:
    t = torch.arange(6 * 3, dtype=torch.float32).view(6, 3)
    spec = LayoutSpec([Fused(r"\.gate_up\.", parts={".gate.": 8, ".up.": 4}, axis="tp")], axes={"tp": (1, 2)})
    (gate, up) = spec.apply({"m.gate_up.w": t})["m.gate_up.w"].pieces
    assert (gate.fqn, gate.shape, gate.offsets, tuple(gate.data.shape)) == ("m.gate.w", (8, 3), (4, 0), (4, 3))
    assert (up.fqn, up.shape, up.offsets, tuple(up.data.shape)) == ("m.up.w", (4, 3), (2, 0), (2, 3))
    assert bit_equal(up.data, t[4:])
    spec = LayoutSpec([Shard(r"down", dim=1, axis="tp")], axes={"tp": (2, 3)})
    (p,) = spec.apply({"down": t})["down"].pieces
    assert (p.shape, p.offsets) == ((6, 9), (0, 6)) and _shares_memory(p.data, t)


def test_vocab_pad_rank_of_padding_only() -> None:
    """vocab 5 padded to 8 over 4 ranks: rank 2 holds one real row, rank 3 only padding."""
    t = torch.ones(2, 3)
    rule = VocabPad(r"embed", size=5, axis="tp")
    tp2 = LayoutSpec([rule], axes={"tp": (2, 4)}).apply({"embed": t})["embed"]
    assert [(p.shape, p.offsets, tuple(p.data.shape)) for p in tp2.pieces] == [((5, 3), (4, 0), (1, 3))]
    assert [tuple(f.shape) for f in tp2.fill] == [(1, 3)] and tp2.fill_value == 0.0
    tp3 = LayoutSpec([rule], axes={"tp": (3, 4)}).apply({"embed": t})["embed"]
    assert tp3.pieces == () and [tuple(f.shape) for f in tp3.fill] == [(2, 3)]


def test_optimizer_keys_renamed_like_parameters_and_values_kept() -> None:
    ref, moments = reference(), reference(seed=1)
    sd = train_state(local_state(ref, 0, 2, 1, 2), local_state(moments, 0, 2, 1, 2))
    sd["optim"]["param_groups"] = [{"lr": 0.1, "params": ["a", "b"]}]
    sd["extra"] = RankLocal({"pos": 3})
    out = block_spec(0, 2, 1, 2).apply(sd, record=True)
    exp_avg = out["optim"]["state"]["layers.0.attn.qkv.weight"]["exp_avg"]
    assert exp_avg.fqns() == [f"optim.state.layers.2.attn.{n}.weight.exp_avg" for n in "qkv"]
    assert out["optim"]["state"]["layers.0.attn.qkv.weight"]["step"] == 5
    assert out["optim"]["param_groups"] == sd["optim"]["param_groups"] and out["extra"] is sd["extra"]
    assert out["model"]["head.weight"].fqns() == ["model.head.weight"]
    assert isinstance(out[LAYOUT_KEY], RankLocal) and LAYOUT_KEY not in block_spec(0, 2, 1, 2).apply(sd)
    assert set(sd) == {"model", "optim", "step", "extra"}  # the input is not modified
    assert isinstance(sd["model"]["head.weight"], torch.Tensor)


def test_update_values_copies_loaded_values_back() -> None:
    sd = train_state(local_state(reference(), 0, 1), {}, step=0)
    sd["optim"]["param_groups"] = [{"lr": 0.0}]
    spec = block_spec(0, 1)
    applied = spec.apply(sd)
    applied["step"], applied["optim"]["param_groups"][0]["lr"] = 9, 0.5  # what dcp.load would do
    spec.update_values(sd, applied)
    assert sd["step"] == 9 and sd["optim"]["param_groups"] == [{"lr": 0.5}]
    assert isinstance(sd["model"]["embed.weight"], torch.Tensor)


def test_rename_reindex_and_wrappers() -> None:
    spec = LayoutSpec(
        block_rules(layer_offset=6, wrapped=True) + [Rename(r"^model\.decoder\.", "model."),
                                                   Reindex(r"experts\.(\d+)\.", axis="ep", per_rank=2)],
        axes={"tp": (0, 1), "ep": (3, 4)},
    )
    assert spec.canonical_name("model._orig_mod.layers.1._fsdp_wrapped_module.attn.o.weight") == \
        "model.layers.7.attn.o.weight"
    assert spec.canonical_name("model.decoder.layers.0.moe.experts.1.w1") == "model.layers.6.moe.experts.7.w1"
    assert spec.canonical_name("model.layers10.x") == "model.layers10.x"


def test_experts_pieces() -> None:
    ref = expert_reference()
    local = expert_local(ref, 1, 2)
    sd = expert_spec(1, 2).apply({"model": local})
    names = sorted(p.fqn for _, p in _pieces(sd))
    assert names == sorted("model." + n for n in ["moe.router.weight"] + [
        f"moe.experts.{e}.{w}.weight" for e in (2, 3) for w in ("w1", "w2")])
    for tp_obj, p in _pieces(sd):
        assert tp_obj.replicated and bit_equal(p.data, ref[p.fqn.removeprefix("model.")])


def test_averaged_without_group() -> None:
    t = torch.ones(3)
    # Load side, or an axis of size 1: a plain replicated view.
    for axes, record in [({"tp": (1, 2)}, False), ({"tp": (0, 1)}, True)]:
        sd = LayoutSpec([Averaged(r"scale", axis="tp")], axes=axes).apply({"scale": t}, record=record)
        (p,) = sd["scale"].pieces
        assert sd["scale"].replicated and _shares_memory(p.data, t)
    with pytest.raises(LayoutRuleError, match=r"Averaged\('scale'.*'scale'.*process group"):
        LayoutSpec([Averaged(r"scale", axis="tp")], axes={"tp": (1, 2)}).apply({"scale": t}, record=True)


def test_json_round_trip() -> None:
    spec = LayoutSpec(
        block_rules(layer_offset=2, wrapped=True)
        + [Averaged(r"scale", axis="tp"), Reindex(r"experts\.(\d+)\.", axis="ep", per_rank=2, optional=True)],
        axes={"tp": (1, 3), "ep": (0, 2)}, strict=False,
    )
    data = spec.to_json()
    text = json.dumps(data)  # JSON-safe
    back = LayoutSpec.from_json(json.loads(text))
    assert back == spec and back.to_json() == data
    fused = [r for r in back.rules if isinstance(r, Fused)]
    assert list(fused[0].parts) == [".q.", ".k.", ".v."] and fused[0].groups == CFG.kv_heads
    assert back.rules[-1].optional
    # Through the checkpoint's value encoding (what RankLocal stores).
    assert LayoutSpec.from_json(decode_value(encode_value(data, "x"), "x")) == spec
    with pytest.raises(LayoutRuleError, match="unknown layout rule 'Bogus'"):
        Rule.from_json({"rule": "Bogus", "pattern": "x"})


# ------------------------------------------------------------------ errors


def test_unused_rule_is_an_error() -> None:
    sd = {"model": local_state(reference(), 0, 1)}
    spec = LayoutSpec(block_rules() + [Shard(r"\.lora_a\.", dim=0, axis="tp")], axes={"tp": (0, 1)})
    with pytest.raises(LayoutRuleError, match=re.escape(r"Shard('\\.lora_a\\.', axis='tp')")):
        spec.apply(sd)
    with pytest.raises(LayoutRuleError, match=r"Rename\('_orig_mod"):
        LayoutSpec(block_rules(wrapped=True), axes={"tp": (0, 1)}).apply(sd)
    # Escapes: allow_unused_rules, strict=False, optional=True.
    LayoutSpec(spec.rules, axes={"tp": (0, 1)}, allow_unused_rules=True).apply(sd)
    LayoutSpec(spec.rules, axes={"tp": (0, 1)}, strict=False).apply(sd)
    LayoutSpec(block_rules() + [Shard(r"\.lora_a\.", axis="tp", optional=True)], axes={"tp": (0, 1)}).apply(sd)


def test_unexplained_parameter_is_an_error() -> None:
    local = local_state(reference(), 0, 2)
    local["layers.1.attn.rotary.inv_freq"] = torch.ones(4)
    spec = block_spec(0, 2, 0, 1)
    with pytest.raises(LayoutRuleError, match=r"cannot explain 'model\.layers\.1\.attn\.rotary\.inv_freq'.*"
                       r"shape \[4\].*no layout rule matches.*Replicated"):
        spec.apply({"model": local})
    # strict=False: a full replicated copy.
    lax = LayoutSpec(spec.rules, axes=spec.axes, strict=False).apply({"model": local})
    obj = lax["model"]["layers.1.attn.rotary.inv_freq"]
    assert obj.replicated and obj.fqns() == ["model.layers.1.attn.rotary.inv_freq"]


def test_fused_widths_that_do_not_add_up() -> None:
    spec = LayoutSpec([Fused(r"\.qkv\.", parts={".q.": 24, ".k.": 12, ".v.": 12}, axis="tp")],
                      axes={"tp": (0, 2)})
    with pytest.raises(LayoutRuleError) as e:
        spec.apply({"blk.qkv.weight": torch.zeros(20, 8)})
    msg = str(e.value)
    assert "fused split of 'blk.qkv.weight'" in msg and "widths [24, 12, 12] add up to 48" in msg
    assert "has 20 along dim 0 at tp size 2 (expected 48/2 = 24)" in msg
    with pytest.raises(LayoutRuleError, match=r"'blk\.qkv\.weight'.*not divisible by 4 \(groups\)"):
        LayoutSpec([Fused(r"\.qkv\.", parts={".q.": 24, ".k.": 6, ".v.": 6}, groups=4, axis="tp")],
                   axes={"tp": (0, 2)}).apply({"blk.qkv.weight": torch.zeros(18, 8)})


def test_other_errors() -> None:
    with pytest.raises(LayoutRuleError, match=r"uses axis 'tp', which is not in axes"):
        LayoutSpec([Shard("x", axis="tp")])
    with pytest.raises(LayoutRuleError, match="capture group"):
        Reindex(r"layers\.\d+")
    with pytest.raises(LayoutRuleError, match="invalid regular expression"):
        Rename(r"(")
    with pytest.raises(LayoutRuleError, match=r"fewer than the true size 37"):
        LayoutSpec([VocabPad("emb", size=37, axis="tp")], axes={"tp": (0, 2)}).apply({"emb": torch.zeros(18, 2)})
    with pytest.raises(LayoutRuleError, match=r"'a\.w' and 'b\.w' both hold rows of the logical tensor 'c\.w'"):
        LayoutSpec([Rename(r"^[ab]\.", "c."), Replicated("w")]).apply({"a.w": torch.zeros(2), "b.w": torch.zeros(2)})
    with pytest.raises(LayoutRuleError, match=r"Shard\('w', dim=2\) matches 'w' of shape \[2\]"):
        LayoutSpec([Shard("w", dim=2)]).apply({"w": torch.zeros(2)})
    with pytest.raises(LayoutRuleError, match="reserved key"):
        LayoutSpec([]).apply({LAYOUT_KEY: 1})


# ------------------------------------------------------------------ with ranks


def _save_unequal_norm(rank: int, world: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    from ucp_dcp import UCPSavePlanner, UCPStorageWriter

    local = local_state(reference(), rank, world)
    if rank == 1:
        local["layers.1.post_norm.weight"][3] += 1e-3  # drifted TP replica
    sd = block_spec(rank, world).apply({"model": local}, record=True)
    try:
        dcp.save(sd, storage_writer=UCPStorageWriter(path), planner=UCPSavePlanner())
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        text = str(e)
    else:
        raise AssertionError("saving a replicated parameter that differs across ranks succeeded")
    assert "replicated tensor 'model.layers.1.post_norm.weight'" in text and "differs" in text, text[-3000:]


@pytest.mark.multiproc
def test_unequal_replicated_parameter_fails_the_save(tmp_path: os.PathLike) -> None:
    run_ranks(2, _save_unequal_norm, str(tmp_path / "ckpt"))


def test_bad_rules_and_arguments_are_the_librarys_errors() -> None:
    """A replacement naming a group its pattern lacks, a spec JSON with a field missing or
    unknown, a dim or a flat shape of the wrong type: each is named by the library's error,
    not re.error, KeyError or TypeError from inside."""
    from ucp_dcp import FlatParam, Fused, LayoutSpec, Rename, Replicated, Shard, Stacked, UCPError, pack_flat

    cases = {
        "Rename": lambda: LayoutSpec([Rename(r"w", r"\1"), Replicated("")]).apply({"w": torch.zeros(2)}),
        "Fused": lambda: LayoutSpec([Fused(r"\.w", parts={r"\2": 2, ".b": 2})]).apply({"x.w": torch.zeros(4, 2)}),
        "Stacked": lambda: LayoutSpec([Stacked(r"\.experts\.(w1)$", repl=r".experts.{}.\3")]).apply(
            {"m.experts.w1": torch.zeros(2, 3)}
        ),
        "unknown field": lambda: LayoutSpec.from_json({"version": 1, "rules": [{"rule": "Shard", "pattern": "w", "bogus": 1}]}),
        "no rules": lambda: LayoutSpec.from_json({"version": 1}),
        "dim": lambda: LayoutSpec([Shard(r"w", dim="1")]).apply({"w": torch.zeros(2, 2)}),
        "FlatParam": lambda: FlatParam("a", 5, 0),
        "pack_flat": lambda: pack_flat([("a", 5)]),
    }
    for what, call in cases.items():
        with pytest.raises(UCPError) as e:
            call()
        assert str(e.value), what
    with pytest.raises(UCPError, match=r"replacement '\\\\1': invalid group reference 1"):
        cases["Rename"]()
    with pytest.raises(UCPError, match=r"malformed layout spec JSON \(KeyError: 'rules'\)"):
        cases["no rules"]()


def test_spec_and_rule_arguments_are_refused_by_name() -> None:
    """Rules, axes and rule fields that make no layout are refused when the spec or rule is
    built, each naming the rule or axis and what was expected."""
    from ucp_dcp import Stacked

    refusals = [
        (lambda: LayoutSpec([Shard("w"), "x"]), r"^not layout rules: \['x'\]$"),
        (lambda: LayoutSpec([], axes={"tp": 3}), r"^axis 'tp': expected \(coordinate, size\), got 3$"),
        (lambda: LayoutSpec([], axes={"tp": (2, 2)}), r"^axis 'tp': coordinate 2 is outside size 2$"),
        (lambda: Reindex(r"(\d+)", axis="pp"), r"^Reindex\('\(\\\\d\+\)', axis='pp'\): give axis and per_rank together"),
        (lambda: Fused("x", parts={}), r"^Fused\('x', parts=\{\}\): parts is empty$"),
        (lambda: Fused("x", parts={"a": 2, "b": 0}), r"^Fused\('x', parts=.*\): every part width must be positive$"),
        (lambda: Fused("x", parts={"a": 2}, groups=0), r"^Fused\('x', .*groups=0\): groups must be >= 1$"),
        (lambda: VocabPad("emb", size=0), r"^VocabPad\('emb'\): size \(the true, unpadded size\) must be positive$"),
        (lambda: Stacked(r"\.e$", repl=".{}", experts=-1), r"^Stacked\(.*experts=-1\): experts must be >= 0$"),
        (lambda: LayoutSpec.from_json({"version": 2, "rules": []}), r"^layout spec JSON version 2; this code reads 1$"),
        # A rule the JSON names but this code lacks is said as such, not as "malformed".
        (lambda: LayoutSpec.from_json({"version": 1, "rules": [{"rule": "Nope", "pattern": "w"}]}),
         r"^unknown layout rule 'Nope' \(known: \['Averaged', "),
    ]
    for call, says in refusals:
        with pytest.raises(LayoutRuleError, match=says):
            call()


def test_applying_rules_refuses_what_they_cannot_describe() -> None:
    """Reindex groups that are not integers, fused groups that do not split over the axis, an
    integer tensor to average, an expert index that is not one, two keys of one logical tensor
    with different shapes, the base classes used as rules, and pieces that leave part of a
    logical tensor uncovered: each a LayoutRuleError naming the key and the rule."""
    from ucp_dcp import Unstacked
    from ucp_dcp.adapters.rules import LayoutRule, StackRule

    t = torch.zeros(4, 2)
    refusals = [
        (lambda: LayoutSpec([Reindex(r"layers\.(\w+)\."), Replicated("w")]).apply({"layers.x.w": t}),
         r"^Reindex\('layers\\\\\.\(\\\\w\+\)\\\\\.'\): group 1 of the match in 'layers\.x\.w' is 'x', not an integer$"),
        (lambda: LayoutSpec([Fused("qkv", parts={".q.": 4, ".k.": 4}, groups=3, axis="tp")], axes={"tp": (0, 2)})
         .apply({"qkv": t}), r"^fused split of 'qkv' by Fused\(.*\): 3 groups do not split evenly over tp size 2$"),
        (lambda: LayoutSpec([Averaged("n", axis="dp")], axes={"dp": (0, 2)}).apply(
            {"n": torch.zeros(2, dtype=torch.int64)}, record=True),
         r"^Averaged\('n', axis='dp'\): cannot average 'n' of dtype torch\.int64$"),
        (lambda: LayoutSpec([Unstacked(r"\.experts\.(\w+)\.w$", repl=".experts.w", experts=2)])
         .apply({"m.experts.a.w": t}),
         r"^Unstacked\(.*\): group 1 of the match in 'm\.experts\.a\.w' is 'a', not an expert index$"),
        (lambda: LayoutSpec([Rename(r"^[ab]\.", "c."), Replicated("w")]).apply(
            {"a.w": torch.zeros(2), "b.w": torch.zeros(3)}),
         r"^keys \['a\.w', 'b\.w'\] map to the logical tensor 'c\.w' with different global shapes \[\[2\], \[3\]\]"),
        (lambda: LayoutSpec([LayoutRule("w")]).apply({"w": t}),
         r"^LayoutRule\('w'\) matches 'w', but LayoutRule does not cut tensors \(LayoutRule is a base class\)"),
        (lambda: LayoutSpec([StackRule("w")]).apply({"w": t}),
         r"^StackRule\('w'\) matches 'w', but StackRule does not restack tensors \(StackRule is a base class\)"),
        (lambda: LayoutSpec([Unstacked(r"\.experts\.(\d+)\.w$", repl=".experts.w", experts=4)])
         .logical({"m.experts.1.w": t}),
         r"^the layout's pieces do not cover m\.experts\.w \(8 of 32 elements\)$"),
    ]
    for call, says in refusals:
        with pytest.raises(LayoutRuleError, match=says):
            call()
    # A Reindex whose group 1 is optional leaves a match without it as it is.
    spec = LayoutSpec([Reindex(r"layers\.(\d+)?w", offset=1)])
    assert spec.canonical_name("layers.w") == "layers.w" and spec.canonical_name("layers.2w") == "layers.3w"


def test_logical_keeps_non_tensor_values() -> None:
    """LayoutSpec.logical assembles the tensors and passes any other value through as it is."""
    w = torch.arange(6.0).reshape(3, 2)
    got = LayoutSpec([Replicated("w")]).logical({"w": w, "step": 3})
    assert got["step"] == 3 and bit_equal(got["w"], w) and sorted(got) == ["step", "w"]
