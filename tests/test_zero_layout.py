"""ZeRO flat-partition arithmetic (``sources/_ds_records.py``).

Every element of every parameter must be found where DeepSpeed puts it:
buffers are filled with known values laid out as DeepSpeed lays them out,
and each parameter is reassembled from the boxes the arithmetic gives.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ucp_dcp.sources._ds_records import Segment, segment_boxes, zero3_segments, zero12_segments

shapes = st.lists(st.lists(st.integers(1, 5), min_size=0, max_size=3), min_size=1, max_size=6)


def _reassemble(shape: list[int], segs: list[Segment], buffers: list[list[torch.Tensor]]) -> torch.Tensor:
    got = torch.full(shape, -1.0, dtype=torch.float64)
    for sg in segs:
        for box, off in segment_boxes(shape, sg):
            idx = tuple(slice(a, a + n) for a, n in zip(box.offsets, box.sizes))
            got[idx] = buffers[sg.rank][sg.buffer][off : off + box.numel].view(box.sizes)
    return got


@settings(max_examples=300, deadline=None)
@given(shapes, st.integers(1, 5), st.integers(0, 7))
def test_zero12_segments_reassemble_every_parameter(shs: list[list[int]], world: int, pad: int) -> None:
    """One group cut into equal partitions (with end padding): each parameter reassembles from its boxes."""
    numels = [math.prod(s) for s in shs]
    part = math.ceil((sum(numels) + pad) / world)
    flat = torch.arange(part * world, dtype=torch.float64)
    buffers = [[torch.empty(0)] * 3 + [p] for p in flat.split(part)]  # group 3 of each rank
    o = 0
    for shape, segs in zip(shs, zero12_segments(numels, [part] * world, buffer=3)):
        n = math.prod(shape)
        assert torch.equal(_reassemble(shape, segs, buffers), flat[o : o + n].view(shape))
        o += n


@settings(max_examples=300, deadline=None)
@given(shapes, st.integers(1, 5), st.lists(st.integers(1, 9), min_size=1, max_size=4))
def test_zero3_segments_reassemble_every_parameter(shs: list[list[int]], world: int, cuts: list[int]) -> None:
    """Parameters padded to ``world`` slices, per-rank buffers cut into sub-groups anywhere: each reassembles."""
    numels = [math.prod(s) for s in shs]
    per_rank = sum(math.ceil(n / world) for n in numels)
    sizes: list[int] = []
    left = per_rank
    for c in cuts:
        if left > 0:
            sizes.append(min(c, left))
            left -= sizes[-1]
    if left > 0:
        sizes.append(left)
    padded = [
        torch.cat([torch.arange(n, dtype=torch.float64) + 1000 * i,
                   torch.full((math.ceil(n / world) * world - n,), -7.0, dtype=torch.float64)])
        for i, n in enumerate(numels)
    ]
    buffers = [list(torch.cat([p.view(world, -1)[r] for p in padded]).split(sizes)) for r in range(world)]
    for i, (shape, segs) in enumerate(zip(shs, zero3_segments(numels, world, sizes))):
        assert torch.equal(_reassemble(shape, segs, buffers), padded[i][: numels[i]].view(shape))
