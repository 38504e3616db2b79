"""The on-disk format: names and constants, records and the JSON index, safetensors data-file
headers.

Everything here is plain data and its (de)serialisation from and to bytes: no
file is opened here. Reading and writing files lives in :mod:`ucp_dcp.byteio`
(data-file headers: :mod:`~ucp_dcp.byteio.rangeio`; committing the index:
:mod:`~ucp_dcp.byteio.location`) and :mod:`ucp_dcp.sources` (loading and
rebuilding the index: :mod:`~ucp_dcp.sources.native`). The names most
callers need are re-exported here.
"""

from ..core.values import dtype_name
from .header import (
    EntryMeta,
    FileHeader,
    PlannedEntry,
    SafetensorsHeader,
    encode_header,
    has_block_sums,
    header_entries,
    layout_file,
    parse_header,
    parse_safetensors,
)
from .index import WrittenEntry, build_index, index_bytes, index_digest, parse_index
from .names import (
    ALIGN,
    BLOCK_BYTES,
    BLOCK_SUMS_ENTRY,
    FORMAT_VERSION,
    INDEX_FILE,
    LAYOUT_KEY,
    PAD_PREFIX,
    RANK_LOCAL_PREFIX,
    VALUE_PREFIX,
    chunk_entry_name,
    data_file_name,
    dtype_from_st,
    rank_local_entry_name,
    rank_local_key,
    split_rank_local_key,
    st_dtype,
    value_entry_name,
)
from .records import (
    ChunkRecord,
    FileRecord,
    Index,
    Layout,
    Location,
    RunList,
    TensorRecord,
    decode_runs,
    encode_runs,
)

__all__ = [
    "ALIGN",
    "BLOCK_BYTES",
    "BLOCK_SUMS_ENTRY",
    "FORMAT_VERSION",
    "INDEX_FILE",
    "LAYOUT_KEY",
    "PAD_PREFIX",
    "RANK_LOCAL_PREFIX",
    "VALUE_PREFIX",
    "chunk_entry_name",
    "data_file_name",
    "dtype_name",
    "rank_local_entry_name",
    "rank_local_key",
    "split_rank_local_key",
    "st_dtype",
    "value_entry_name",
    "ChunkRecord",
    "FileRecord",
    "Index",
    "Layout",
    "Location",
    "TensorRecord",
    "RunList",
    "decode_runs",
    "encode_runs",
    "EntryMeta",
    "FileHeader",
    "PlannedEntry",
    "SafetensorsHeader",
    "layout_file",
    "parse_header",
    "parse_safetensors",
    "dtype_from_st",
    "encode_header",
    "header_entries",
    "has_block_sums",
    "WrittenEntry",
    "build_index",
    "index_bytes",
    "index_digest",
    "parse_index",
]
