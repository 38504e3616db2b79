"""Hugging Face export and import: universal checkpoint <-> ``transformers`` weights.

:func:`export_hf` turns the model part of a checkpoint (of any format,
saved under any parallel layout) into a Hugging Face model directory that
``AutoModelForCausalLM.from_pretrained`` (or any safetensors reader) loads::

    model-00001-of-00003.safetensors     or model.safetensors when one file is enough
    model-00002-of-00003.safetensors
    model-00003-of-00003.safetensors
    model.safetensors.index.json     {"metadata": {"total_size": ...}, "weight_map": {name: file}}
    config.json                          only when ``config=`` is given

It streams: the shards are planned from the index (dtypes and shapes), each
file's safetensors header is written first, then the tensors' bytes one
tensor at a time, each read with exactly its bytes. Memory holds at most one
tensor (plus the reader's bounded staging buffer for casts); optimizer state
is never read.

:func:`import_hf` goes the other way: a Hugging Face safetensors directory
becomes a universal checkpoint whose keys are ``prefix + name``, so that::

    dcp.load({"model": get_model_state_dict(model)},
             storage_reader=UCPStorageReader(path), planner=UCPLoadPlanner())

loads it into a model under any layout (FSDP2, TP, ...). The source files
are memory-mapped, not read into memory.

Neither needs a process group, a GPU or ``transformers``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..adapters.layout_spec import LayoutSpec
from ..byteio.durable import building_dir, copy_durable, write_all, write_bytes_durable
from ..byteio.location import path_arg
from ..byteio.objstore import is_url, local_path
from ..byteio.progress import ProgressFn, progress_fn
from ..byteio.rangeio import tensor_view
from ..dcp.options import ReadOptions
from ..errors import (
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointKeyError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    PathNotFoundError,
    UCPWarning,
    listed,
)
from ..format import dtype_name, encode_header, header_entries, st_dtype
from ..sources import checkpoint_exists
from ..sources.hf import HF_CONFIG_FILES, HF_INDEX_NAME, HF_WEIGHTS_NAME
from .checkpoint import Checkpoint, dtype_arg, local_output

__all__ = ["export_hf", "import_hf", "parse_size", "parse_dtype"]

RenameRules = Sequence[tuple[str, str]] | Mapping[str, str]


# ====================================================================== helpers


_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string like ``"5GB"``, ``"500MB"``, ``"2GiB"``, ``"1000"``.

    Decimal units follow Hugging Face (``1GB = 10**9`` bytes, ``KB``/``MB``/
    ``GB``/``TB``); binary ``KiB``/``MiB``/``GiB``/``TiB`` are accepted too, in any case, with
    blanks around.
    """
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise InvalidArgumentError(
            f"max_shard_size must be an int or a string like '5GB', got {size!r}"
        )
    if isinstance(size, int):
        value = size
    else:
        m = _SIZE_RE.fullmatch(size)
        scale = _SIZE_UNITS.get(m.group(2).upper()) if m else None
        if m is None or scale is None:
            raise InvalidArgumentError(
                f"invalid size {size!r} for max_shard_size: write bytes or a number with KB, MB, "
                "GB, TB (powers of 1000, as Hugging Face) or KiB, MiB, GiB, TiB"
            )
        value = int(float(m.group(1)) * scale)
    if value <= 0:
        raise InvalidArgumentError(
            f"invalid size {size!r} for max_shard_size: must be at least 1 byte"
        )
    return value


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A floating ``torch.dtype`` from a dtype or a name (``"bf16"``, ``"fp16"``, ``"fp32"``,
    ``"float32"``...)."""
    parsed = dtype_arg(dtype, "dtype")  # the names every entry point takes
    if parsed is not None and (not parsed.is_floating_point or st_dtype(parsed) is None):
        raise InvalidArgumentError(
            f"dtype must be a floating dtype that safetensors stores, got {parsed}"
        )
    return parsed


def _compile_rename(rename: RenameRules | None) -> list[tuple[re.Pattern[str], str]]:
    if rename is None:
        return []
    if not isinstance(rename, (Mapping, list, tuple)):
        raise InvalidArgumentTypeError(
            "rename must be (regex pattern, replacement) pairs or a dict of them, got "
            f"{type(rename).__name__}"
        )
    pairs = list(rename.items()) if isinstance(rename, Mapping) else list(rename)
    rules = []
    for i, pair in enumerate(pairs):
        if not (
            isinstance(pair, (tuple, list))
            and len(pair) == 2
            and all(isinstance(x, str) for x in pair)
        ):
            raise InvalidArgumentError(
                f"rename[{i}] must be a (regex pattern, replacement) pair of strings, got {pair!r}"
            )
        try:
            pattern = re.compile(pair[0])
        except re.error as e:
            raise InvalidArgumentError(
                f"rename[{i}]: {pair[0]!r} is not a valid regular expression ({e})"
            ) from None
        try:
            # re parses the replacement before it looks for a match: refused here, for the
            # rule, not later against whichever tensor happened to be renamed first.
            pattern.sub(pair[1], "")
        except (re.error, IndexError) as e:
            raise InvalidArgumentError(
                f"rename[{i}]: {pair[1]!r} is not a valid replacement for {pair[0]!r} ({e})"
            ) from None
        rules.append((pattern, pair[1]))
    return rules


def _apply_rename(name: str, rules: list[tuple[re.Pattern[str], str]]) -> str:
    for pat, repl in rules:
        name = pat.sub(repl, name)
    return name


def _natural_key(name: str) -> list[tuple[int, str]]:
    # "layers.2" before "layers.10": shards then follow the model's order.
    return [(int(t), "") if t.isdigit() else (-1, t) for t in re.split(r"(\d+)", name)]


def _check_empty_dst(dst: str) -> None:
    if os.path.lexists(dst):
        if not os.path.isdir(dst):
            raise CheckpointExistsError(
                f"{dst} exists and is not a directory; choose a new output directory"
            )
        if os.listdir(dst):
            raise CheckpointExistsError(
                f"{dst} is not empty; refusing to write into it (choose a new or empty output "
                "directory)"
            )


# ====================================================================== export


@dataclass(frozen=True)
class _Planned:
    src: str  # name in the universal checkpoint
    name: str  # name in the Hugging Face files
    dtype: torch.dtype  # dtype written
    st_dtype: str  # its safetensors code
    cast: torch.dtype | None  # dtype to read as (None: as saved)
    shape: tuple[int, ...]
    nbytes: int
    part: str | None = None  # the layout's logical tensor of ``src`` written (None: ``src``)


def _logical_names(
    layout: LayoutSpec, name: str, shape: tuple[int, ...], dtype: torch.dtype
) -> dict[str, tuple[int, ...]]:
    """The logical tensors (name: shape) ``layout`` makes of tensor ``name``, without data."""
    meta = torch.empty(shape, dtype=dtype, device="meta")
    return {k: tuple(v.shape) for k, v in _one_by_one(layout).logical({name: meta}).items()}


def _one_by_one(layout: LayoutSpec) -> LayoutSpec:
    """``layout`` applied to one tensor at a time: a rule matches some tensors, not every one
    (:func:`_plan_export` checks that each matches one)."""
    return dataclasses.replace(layout, allow_unused_rules=True)


def _plan_export(
    ckpt: Checkpoint,
    prefix: str,
    rules: list[tuple[re.Pattern[str], str]],
    cast: torch.dtype | None,
    layout: LayoutSpec | None = None,
) -> list[_Planned]:
    names = [n for n in ckpt.tensor_names() if n.startswith(prefix)]
    values = [v for v in ckpt.value_names() if v.startswith(prefix)]
    if values:
        warnings.warn(
            UCPWarning(
                f"{ckpt.path}: {len(values)} non-tensor value(s) under {prefix!r} are not "
                f"exported (safetensors holds tensors only): {listed(list(map(repr, values)), 5)}"
            ),
            stacklevel=3,
        )
    if not names:
        tops = sorted({n.split(".", 1)[0] + "." for n in ckpt.tensor_names()})
        head = (
            f"{ckpt.path}: no tensor name starts with prefix {prefix!r}; the checkpoint's tensors "
        )
        if not tops:
            raise CheckpointKeyError(head + "start with nothing (it holds no tensors)")
        guess = "model." if "model." in tops else tops[0]
        hint = f"prefix={guess!r}"
        raise CheckpointKeyError(
            f"{head}start with {listed(list(map(repr, tops)))}. Pass the prefix the model was "
            f"saved under, e.g. {hint} (a model saved as {{'model': model_state_dict}} has "
            "'model.')"
        ).with_option("prefix", guess, hint)
    planned: list[_Planned] = []
    seen: dict[str, str] = {}
    if layout is not None and layout.strict and not layout.allow_unused_rules:
        unused = [
            r.describe()
            for r in layout.rules
            if not r.optional and not any(r.regex.search(n[len(prefix) :]) for n in names)
        ]
        if unused:
            raise InvalidArgumentError(
                f"layout: no tensor of {ckpt.path} under {prefix!r} matches {', '.join(unused)}"
            )
    targets: list[tuple[str, str | None, tuple[int, ...]]] = []  # (source, part, shape)
    for src in names:
        rec = ckpt.tensor_record(src)
        shape = tuple(rec.shape)
        if layout is None:
            targets.append((src, None, shape))
        else:
            parts = _logical_names(layout, src[len(prefix) :], shape, rec.dtype)
            targets += [(src, part, s) for part, s in parts.items()]
    for src, part, shape in targets:
        rec = ckpt.tensor_record(src)
        name = _apply_rename(src[len(prefix) :] if part is None else part, rules)
        if not name:
            raise InvalidArgumentError(
                f"tensor {src!r} gets an empty name after stripping {prefix!r} and renaming"
            )
        if name == "__metadata__":
            raise InvalidArgumentError(
                f"tensor {src!r} would be named '__metadata__', which safetensors reserves"
            )
        if name in seen:
            raise InvalidArgumentError(
                f"tensors {seen[name]!r} and {src!r} both map to {name!r}; fix the rename rules"
            )
        seen[name] = src
        to = (
            cast if cast is not None and rec.dtype.is_floating_point and rec.dtype != cast else None
        )
        out_dtype = to or rec.dtype
        code = st_dtype(out_dtype)
        if code is None:
            raise InvalidArgumentError(
                f"tensor {src!r} has dtype {dtype_name(out_dtype)}, which safetensors cannot store"
            )
        nbytes = math.prod(shape) * out_dtype.itemsize
        planned.append(_Planned(src, name, out_dtype, code, to, shape, nbytes, part))
    planned.sort(key=lambda p: _natural_key(p.name))
    return planned


def _shard(planned: list[_Planned], max_bytes: int) -> list[list[_Planned]]:
    """Split in order, Hugging Face style: a new shard when the next tensor would overflow."""
    shards: list[list[_Planned]] = []
    cur: list[_Planned] = []
    size = 0
    for p in planned:
        if cur and size + p.nbytes > max_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(p)  # a tensor larger than max_bytes gets a shard of its own
        size += p.nbytes
    if cur:
        shards.append(cur)
    return shards


def _st_header(entries: Iterable[_Planned]) -> bytes:
    """A standard safetensors header (``__metadata__`` first, as safetensors writes it)."""
    tensors = header_entries((e.name, e.st_dtype, e.shape, e.nbytes) for e in entries)
    return encode_header({"__metadata__": {"format": "pt"}, **tensors})


def _json_file(doc: Any) -> bytes:
    """``doc`` as the bytes of a JSON file, as transformers writes them (indented, keys sorted)."""
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode("utf-8")


def _load_config(config: Any) -> tuple[dict[str, Any], list[str]]:
    """``config`` as a config.json document, plus extra files to copy (paths)."""
    if isinstance(config, Mapping):
        try:  # refused now, not once every tensor is written
            json.dumps(config)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(f"config is not a JSON document ({e})") from None
        return dict(config), []
    if hasattr(config, "to_json_string") and not isinstance(config, (str, os.PathLike)):
        doc = json.loads(config.to_json_string())  # a transformers PretrainedConfig
        return doc, []
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        extra: list[str] = []
        if os.path.isdir(path):
            cfg = os.path.join(path, "config.json")
            if not os.path.isfile(cfg):
                raise PathNotFoundError(f"config directory {path} has no config.json")
            extra = [
                os.path.join(path, n)
                for n in HF_CONFIG_FILES[1:]
                if os.path.isfile(os.path.join(path, n))
            ]
            path = cfg
        elif not os.path.isfile(path):
            raise PathNotFoundError(f"config {path}: no such file or directory")
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise InvalidArgumentError(f"config {path} is not valid JSON ({e})") from None
        if not isinstance(doc, dict):
            raise InvalidArgumentError(f"config {path} is not a JSON object")
        return doc, extra
    raise InvalidArgumentTypeError(
        "config must be a path (config.json or a model directory), a dict or a transformers "
        "config, "
        f"got {type(config).__name__}"
    )


def export_hf(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str | None = None,
    max_shard_size: int | str = "5GB",
    prefix: str = "model.",
    rename: RenameRules | None = None,
    layout: LayoutSpec | None = None,
    config: str | os.PathLike[str] | Mapping[str, Any] | Any | None = None,
    options: ReadOptions | None = None,
    storage_options: dict[str, Any] | None = None,
    dcp_values: str | None = None,
    on_progress: ProgressFn | None = None,
) -> list[str]:
    """Write the model weights of checkpoint ``src`` (any format) as a Hugging Face directory
    ``dst``.

    Args:
        src: the checkpoint, any format :class:`~ucp_dcp.Checkpoint` reads (local, or at an
            fsspec URL).
        dst: the output directory, local; it must not exist or be empty. Everything
            is written into a temporary sibling directory that is renamed to
            ``dst`` at the end, so a crash leaves no half-written output.
        dtype: cast floating tensors to this dtype (``torch.bfloat16`` or
            ``"bf16"``, ``"fp16"``, ``"fp32"``); integer and bool tensors
            keep theirs. Default: as saved.
        max_shard_size: largest file, as an int or ``"5GB"``/``"500MB"``
            (Hugging Face semantics: 1GB = 10**9 bytes). A tensor larger than
            this gets a file of its own. One file is named
            ``model.safetensors``; several are ``model-0000i-of-0000N.safetensors``.
        prefix: only tensors whose name starts with this are exported, with
            it stripped. A checkpoint saved as ``{"model": get_model_state_dict(m),
            "optim": ...}`` names the weights ``"model.<fqn>"``; the default
            ``"model."`` takes exactly those (no optimizer state) and gives
            the module's own names (``model.layers.0.self_attn.q_proj.weight``
            for a ``LlamaForCausalLM``). Non-tensor values are not exported.
        rename: ``(regex pattern, replacement)`` pairs (or an ordered dict),
            applied with ``re.sub`` in order to every name after stripping
            ``prefix``, e.g. ``[(r"^layers\\.", "model.layers.")]`` to map a
            custom model onto Hugging Face names.
        layout: a :class:`~ucp_dcp.LayoutSpec` whose logical tensors are written instead of
            the checkpoint's (applied after stripping ``prefix``, before ``rename``; see
            :meth:`~ucp_dcp.LayoutSpec.logical`): e.g. ``Fused`` splits a Megatron fused QKV
            or SwiGLU weight into Hugging Face's ``q_proj``/``k_proj``/``v_proj`` or
            ``gate_proj``/``up_proj``, ``Reindex`` shifts layer numbers. A rule that matches
            no tensor is refused (``strict``).
        config: optionally also write ``config.json``: a path to a
            ``config.json``, a Hugging Face model directory (its
            ``config.json`` is written and its generation config and
            tokenizer files, :data:`HF_CONFIG_FILES`, are copied), a dict, or a
            ``transformers`` config object. With ``dtype`` given, the
            ``dtype``/``torch_dtype`` entries the config already has are set
            to it. Without ``config``, a Hugging Face source's own
            ``config.json`` (and tokenizer files) are carried over; for any
            other source only weights are written and a ``UserWarning`` says
            so: ``from_pretrained`` needs a ``config.json`` next to them (pass
            ``config=``, or ``config.save_pretrained(dst)`` yourself).
        options, storage_options, dcp_values: how to read ``src``, as
            :class:`~ucp_dcp.Checkpoint` takes them.
        on_progress: ``on_progress(done_bytes, total_bytes)`` after each tensor.

    Returns:
        The paths of the files written in ``dst``: the safetensors files in
        order, then ``model.safetensors.index.json`` (written also for a
        single file; ``from_pretrained`` takes ``model.safetensors`` first),
        then ``config.json`` and copied files if ``config`` was given.

    Tied weights (``tie_word_embeddings``) are exported as saved: if the
    checkpoint holds both ``lm_head.weight`` and the embedding, both are
    written and ``from_pretrained`` ties them again.

    Raises:
        FileNotFoundError: ``src`` does not exist.
        CheckpointFormatError: ``src`` is not a readable checkpoint.
        FileExistsError: ``dst`` exists and is not an empty directory.
        StorageError: ``dst`` is a URL (the output is local), or the store
            of a ``src`` URL cannot be read.
        CheckpointKeyError: no tensor starts with ``prefix`` (the message
            lists the prefixes the checkpoint has).
        ValueError: bad ``dtype``, ``max_shard_size`` or ``rename``, or two
            tensors renamed to the same name.
    """
    src, dst = path_arg(src, "export_hf: src"), path_arg(dst, "export_hf: dst")
    cast = parse_dtype(dtype)
    max_bytes = parse_size(max_shard_size)
    rules = _compile_rename(rename)
    if not isinstance(prefix, str):
        raise InvalidArgumentTypeError(f"prefix must be a string, got {prefix!r}")
    if layout is not None and not isinstance(layout, LayoutSpec):
        raise InvalidArgumentTypeError(
            f"layout must be a LayoutSpec or None, got {type(layout).__name__}"
        )
    progress = progress_fn(on_progress, "export_hf")
    src, dst = local_path(src), local_output(dst, "export_hf")  # file:// URLs are local paths
    if not checkpoint_exists(src, storage_options):
        raise PathNotFoundError(f"{src}: not a checkpoint (no such file or directory)")
    _check_empty_dst(dst)
    # Only a local Hugging Face model carries a config over (object storage holds universal
    # checkpoints only).
    local_hf = not is_url(src) and os.path.isfile(os.path.join(src, "config.json"))
    if config is None and local_hf:
        config = src  # a Hugging Face source carries its own config
    cfg_doc, cfg_extra = _load_config(config) if config is not None else (None, [])
    with Checkpoint(
        src, options=options, storage_options=storage_options, dcp_values=dcp_values
    ) as ckpt:
        planned = _plan_export(ckpt, prefix, rules, cast, layout)
        shards = _shard(planned, max_bytes)
        n = len(shards)
        names = (
            [HF_WEIGHTS_NAME]
            if n == 1
            else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        total = sum(p.nbytes for p in planned)
        last: dict[str, Any] = {}  # the source tensor read last, as its layout's tensors
        with building_dir(dst) as tmp:
            done = 0
            for fname, shard in zip(names, shards):
                fd = os.open(os.path.join(tmp, fname), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    write_all(fd, _st_header(shard))
                    for p in shard:
                        t = _read_part(ckpt, p, prefix, layout, last)
                        write_all(fd, tensor_view(t.contiguous()))
                        del t
                        done += p.nbytes
                        progress(done, total)
                    os.fsync(fd)
                finally:
                    os.close(fd)
            index = {
                "metadata": {
                    "total_size": total,
                    "total_parameters": sum(math.prod(p.shape) for p in planned),
                },
                "weight_map": {p.name: fname for fname, shard in zip(names, shards) for p in shard},
            }
            written = [*names, HF_INDEX_NAME]
            write_bytes_durable(os.path.join(tmp, HF_INDEX_NAME), _json_file(index))
            if cfg_doc is not None:
                if cast is not None:
                    for key in ("dtype", "torch_dtype"):
                        if key in cfg_doc:
                            cfg_doc[key] = dtype_name(cast)
                write_bytes_durable(os.path.join(tmp, "config.json"), _json_file(cfg_doc))
                written.append("config.json")
                for path in cfg_extra:
                    copy_durable(path, os.path.join(tmp, os.path.basename(path)))
                    written.append(os.path.basename(path))
    if cfg_doc is None:  # said once the export is done, not before a failure
        hint = "config=PATH"
        warnings.warn(
            UCPWarning(
                f"{dst}: wrote the weights only; transformers' from_pretrained also needs a "
                f"config.json there: pass {hint}, a config.json or a Hugging Face model directory"
            ).with_option("config", "PATH", hint),
            stacklevel=2,
        )
    return [os.path.join(dst, w) for w in written]


def _read_part(
    ckpt: Checkpoint,
    p: _Planned,
    prefix: str,
    layout: LayoutSpec | None,
    last: dict[str, Any],
) -> torch.Tensor:
    """The tensor ``p`` writes: its source tensor, or the part of it that ``layout`` names
    (the source read once for its parts, which are planned one after another)."""
    if p.part is None or layout is None:
        return ckpt.read_tensor(p.src, dtype=p.cast)
    if last.get("src") != p.src:
        t = ckpt.read_tensor(p.src, dtype=p.cast)
        last.clear()
        last.update(src=p.src, parts=_one_by_one(layout).logical({p.src[len(prefix) :]: t}))
    parts: dict[str, torch.Tensor] = last["parts"]
    return parts[p.part]


# ====================================================================== import


def import_hf(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    prefix: str = "model.",
    on_progress: ProgressFn | None = None,
) -> None:
    """Write the weights of Hugging Face model ``src`` as a universal checkpoint at ``dst``.

    ``ucp-dcp convert`` does the same for any source; this keeps the
    Hugging Face defaults: names get ``prefix`` (``"model."`` loads into
    ``{"model": get_model_state_dict(model)}`` under any layout), and
    ``dst`` must not exist or be empty. It is written in a temporary sibling
    directory and renamed at the end. Loading does not need it: every entry
    point reads the Hugging Face directory itself.

    Raises:
        CheckpointFormatError: ``src`` is not a safetensors model, an index
            names a missing file, a file is not valid safetensors, a tensor
            is missing from the file the index names, or a name appears twice.
        FileExistsError: ``dst`` exists and is not an empty directory.
        StorageError: ``dst`` is a URL (the output is local, as ``export_hf``'s).
    """
    from ..sources import HFSource, NativeSource, SourceOptions
    from .convert import convert

    src, dst = path_arg(src, "import_hf: src"), path_arg(dst, "import_hf: dst")
    if not isinstance(prefix, str):
        raise InvalidArgumentTypeError(f"prefix must be a string, got {prefix!r}")
    dst = local_output(dst, "import_hf")
    progress = progress_fn(on_progress, "import_hf")
    if not os.path.exists(src):
        raise PathNotFoundError(f"{src}: no such Hugging Face model directory or file")
    if NativeSource.detect(src):
        raise CheckpointFormatError(
            f"{src} is a ucp_dcp checkpoint, not a Hugging Face model directory (export it with "
            "export_hf)"
        )
    if not HFSource.detect(src):
        HFSource.open(src, SourceOptions())  # raises, saying what is missing
    _check_empty_dst(dst)
    with building_dir(dst) as tmp:
        convert(src, tmp, prefix=prefix, on_progress=progress)
