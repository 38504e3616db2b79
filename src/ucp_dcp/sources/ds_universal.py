"""A DeepSpeed Universal checkpoint (``ds_to_universal`` output) as a source, read in place.

One ``torch.save`` file per parameter and state (``zero/<fqn>/fp32.pt``,
``exp_avg.pt``, ``exp_avg_sq.pt``, ``step.pt``), next to the model states
DeepSpeed copied from the checkpoint it converted. Each tensor is one chunk
at its byte range; the pickles are read as inert records
(:mod:`._torch_archive`). Names are those of :mod:`.deepspeed`'s source.
"""

from __future__ import annotations

import math
import os

from ..core.values import encode_value
from ..errors import CheckpointFormatError
from ._archive_index import ArchiveIndex, check_sizes
from ._dirs import ModelDir
from ._ds_utils import (
    LATEST_UNIVERSAL_FILE,
    UNIVERSAL_DIR,
    UNIVERSAL_MODEL_FILES,
    looks_like_universal,
    read_model_states,
    universal_folder,
    universal_model_files,
)
from ._pickle import TensorRef
from ._torch_archive import TorchArchive, read_torch_archive
from .base import Source, SourceOptions, register
from .deepspeed import zero3_frozen

__all__ = ["DeepSpeedUniversalSource"]


@register
class DeepSpeedUniversalSource(Source):
    """A DeepSpeed Universal checkpoint (``ds_to_universal`` output): one file per parameter and
    state.

    The directory with ``latest_universal``, or the tag folder. Each
    ``zero/<fqn>/{fp32,exp_avg,exp_avg_sq}.pt`` holds the full tensor under
    ``"param"``; ``step.pt`` the step. Names are as for
    :class:`DeepSpeedSource`. The folder records no optimizer
    hyperparameters, so ``optim.param_groups.<g>`` has ``params`` only: load
    the others from your own optimizer (``allow_partial_load=True``).
    Converted from ZeRO-3, the folder stores tensors flattened (read in their
    shapes), no ``step.pt`` and no files for frozen parameters (read from the
    copied per-rank model states), and no ``optim.param_groups`` is given.
    """

    format = "deepspeed-universal"
    checksums = False
    title = "DeepSpeed Universal"
    looks_for = f"{LATEST_UNIVERSAL_FILE} / {UNIVERSAL_DIR}/"
    detect_order = 40

    def __init__(self, path: str) -> None:
        folder = universal_folder(path)
        model_files = universal_model_files(folder)
        if not model_files:
            raise CheckpointFormatError(
                f"{folder}: a DeepSpeed Universal folder without model states "
                f"(expected {' or '.join(UNIVERSAL_MODEL_FILES)})"
            )
        models = [read_model_states(f) for f in model_files]
        m0 = models[0]
        b = ArchiveIndex([m.archive for m in models])
        zero = os.path.join(folder, UNIVERSAL_DIR)

        def one(
            fqn: str, kind: str, shape: tuple[int, ...] | None
        ) -> tuple[TorchArchive, TensorRef] | None:
            f = os.path.join(zero, fqn, f"{kind}.pt")
            if not os.path.isfile(f):
                return None
            a = read_torch_archive(f, "deepspeed")
            t = a.obj.get("param") if isinstance(a.obj, dict) else a.obj
            if not isinstance(t, TensorRef):
                raise CheckpointFormatError(
                    f"{f}: holds no tensor (expected a dict with 'param', or a tensor)"
                )
            # From a ZeRO-3 source, ds_to_universal saves each tensor flattened
            # (1-D, the same elements in row-major order): read as the shape.
            if (
                shape is not None
                and t.size != shape
                and not (t.size == (math.prod(shape),) and t.stride == (1,))
            ):
                raise CheckpointFormatError(
                    f"{f}: a tensor of shape {list(t.size)}, expected {list(shape)} from "
                    "param_shapes "
                    "(padded vocabularies and tensor-parallel universal folders are not supported)"
                )
            b.add_archive(a)
            return a, t

        shapes = {fqn: shape for d in m0.param_shapes for fqn, shape in d.items()}
        for fqn, shape in {**shapes, **m0.frozen_shapes}.items():
            got = one(fqn, "fp32", shape)
            if got is None and fqn not in shapes and len(models) > 1:
                # From ZeRO-3, ds_to_universal writes no files for frozen
                # parameters; the copied per-rank model states hold them.
                zero3_frozen(b, models, fqn, shape)
                continue
            if got is None:
                raise CheckpointFormatError(f"{zero}: no {fqn}/fp32.pt for parameter {fqn!r}")
            b.whole(f"model.{fqn}", ("model", fqn), got[0], got[1], shape, f"parameter {fqn!r}")
            if fqn not in shapes:
                continue
            for kind in ("exp_avg", "exp_avg_sq", "step"):
                got = one(fqn, kind, None if kind == "step" else shape)
                if got is not None:
                    b.whole(
                        f"optim.state.{fqn}.{kind}",
                        ("optim", "state", fqn, kind),
                        got[0],
                        got[1],
                        got[1].size if kind == "step" else shape,
                        f"{kind} of {fqn!r}",
                    )
        for tied, owner in m0.shared.items():
            b.alias(f"model.{tied}", ("model", tied), f"model.{owner}")
        for name in m0.buffer_names:
            t = m0.module.get(name)
            if t is None:
                raise CheckpointFormatError(
                    f"{m0.archive.path}: buffer {name!r} is not in the module state dict"
                )
            b.whole(f"model.{name}", ("model", name), m0.archive, t, t.size, f"buffer {name!r}")
        # From ZeRO-3, param_shapes lists the optimizer's sub-groups, not its
        # parameter groups: no optim.param_groups there.
        for g, d in enumerate(m0.param_shapes if len(models) == 1 else []):
            b.value(
                f"optim.param_groups.{g}.params", ("optim", "param_groups", g, "params"), list(d)
            )
        super().__init__(
            path, b.index(1, path, [0] * len(b.archives)), [a.path for a in b.archives]
        )
        self._values = b.values

    @classmethod
    def detect_dir(cls, d: ModelDir) -> bool:
        """A directory with ``latest_universal``, or a folder with ``zero/`` and its model states
        (ZeRO-1/2 or 3)."""
        return looks_like_universal(d)

    @classmethod
    def open_dir(cls, d: ModelDir, options: SourceOptions) -> DeepSpeedUniversalSource:
        """Read every file's pickle (as inert records; tensor data is not read). A local directory
        only: one in object storage is refused, naming it."""
        if d.store is not None:
            raise CheckpointFormatError(
                f"{d.where}: a DeepSpeed Universal checkpoint is read from a local directory only; "
                "copy it to one first"
            )
        return cls(d.where)

    def decode_value(self, key: str, raw: bytes) -> bytes:
        """Values (the groups' parameter names) come from ``param_shapes``, read when opened."""
        return encode_value(self._values[key], key)

    def check_files(self) -> list[str]:
        """Every file is still the size it was when opened."""
        return check_sizes(self)
