"""ZeRO flat-partition arithmetic (sources/_zero_layout.py): every element of every parameter is found where DeepSpeed puts it."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ucp_dcp.sources._zero_layout import zero12_segments, zero3_segments, segment_boxes

shapes = st.lists(st.lists(st.integers(1, 5), min_size=0, max_size=3), min_size=1, max_size=6)


@settings(max_examples=300)
@given(shapes, st.integers(1, 5), st.integers(0, 7))
def test_zero12_segments_reassemble_every_parameter(shs: list[list[int]], W: int, pad: int) -> None:
    """One group cut into W equal partitions (with end padding): each parameter reassembles from its boxes."""
    numels = [math.prod(s) for s in shs]
    total = sum(numels) + pad; P = math.ceil(total / W)
    sizes = [P]*W
    full = torch.arange(P*W, dtype=torch.float64)
    parts = list(full.split(P))
    o = 0
    for sh, segs in zip(shs, zero12_segments(numels, sizes, 3)):
        want = full[o:o+math.prod(sh)].view(sh); o += math.prod(sh)
        got = torch.full(sh, -1.0, dtype=torch.float64)
        for sg in segs:
            assert sg.buffer == 3
            for box, off in segment_boxes(sh, sg):
                idx = tuple(slice(a, a+n) for a, n in zip(box.offsets, box.sizes))
                got[idx] = parts[sg.rank][off:off+box.numel].view(box.sizes)
        assert torch.equal(got, want)


@settings(max_examples=300)
@given(shapes, st.integers(1, 5), st.lists(st.integers(1, 9), min_size=1, max_size=4))
def test_zero3_segments_reassemble_every_parameter(shs: list[list[int]], W: int, cuts: list[int]) -> None:
    """Parameters padded to W slices, per-rank buffers cut into sub-groups anywhere: each reassembles."""
    numels = [math.prod(s) for s in shs]
    per = sum(math.ceil(n/W) for n in numels)
    # split per-rank buffer into sub-groups at arbitrary points, last absorbs rest
    sizes = []; left = per
    for c in cuts:
        if left <= 0: break
        sizes.append(min(c, left)); left -= sizes[-1]
    if left > 0: sizes.append(left)
    fulls = [torch.cat([torch.arange(n, dtype=torch.float64) + 1000*i, torch.full((math.ceil(n/W)*W-n,), -7.0, dtype=torch.float64)]) for i, n in enumerate(numels)]
    ranks = [torch.cat([f.view(W, -1)[r] for f in fulls]) if fulls else torch.zeros(0) for r in range(W)]
    bufs = [list(rk.split(sizes)) for rk in ranks]
    for i, (sh, segs) in enumerate(zip(shs, zero3_segments(numels, W, sizes))):
        got = torch.full(sh, -1.0, dtype=torch.float64)
        for sg in segs:
            for box, off in segment_boxes(sh, sg):
                idx = tuple(slice(a, a+n) for a, n in zip(box.offsets, box.sizes))
                got[idx] = bufs[sg.rank][sg.buffer][off:off+box.numel].view(box.sizes)
        assert torch.equal(got, fulls[i][:numels[i]].view(sh))
