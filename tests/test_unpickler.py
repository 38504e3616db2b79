"""The library's one restricted unpickler (``ucp_dcp.sources._pickle``): what each purpose of its
allow-list table accepts, and that anything else is refused by name, exactly, before it is built.

Single process, no process group: pickles are made here with ``pickle``, ``torch.save`` and
``dcp.save``.
"""

from __future__ import annotations

import ast
import fractions
import io
import os
import pickle
import sys
import types
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

from ucp_dcp import CheckpointFormatError
from ucp_dcp.byteio.rangeio import ReadStats
from ucp_dcp.sources.distcp import read_dcp_metadata
from ucp_dcp.sources._pickle import ALLOWED, Inert, PurposeName, TensorRef, unpickle
from ucp_dcp.sources._torch_archive import read_torch_archive
from ucp_dcp.sources._torch_archive import parse_tensor_item

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

SRC = Path(__file__).parent.parent / "src" / "ucp_dcp"
SYSTEM = f"{os.system.__module__}.system"  # posix.system on Linux
ARCHIVE_REFUSAL = ": it is not one of the classes this format stores"
ITEM_REFUSAL = ": only plain dense tensors (torch._utils._rebuild_tensor_v2/v3) are read from DCP items"
METADATA_REFUSAL = (
    " from .metadata: only DCP's own metadata and plan records (and torch.Size, dtypes, layouts) are "
    "loaded; this file is damaged, hostile, or was written by a planner that stores its own classes "
    "in the metadata"
)
REFUSALS = {"deepspeed": ARCHIVE_REFUSAL, "distcp_item": ITEM_REFUSAL, "dcp_metadata": METADATA_REFUSAL}


