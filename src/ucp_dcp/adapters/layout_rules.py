"""A declarative layout language: regex rules that say how a rank's tensors map to logical tensors.

Megatron-style training state is not described by DTensors: a fused QKV
weight holds this TP rank's rows of three matrices, an embedding carries
padding rows, a pipeline stage calls global layer 12 ``layers.0``, an
expert-parallel rank calls global expert 6 ``experts.0``. A
:class:`LayoutSpec` is a list of rules, matched by regular expression on the
DCP-flattened key of every state-dict leaf, that turn each tensor into
:class:`~ucp_dcp.core.pieces.TensorPieces` of canonical *logical* tensors (global
names, unfused, unpadded). The checkpoint then holds ``layers.12.attn.q.weight``
whatever layout saved it, and the same kind of spec, built for the target
layout, loads it::

    spec = LayoutSpec(
        [Rename(r"_orig_mod\\.", ""),
         Reindex(r"layers\\.(\\d+)\\.", offset=first_layer_of_stage),
         Reindex(r"experts\\.(\\d+)\\.", axis="ep", per_rank=experts_per_rank),
         Fused(r"\\.qkv\\.", dim=0, parts={".q.": nq * hd, ".k.": nkv * hd, ".v.": nkv * hd},
               groups=nkv, axis="tp"),
         Fused(r"\\.gate_up\\.", dim=0, parts={".gate.": ffn, ".up.": ffn}, axis="tp"),
         Shard(r"\\.(o|down)\\.weight", dim=1, axis="tp"),
         VocabPad(r"embed\\.weight", dim=0, size=vocab, axis="tp"),
         Replicated(r"norm", axis="tp")],
        axes={"tp": (tp_rank, tp_size), "ep": (ep_rank, ep_size)},
    )
    dcp.save(spec.apply(state, record=True), storage_writer=..., planner=UCPSavePlanner())
    dcp.load(target_spec.apply(state), storage_reader=..., planner=UCPLoadPlanner())

How a key is handled:

1. :class:`Rename` and :class:`Reindex` rules apply, in order, to the key
   (every rule whose pattern matches).
2. The first *layout* rule (:class:`Shard`, :class:`Fused`,
   :class:`VocabPad`, :class:`Replicated`, :class:`Averaged`) whose pattern
   ``re.search``-es the renamed key decides the pieces.
3. A tensor no layout rule matches: a DTensor describes itself (left as it
   is, or cut into pieces under its new name if renamed); a plain tensor is
   an error when ``strict`` (the layout cannot explain it), else saved as a
   full replicated copy.

Non-tensor leaves (ints, ``param_groups`` lists, :class:`~ucp_dcp.RankLocal`)
are kept at their keys. The returned state dict has the caller's structure,
so the keys DCP sees do not change; every piece is a view of the caller's
tensor, so a load writes in place.

``strict`` also makes a rule that matches no key on this rank an error. The
check is per rank: under pipeline or expert parallelism a rule that only
some ranks need (the embedding on the first stage) should be marked
``optional=True``, or the spec built per rank with only the rules it needs.

``apply(..., record=True)`` stores the spec (rules and this rank's axis
coordinates, as JSON) in the checkpoint under ``"__ucp_layout__"`` as a
:class:`~ucp_dcp.RankLocal`; :meth:`LayoutSpec.from_json` rebuilds it.
"""

from ..errors import LayoutRuleError
from ..format.names import LAYOUT_KEY
from .layout_spec import LayoutSpec
from .rules import Averaged, Fused, LayoutRule, Reindex, Rename, Replicated, Rule, Shard, VocabPad

__all__ = [
    "LayoutRuleError",
    "Rule",
    "LayoutRule",
    "Rename",
    "Reindex",
    "Shard",
    "Fused",
    "VocabPad",
    "Replicated",
    "Averaged",
    "LayoutSpec",
    "LAYOUT_KEY",
]
