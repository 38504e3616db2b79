"""The placement digest: a checksum of a logical tensor that does not depend on how it is sharded
(definition and cost: docs/format.md, "Placement digests").

Every element is hashed together with its row-major position in the global tensor, and the hashes
are added up modulo 2^64. So any box contributes its own *share*, computed from that box alone, and
the shares of boxes that tile the tensor add up to the digest whatever the layout: a save adds up
the shares of the chunks it writes, a load those of the boxes every rank holds. An element at the
wrong position changes the sum unless 64-bit hashes collide.

Vectorised with numpy's ``uint64`` arithmetic (which wraps modulo 2^64 by definition), in blocks
of 64 Ki elements so that the temporaries stay in the CPU's cache.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from .boxes import row_major_strides

__all__ = ["MASK64", "box_share", "combine", "digest_hex"]

MASK64 = (1 << 64) - 1
K = 0x9E3779B97F4A7C15
M1 = 0xFF51AFD7ED558CCD
M2 = 0xC4CEB9FE1A85EC53
_BLOCK = 1 << 16  # elements hashed per numpy pass: 512 KiB of uint64 temporaries
_SHIFT = np.uint64(33)
_M1 = np.uint64(M1)
_M2 = np.uint64(M2)
_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def box_share(data: torch.Tensor, offsets: Sequence[int], shape: Sequence[int]) -> int:
    """The share of box ``data`` (at ``offsets`` in a global tensor of ``shape``) in the digest.

    ``data`` may live on any device and need not be contiguous; it is copied to contiguous CPU
    memory first where it is not. Returns an integer in ``[0, 2^64)``.
    """
    if not data.numel():
        return 0
    t = data.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
        offsets, shape = (0,), (1,)
    bits = _bits(t)
    sizes = tuple(t.shape)
    strides = row_major_strides(shape)
    # (i * K) is linear in each coordinate: the per-dimension terms are added, never multiplied.
    outer = np.zeros(1, np.uint64)
    for d in range(len(sizes) - 1):
        term = _coord_term(offsets[d], sizes[d], strides[d])
        outer = (outer[:, None] + term[None, :]).reshape(-1)
    return _sum_hashes(bits.reshape(len(outer), sizes[-1]), outer, (offsets[-1], strides[-1]))


def _coord_term(offset: int, size: int, stride: int) -> np.ndarray:
    """``(offset + j) * stride * K mod 2^64`` for ``j`` in ``range(size)``."""
    step = np.uint64(stride * K & MASK64)
    return (np.arange(offset, offset + size, dtype=np.uint64) * step).astype(np.uint64)


def _bits(t: torch.Tensor) -> np.ndarray:
    """The value bits of contiguous CPU tensor ``t`` as unsigned integers, shaped like ``t``."""
    t = t.resolve_conj().resolve_neg()  # the values, not a view's memory
    size = t.element_size()
    # Every torch dtype's elements are 1, 2, 4, 8 or 16 bytes.
    if size == 16:  # complex128: two 64-bit words per element, folded into one
        words = t.view(torch.int64).numpy().view(np.uint64).reshape(*t.shape, 2)
        return np.bitwise_xor(words[..., 0], words[..., 1] * _M2)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.view(_SIGNED[size]).numpy().view(_UNSIGNED[size])


def _sum_hashes(bits: np.ndarray, outer: np.ndarray, last: tuple[int, int]) -> int:
    """Sum of ``fmix64((outer[r] + inner[c]) XOR bits[r, c])`` over the ``(rows, cols)`` block,
    ``inner`` being the last dimension's coordinate terms (``last``: its offset and stride),
    made one column block at a time."""
    rows, cols = bits.shape
    col_step = min(cols, _BLOCK)
    row_step = max(1, _BLOCK // col_step)
    buf = np.empty(row_step * col_step, np.uint64)
    tmp = np.empty_like(buf)
    total = 0
    for c0 in range(0, cols, col_step):
        c1 = min(cols, c0 + col_step)
        inner = _coord_term(last[0] + c0, c1 - c0, last[1])
        for r0 in range(0, rows, row_step):
            r1 = min(rows, r0 + row_step)
            shape = (r1 - r0, c1 - c0)
            n = shape[0] * shape[1]
            x, y = buf[:n].reshape(shape), tmp[:n].reshape(shape)
            np.add(outer[r0:r1, None], inner[None, :], out=x)
            np.bitwise_xor(x, bits[r0:r1, c0:c1], out=x, casting="unsafe")
            for mult in (_M1, _M2, None):
                np.right_shift(x, _SHIFT, out=y)
                np.bitwise_xor(x, y, out=x)
                if mult is not None:
                    np.multiply(x, mult, out=x)
            total += int(np.add.reduce(x, axis=None, dtype=np.uint64))
    return total & MASK64


def combine(shares: Iterable[int]) -> int:
    """The sum of shares modulo 2^64 (shares of boxes that tile a tensor give its digest)."""
    return sum(shares) & MASK64


def digest_hex(digest: int) -> str:
    """The 16-hex-digit form the index records."""
    return f"{digest & MASK64:016x}"