class _System:
    """Unpickling this would run ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _standin(monkeypatch: pytest.MonkeyPatch, module: str, name: str) -> type:
    """A class that pickles as ``module.name`` (DeepSpeed's, without DeepSpeed installed)."""
    cls = type(name, (), {})
    cls.__module__, cls.__qualname__ = module, name
    parts = module.split(".")
    for i in range(1, len(parts) + 1):  # the module and its parent packages
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    for i in range(1, len(parts)):
        setattr(sys.modules[".".join(parts[:i])], parts[i], sys.modules[".".join(parts[: i + 1])])
    setattr(sys.modules[module], name, cls)
    return cls


def _torch_save(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _data_pkl(archive: bytes) -> bytes:
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        (name,) = [n for n in z.namelist() if n.endswith("/data.pkl")]
        return z.read(name)


def test_one_subclass_of_pickle_unpickler_in_src() -> None:
    """Every pickle the library reads goes through one class."""
    found = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                ast.unparse(b) in ("pickle.Unpickler", "Unpickler", "_pickle.Unpickler") for b in node.bases
            ):
                found.append(f"{path.relative_to(SRC)}:{node.name}")
    assert found == ["sources/_pickle.py:RestrictedUnpickler"]


# ---------------------------------------------------------------- refused by name


@pytest.mark.parametrize("purpose", sorted(ALLOWED))
def test_os_system_is_refused_by_name_before_it_runs(purpose: PurposeName, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    for protocol in (2, pickle.HIGHEST_PROTOCOL):  # GLOBAL and STACK_GLOBAL
        with pytest.raises(CheckpointFormatError) as e:
            unpickle(pickle.dumps(_System(marker), protocol=protocol), "f.pkl", purpose)
        assert str(e.value) == f"f.pkl: refusing to unpickle {SYSTEM}{REFUSALS[purpose]}"
    assert not marker.exists()


@pytest.mark.parametrize("purpose", sorted(ALLOWED))
@pytest.mark.parametrize(
    "raw", [b"cbuiltins\neval\n(S'1'\ntR.", b"c__builtin__\neval\n(S'1'\ntR.", b"ctorch\nload\n(S'x'\ntR."],
    ids=["eval", "py2_eval", "torch_load"],
)
def test_callables_outside_the_table_are_refused(purpose: PurposeName, raw: bytes) -> None:
    """A hand-written REDUCE of builtins.eval or torch.load, in the Python 3 and 2 spellings."""
    module, name = raw[1:].split(b"\n")[:2]
    with pytest.raises(CheckpointFormatError) as e:
        unpickle(raw, "f.pkl", purpose)
    assert str(e.value) == f"f.pkl: refusing to unpickle {module.decode()}.{name.decode()}{REFUSALS[purpose]}"


def test_an_entry_of_one_purpose_is_refused_in_another(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's classes are not DCP's; a Parameter is a DeepSpeed tensor, not a DCP item."""
    scaler = pickle.dumps(_standin(monkeypatch, "deepspeed.runtime.fp16.loss_scaler", "LossScaler")(), protocol=2)
    with pytest.raises(CheckpointFormatError) as e:
        unpickle(scaler, ".metadata", "dcp_metadata")
    assert str(e.value) == (
        f".metadata: refusing to unpickle deepspeed.runtime.fp16.loss_scaler.LossScaler{METADATA_REFUSAL}"
    )
    item = _torch_save(torch.nn.Parameter(torch.ones(2)))
    with pytest.raises(CheckpointFormatError) as e:
        unpickle(_data_pkl(item), "item", "distcp_item", {"0"})
    assert str(e.value) == f"item: refusing to unpickle torch._utils._rebuild_parameter{ITEM_REFUSAL}"
    assert isinstance(unpickle(_data_pkl(item), "item", "deepspeed", {"0"}), TensorRef)


def test_dcp_metadata_with_a_disallowed_global_is_refused(tmp_path: Path) -> None:
    """A real .metadata whose planner_data holds a class outside the table (harmless, but not DCP's)."""
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path))
    md = read_dcp_metadata(tmp_path)
    md.planner_data = {"w": fractions.Fraction(1, 3)}
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointFormatError) as e:
        read_dcp_metadata(tmp_path)
    assert str(e.value) == f"{tmp_path / '.metadata'}: refusing to unpickle fractions.Fraction{METADATA_REFUSAL}"


def test_persistent_ids_and_storages() -> None:
    """.metadata has no persistent ids; an archive's name only the storage records it holds."""

    class _Pid(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return ("storage", "x") if obj == "pid" else None

    buf = io.BytesIO()
    _Pid(buf).dump(["pid"])
    with pytest.raises(CheckpointFormatError) as e:
        unpickle(buf.getvalue(), ".metadata", "dcp_metadata")
    assert str(e.value) == ".metadata: refusing persistent id ('storage', 'x') in .metadata"
    with pytest.raises(CheckpointFormatError) as e:
        unpickle(buf.getvalue(), "a.pt", "deepspeed")
    assert str(e.value) == "a.pt: refusing persistent id ('storage', 'x'): only torch.save storage records are read"
    pkl = _data_pkl(_torch_save(torch.ones(2)))
    with pytest.raises(CheckpointFormatError) as e:
        unpickle(pkl, "a.pt", "deepspeed", {"1"})
    assert str(e.value) == "a.pt: the pickle refers to storage data/0, which the archive does not hold"
    with pytest.raises(CheckpointFormatError) as e:
        unpickle(pkl[:-5], "a.pt", "deepspeed", {"0"})
    assert str(e.value).startswith("a.pt: data.pkl is not a readable pickle (")


# ---------------------------------------------------------------- accepted, inert


def test_deepspeed_purpose_accepts_its_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors (also tagged with attributes), containers, torch.Size, dtypes and DeepSpeed's classes."""
    scaler = _standin(monkeypatch, "deepspeed.runtime.fp16.loss_scaler", "LossScaler")()
    scaler.cur_scale = 1.0
    flat = torch.arange(6.0)
    flat.ds_id = 3  # a Python attribute: pickled through _rebuild_from_type_v2
    path = tmp_path / "optim_states.pt"
    torch.save({"fp32": [flat], "moment": torch.ones(2, 3).t(), "scaler": scaler, "shape": torch.Size([2, 3]),
                "dtype": torch.bfloat16, "ids": {1, 2}}, path)
    a = read_torch_archive(str(path), "deepspeed")
    (t,), m = a.obj["fp32"], a.obj["moment"]
    assert t == TensorRef(t.storage, torch.float32, 0, (6,), (1,))
    assert (m.size, m.stride, m.dtype) == ((3, 2), (1, 3), torch.float32)
    raw = path.read_bytes()
    start, nbytes = a.byte_range(t, "fp32")
    assert raw[start:start + nbytes] == flat.numpy().tobytes()
    assert isinstance(a.obj["scaler"], Inert) and a.obj["scaler"].field("cur_scale") == 1.0
    assert a.obj["scaler"].qualname == "deepspeed.runtime.fp16.loss_scaler.LossScaler"
    assert (a.obj["shape"], a.obj["dtype"], a.obj["ids"]) == (torch.Size([2, 3]), torch.bfloat16, {1, 2})


@pytest.mark.parametrize(
    "tensor",
    [torch.arange(12.0).reshape(3, 4), torch.arange(12.0).reshape(3, 4).t(),
     torch.arange(6, dtype=torch.int32).to(torch.uint16), torch.arange(5, dtype=torch.int64)[1:]],
    ids=["v2", "transposed", "v3_uint16", "offset"],
)
def test_distcp_item_purpose_gives_the_storage_and_geometry(tensor: torch.Tensor) -> None:
    """A DCP item (torch.save of one tensor): where its bytes are, never built."""
    raw = b"pad" + _torch_save(tensor) + b"tail"
    st = parse_tensor_item(lambda n, off: raw[off:off + n], 3, len(raw) - 7, "item", ReadStats())
    assert (st.dtype, st.size, st.stride, st.storage_offset) == (
        tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor.storage_offset())
    storage = bytes(tensor.untyped_storage())
    assert raw[st.data_start:st.data_start + st.record_nbytes] == storage


def test_distcp_item_that_holds_no_tensor() -> None:
    raw = _torch_save({"a": 1})
    with pytest.raises(CheckpointFormatError) as e:
        parse_tensor_item(lambda n, off: raw[off:off + n], 0, len(raw), "item", ReadStats())
    assert str(e.value) == "item: the item does not hold a tensor"


def test_dcp_metadata_purpose_accepts_dcps_records(tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(3, dtype=torch.bfloat16), "step": 4}, checkpoint_id=str(tmp_path))
    md = read_dcp_metadata(tmp_path)
    assert isinstance(md, Metadata) and set(md.state_dict_metadata) == {"w", "step"}
    assert md.state_dict_metadata["w"].properties.dtype == torch.bfloat16
    plain = [torch.Size([2]), torch.strided, torch.float16, Path("a/b")]
    assert unpickle(pickle.dumps(plain), ".metadata", "dcp_metadata") == plain


# ---------------------------------------------------------------- damaged archives


def _rezip(raw: bytes, replace: dict[str, bytes] | None = None, compress: str = "") -> bytes:
    """``raw`` (a torch.save archive) written again by zipfile: members named in ``replace``
    with those bytes, those whose name ends with ``compress`` (if given) deflated."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(raw)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = (replace or {}).get(info.filename, src.read(info))
            method = zipfile.ZIP_DEFLATED if compress and info.filename.endswith(compress) else zipfile.ZIP_STORED
            dst.writestr(info.filename, data, compress_type=method)
    return out.getvalue()


def _central_sizes(raw: bytes, member: str, size: int, field: int = 20) -> bytes:
    """``raw`` with ``member``'s central directory entry recording ``size`` bytes (stored and
    uncompressed alike; ``field`` 42: its local header at offset ``size`` instead), its data
    untouched."""
    at = 0
    while True:
        at = raw.index(b"PK\x01\x02", at)
        name_len = int.from_bytes(raw[at + 28 : at + 30], "little")
        if raw[at + 46 : at + 46 + name_len].decode() == member:
            break
        at += 4
    if field == 42:
        return raw[: at + 42] + size.to_bytes(4, "little") + raw[at + 46 :]
    sizes = size.to_bytes(4, "little") * 2
    return raw[: at + 20] + sizes + raw[at + 28 :]


def _w() -> bytes:
    return _torch_save({"w": torch.arange(6.0)})


def _bad_local_header(raw: bytes) -> bytes:
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        at = z.getinfo("archive/data/0").header_offset
    return raw[:at] + b"XX" + raw[at + 2 :]


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda raw: raw.replace(b"data.pkl", b"data.pkx"),
            "not a torch.save archive (no single <name>/data.pkl)",
        ),
        (
            lambda raw: _rezip(raw, {"archive/byteorder": b"big"}),
            "big-endian tensor data is not supported",
        ),
        (
            lambda raw: _rezip(raw, compress="data/0"),
            "record archive/data/0 is compressed or encrypted",
        ),
        (_bad_local_header, "bad local zip header for archive/data/0"),
        (
            lambda raw: _central_sizes(raw, "archive/data/0", 1 << 20),
            "storage record data/0 runs past the end of the file",
        ),
    ],
)
def test_a_damaged_archive_is_refused_naming_the_file_and_record(
    tmp_path: Path, damage: Any, message: str
) -> None:
    """A real torch.save archive damaged in its zip structure (the pickle renamed, big-endian
    data, a compressed or misplaced storage record, one said to run past the end) is refused
    naming the file and the record, before any tensor is read."""
    path = tmp_path / "states.pt"
    path.write_bytes(damage(_w()))
    with pytest.raises(CheckpointFormatError) as e:
        read_torch_archive(str(path), "deepspeed")
    assert str(e.value) == f"{path}: {message}"


def test_a_pickle_over_the_limit_is_refused_before_it_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """data.pkl's size (from the zip directory) over the limit for state: refused unread."""
    import ucp_dcp.sources._torch_archive as ta

    path = tmp_path / "states.pt"
    path.write_bytes(_w())
    size = len(_data_pkl(_w()))
    monkeypatch.setattr(ta, "_MAX_PICKLE_BYTES", size - 1)
    with pytest.raises(CheckpointFormatError) as e:
        read_torch_archive(str(path), "deepspeed")
    assert str(e.value) == f"{path}: data.pkl of {size} bytes is too large to be state"


