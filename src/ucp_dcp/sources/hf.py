"""A Hugging Face safetensors model (``save_pretrained``) as a source.

One file (``model.safetensors``) or a sharded directory
(``model.safetensors.index.json`` plus its files). Every tensor is one chunk
(the whole tensor) at its byte range in its file, so a rank that needs some
rows of a weight reads exactly those rows. Names are the file's, with
``SourceOptions.prefix`` in front (``"model."`` gives the names of
``get_state_dict(model, optim)``). Safetensors records no checksums; the
headers are checked against the files' sizes.

The same model in object storage (a :class:`~ucp_dcp.sources._dirs.StoreDir` view) is found by
listing the URL instead of the directory; each file's header is read with
ranged requests (its size, then one request for a header under 64 KiB), and
tensors with the source's ranged reads like any other.
"""

from __future__ import annotations

import errno

from ..byteio.files import read_safetensors
from ..byteio.objstore import ObjectAccess
from ..core.sharding import Box
from ..errors import CheckpointFormatError, InvalidArgumentTypeError, StorageError
from ..format import (
    ChunkRecord,
    FileRecord,
    Index,
    Location,
    TensorRecord,
    dtype_from_st,
)
from ._hf_utils import (
    HF_INDEX_NAME,
    HF_WEIGHTS_NAME,
    ModelDir,
    find_hf_files,
    local_model_dir,
    looks_like_hf,
)
from .base import Source, SourceOptions, register

__all__ = ["HFSource"]


@register
class HFSource(Source):
    """A Hugging Face safetensors model directory, or one ``.safetensors`` file or index."""

    format = "hf"
    checksums = False
    title = "Hugging Face"
    looks_for = f"{HF_WEIGHTS_NAME} / {HF_INDEX_NAME} / one .safetensors file"
    detect_order = 50
    opens_files = True

    def __init__(
        self,
        path: str,
        prefix: str = "",
        *,
        model_dir: ModelDir | None = None,
        named: str | None = None,
    ) -> None:
        """Open local ``path``; or, given ``model_dir`` (then ``path`` is only shown), the model in
        it.

        ``named``: with ``model_dir``, one ``.safetensors`` file or index in it named directly.
        """
        if not isinstance(prefix, str):
            raise InvalidArgumentTypeError(
                f"HFSource({path!r}): prefix must be a string, got {prefix!r}"
            )
        d: ModelDir
        d, named = (model_dir, named) if model_dir is not None else local_model_dir(path)
        names, weight_map = find_hf_files(d, named)
        directory = d.where
        files: list[FileRecord] = []
        tensors: dict[str, TensorRecord] = {}
        where: dict[str, str] = {}
        for fi, fname in enumerate(names):
            st = read_safetensors(d.path_of(fname), d.access(fname))
            files.append(FileRecord(fname, 0, st.size))
            for e in st.entries.values():
                dtype = dtype_from_st(e.st_dtype)
                if dtype is None:
                    raise CheckpointFormatError(
                        f"{st.path}: tensor {e.name!r} has dtype {e.st_dtype!r}, which torch "
                        "cannot hold"
                    )
                # parse_safetensors checked the byte count against dtype and shape.
                key = prefix + e.name
                if key in tensors:
                    raise CheckpointFormatError(
                        f"{directory}: tensor {e.name!r} is in both {where[key]} and {fname}"
                    )
                if weight_map is not None and weight_map.get(e.name, fname) != fname:
                    raise CheckpointFormatError(
                        f"{directory}: the index puts {e.name!r} in {weight_map[e.name]}, but it "
                        f"is in {fname}"
                    )
                box = Box((0,) * len(e.shape), e.shape)
                loc = Location(fi, e.start, e.nbytes, "")
                tensors[key] = TensorRecord(
                    dtype, e.shape, None, False, chunks=[ChunkRecord(box, loc)]
                )
                where[key] = fname
        if weight_map is not None:
            missing = sorted(k for k, v in weight_map.items() if prefix + k not in tensors)
            if missing:
                raise CheckpointFormatError(
                    f"{directory}: the index lists {len(missing)} tensor(s) missing from their "
                    "files, e.g. "
                    f"{missing[0]!r} in {weight_map[missing[0]]}"
                )
        if not tensors:
            raise CheckpointFormatError(f"{path}: holds no tensors")
        super().__init__(path, Index(1, files, tensors, {}, {}), [d.path_of(f.name) for f in files])
        self.store = d.store

    @classmethod
    def detect_dir(cls, d: ModelDir) -> bool:
        """``model.safetensors``, a ``*.safetensors.index.json``, or one such file named
        directly."""
        if d.named is not None:
            return d.named.endswith((".safetensors", ".safetensors.index.json"))
        return looks_like_hf(d)

    @classmethod
    def open_dir(cls, d: ModelDir, options: SourceOptions) -> HFSource:
        """Parse every file's header (nothing else is read; in a store, with ranged requests)."""
        return cls(d.location, options.prefix, model_dir=d, named=d.named)

    def check_files(self) -> list[str]:
        """Every file's header parses and its size is what it was when opened."""
        problems = []
        for path, f in zip(self.paths, self.index.files):
            try:
                # On a store, ObjectAccess asks for the object's size now (not the one recorded at
                # open).
                access = ObjectAccess(self.store, f.name) if self.store is not None else None
                size = read_safetensors(path, access).size
                if size != f.size:
                    problems.append(f"{path}: {size} bytes on disk, {f.size} when opened")
            except CheckpointFormatError as e:
                problems.append(str(e))
            except StorageError as e:
                if (
                    e.errno != errno.ENOENT
                ):  # a store that cannot be reached is no finding about the files
                    raise
                problems.append(str(e))
        return problems
