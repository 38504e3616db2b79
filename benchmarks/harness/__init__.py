"""What every benchmark script shares, once: launching, measuring, formats, states, reporting.

=============  ==============================================================
module         owns
=============  ==============================================================
``launch``     spawned gloo ranks, forked children, free ports, progress lines
``pagecache``  fsync + eviction, page-cache residency, bytes a read pulled
``memory``     RSS, peaks (VmHWM, sampled anonymous memory), /proc/self/io
``limits``     storage read/write bandwidth, memory-copy floor, device-synced timing
``formats``    dcp / ucp / hf writers, readers, planners; save, load
``states``     closed-form values, AdamW-shaped states, the 70B-class model
``report``     units, formatting, statistics, tables, result JSON
``cli``        comma-separated choices, ``--quick`` defaults
=============  ==============================================================

The scripts in ``benchmarks/`` import it as ``harness`` (their directory is
on ``sys.path`` when run as ``python benchmarks/bench_*.py``).
"""

from __future__ import annotations

from . import _srcpath  # noqa: F401  (first: the checkout's ucp_dcp)
from .cli import comma_list, quick_defaults
from .formats import FORMATS, async_save_state, load_planner, load_state, make_reader, make_writer, metadata_file
from .formats import reader_counters
from .formats import round_trip, save_planner, save_state
from .launch import ChildFailed, fresh_dir, free_port, log, rank_log, run_forked, set_rank_env, spawn_ranks
from .limits import StorageLimits, best_of, copy_floor, parallel_read, parallel_sequential_read, parallel_write
from .limits import sequential_read, storage_limits, sync, timed
from .memory import (
    PAGE,
    PeakMemorySampler,
    PhaseProbe,
    PhaseRecord,
    ProcessTreeSampler,
    max_rss_bytes,
    mem_available,
    page_reporting,
    page_reporting_held,
    peak_rss_bytes,
    proc_io,
    proc_read_bytes,
    release_free_memory,
    reset_peak_rss,
    rss_bytes,
    tree_pss_bytes,
)
from .pagecache import (
    PulledBytes,
    TurnTakingReader,
    dir_bytes,
    evict,
    evict_tree,
    files_under,
    fs_type,
    fsync_and_evict,
    fsync_files,
    read_ahead_kb,
    resident_bytes,
    resident_fraction,
    total_resident_bytes,
)
from .report import GB, MB, Column, MiB, default_out, fmt_mb, fmt_num, markdown_table, median, paired_ratio
from .report import paired_ratios, print_failures, ratio, stats, text_table, verdict, write_json
from .states import ADAMW_HYPER, adamw_state, bit_equal, leaves, local, seed_of, synth_values, tensor_bytes, tensors

__all__ = [
    "ADAMW_HYPER", "FORMATS", "GB", "MB", "PAGE", "ChildFailed", "Column", "MiB", "PeakMemorySampler",
    "PhaseProbe", "PhaseRecord", "ProcessTreeSampler", "PulledBytes", "StorageLimits", "TurnTakingReader", "adamw_state", "async_save_state",
    "best_of", "bit_equal", "comma_list", "copy_floor", "default_out", "dir_bytes", "evict", "evict_tree",
    "files_under", "fmt_mb", "fmt_num", "free_port", "fresh_dir", "fs_type", "fsync_and_evict", "fsync_files",
    "leaves", "load_planner", "load_state", "local", "log", "make_reader", "make_writer", "markdown_table",
    "max_rss_bytes", "median", "mem_available", "metadata_file", "page_reporting", "page_reporting_held", "paired_ratio", "paired_ratios", "parallel_read", "parallel_sequential_read",
    "parallel_write", "peak_rss_bytes",
    "print_failures", "proc_io", "proc_read_bytes", "quick_defaults", "rank_log", "ratio", "read_ahead_kb",
    "reader_counters",
    "release_free_memory", "reset_peak_rss", "resident_bytes", "resident_fraction", "round_trip", "rss_bytes",
    "run_forked", "save_planner", "save_state", "seed_of", "sequential_read", "set_rank_env", "spawn_ranks",
    "stats", "storage_limits", "sync", "synth_values", "tensor_bytes", "tensors", "text_table", "timed", "total_resident_bytes", "tree_pss_bytes",
    "verdict", "write_json"
]