def test_a_storage_record_shorter_than_its_tensor_and_a_strided_tensor(tmp_path: Path) -> None:
    """A record the directory says is 8 bytes, holding a tensor of 24, and a transposed tensor:
    neither is a byte range to read, each refused naming the file and the tensor."""
    path = tmp_path / "states.pt"
    raw = _torch_save({"w": torch.arange(6.0), "t": torch.ones(2, 3).t()})
    path.write_bytes(_central_sizes(raw, "archive/data/0", 8))
    a = read_torch_archive(str(path), "deepspeed")
    with pytest.raises(CheckpointFormatError) as e:
        a.byte_range(a.obj["w"], "fp32 weight 'w'")
    assert str(e.value) == (
        f"{path}: fp32 weight 'w' (24 bytes at element 0) runs past its storage record data/0 "
        "of 8 bytes"
    )
    with pytest.raises(CheckpointFormatError) as e:
        a.byte_range(a.obj["t"], "moment 't'")
    assert str(e.value) == f"{path}: moment 't' is not stored row-major (stride [1, 3])"


def test_a_file_that_cannot_be_opened_is_refused_naming_it(tmp_path: Path) -> None:
    """A model states file that is a directory (or unreadable): named, with the reason."""
    path = tmp_path / "mp_rank_00_model_states.pt"
    path.mkdir()
    with pytest.raises(CheckpointFormatError) as e:
        read_torch_archive(str(path), "deepspeed")
    assert str(e.value) == f"{path}: cannot open (Is a directory)"


def test_a_distcp_item_past_the_end_of_its_file_or_too_short_is_refused() -> None:
    """An item whose file ends early (pread returns nothing), and one too short to hold a
    zip's end records: refused naming the item, not read as zeros or raised raw."""
    raw = _torch_save(torch.arange(6.0))
    with pytest.raises(CheckpointFormatError) as e:
        parse_tensor_item(lambda n, off: raw[off : off + n], 0, len(raw) + 4096, "item", ReadStats())
    assert str(e.value) == "item: truncated: the data file ends inside the item"
    with pytest.raises(CheckpointFormatError) as e:
        parse_tensor_item(lambda n, off: raw[off : off + n], 0, 10, "item", ReadStats())
    # zipfile's seek to the end record before the item's start is an OSError: not an archive
    assert str(e.value) == "item: not a readable torch.save archive (File is not a zip file)"
    # A storage record whose local header the directory puts past the item's end.
    bad = _central_sizes(raw, "archive/data/0", len(raw) + 100, field=42)
    with pytest.raises(CheckpointFormatError) as e:
        parse_tensor_item(lambda n, off: bad[off : off + n], 0, len(bad), "item", ReadStats())
    assert str(e.value) == "item: bad local zip header for archive/data/0"


# ---------------------------------------------------------------- tensors that are not torch.save's


class _Stor:
    """Pickled as torch.save's persistent id of storage record ``data/0`` of class ``cls``."""

    def __init__(self, cls: Any) -> None:
        self.cls = cls


class _Call:
    """Pickled as a REDUCE of ``func(*args)`` (what torch.save writes for a tensor)."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.func, self.args)


def _hand_pickle(obj: Any) -> bytes:
    """``obj`` pickled as torch.save pickles (protocol 2, storages as persistent ids)."""

    class _P(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:
            return ("storage", o.cls, "0", "cpu", 6) if isinstance(o, _Stor) else None

    buf = io.BytesIO()
    _P(buf, protocol=2).dump(obj)
    return buf.getvalue()


_V2, _V3 = torch._utils._rebuild_tensor_v2, torch._utils._rebuild_tensor_v3
_F = _Stor(torch.FloatStorage)
_U = _Stor(torch.UntypedStorage)


def _v2(storage: Any = _F, size: Any = (6,), stride: Any = (1,), *meta: Any) -> _Call:
    return _Call(_V2, storage, 0, size, stride, False, OrderedDict(), *meta)


@pytest.mark.parametrize(
    "obj, message",
    [
        (_v2(_F, "6"), "a tensor with malformed geometry 0, '6', (1,)"),
        (_v2(_F, (6,), (1,), "x"), "a tensor with malformed metadata 'x'"),
        (_v2(_F, (6,), (1,), {"layout": 1}), "a tensor with metadata 'layout', which this reader does not know"),
        (_v2(5), "a tensor whose storage is int, not a storage record"),
        (_v2(_U), "a tensor (torch._utils._rebuild_tensor_v2) over an untyped storage"),
        (
            _Call(_V3, _F, 0, (6,), (1,), False, OrderedDict(), torch.float32),
            "a tensor (torch._utils._rebuild_tensor_v3) whose storage is not an untyped storage record",
        ),
        (
            _Call(_V3, _U, 0, (6,), (1,), False, OrderedDict(), "float32"),
            "a tensor of unknown dtype 'float32'",
        ),
        (_Call(torch._utils._rebuild_parameter, 5, False, OrderedDict()), "a Parameter around int"),
        (
            _Call(torch._tensor._rebuild_from_type_v2, torch._utils._rebuild_parameter, torch.Tensor, (), {}),
            "a tensor subclass (torch._tensor._rebuild_from_type_v2 of another type)",
        ),
    ],
    ids=["geometry", "metadata", "metadata_key", "storage", "v2_untyped", "v3_typed", "v3_dtype", "parameter", "subclass"],
)
def test_a_tensor_record_torch_save_does_not_write_is_refused(obj: Any, message: str) -> None:
    """The calls torch.save pickles for a tensor, with arguments it never writes (hand-made:
    no writer makes them), are refused naming the file and what is wrong, never built."""
    with pytest.raises(CheckpointFormatError) as e:
        unpickle(_hand_pickle({"t": obj}), "a.pt", "deepspeed", {"0"})
    assert str(e.value) == f"a.pt: {message}"


def test_view_bits_that_are_false_and_slotted_state_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.save's metadata {'conj': False, 'neg': False} is a plain tensor; a DeepSpeed
    record whose state is (dict, slots) gives fields from both."""
    import copyreg

    t = unpickle(_hand_pickle(_v2(_F, (2, 3), (3, 1), {"conj": False, "neg": False})), "a.pt", "deepspeed", {"0"})
    assert t == TensorRef("0", torch.float32, 0, (2, 3), (3, 1))

    scaler = _standin(monkeypatch, "deepspeed.runtime.fp16.loss_scaler", "LossScaler")
    state = ({"cur_scale": 2.0}, {"cur_iter": 4})  # what pickle saves of a class with __slots__
    scaler.__reduce_ex__ = lambda self, protocol: (copyreg.__newobj__, (type(self),), state)  # type: ignore[method-assign]
    a = unpickle(pickle.dumps(scaler(), protocol=2), "a.pt", "deepspeed")
    assert isinstance(a, Inert) and (a.field("cur_scale"), a.field("cur_iter")) == (2.0, 4)
    assert repr(a) == (
        "<deepspeed.runtime.fp16.loss_scaler.LossScaler args=() state=({'cur_scale': 2.0}, "
        "{'cur_iter': 4})>"
    )
