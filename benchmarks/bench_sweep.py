#!/usr/bin/env python
"""Size sweep: cold load time against state size for DCP, ucp_dcp and the physical limit.

Runs ``bench_reshard.main`` once per state size (``--sizes``, MB of fp32
weights + AdamW state) on the chosen pairs with the ``dcp`` and ``ucp``
formats, each run measuring its own storage limits (best cold read and
write+fsync bandwidth of parallel sequential readers and writers, at the
start and the end of the run). It then prints, per pair and size, the
needed bytes, both formats' cold load times, the physical-limit time for
the needed bytes, and the time per needed GB, which stays flat when time
grows linearly in the needed bytes. The per-size JSON of every run and a
summary go to ``--out``; ``--plot`` draws load time against needed bytes
(one panel per pair) with the limit as a line. The plot needs matplotlib
(the ``demo`` extra) and is skipped with a message without it.

Usage::

    python benchmarks/bench_sweep.py                              # 300, 1000, 3000 MB; dp4-dp3, dp2tp2-dp3
    python benchmarks/bench_sweep.py --sizes 300,3000 --pairs dp2tp2-dp3
    python benchmarks/bench_sweep.py --quick                      # 20 and 80 MB smoke run, out/

See docs/storage-speed.md for the method and the numbers of one run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import bench_reshard
from harness import GB, MB, comma_list, default_out, fmt_num, markdown_table, print_failures, quick_defaults, ratio
from harness import write_json

DEFAULT_PAIRS = "dp4-dp3,dp2tp2-dp3"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, with --quick defaults filled in."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=None,
                   help="comma-separated state sizes, MB (default 300,1000,3000; 20,80 with --quick)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (bench_reshard's default when left out)")
    p.add_argument("--pairs", default=DEFAULT_PAIRS,
                   help=f"comma-separated bench_reshard pairs (default {DEFAULT_PAIRS})")
    p.add_argument("--repeats", type=int, default=None, help="timed cold loads per pair, size and format "
                   "(median reported; default 3, 1 with --quick)")
    p.add_argument("--probe-mb", type=float, default=None,
                   help="storage-bandwidth probe per measurement, MB (default 512, 16 with --quick)")
    p.add_argument("--quick", action="store_true", help="small smoke run")
    p.add_argument("--workdir", default=None, help="checkpoint directory (disk, not tmpfs); default /tmp/...")
    p.add_argument("--out", default=None,
                   help="summary JSON (default benchmarks/results/storage_sweep.json; out/ with --quick)")
    p.add_argument("--plot", default=None, help="PNG path (default: the --out path with .png)")
    p.add_argument("--no-plot", action="store_true", help="skip the plot")
    p.add_argument("--verbose", action="store_true", help="progress lines from the ranks")
    args = p.parse_args(argv)
    quick_defaults(args, sizes=("20,80", "300,1000,3000"), repeats=(1, 3), probe_mb=(16.0, 512.0))
    try:
        args.sizes = [float(x) for x in args.sizes.split(",") if x]
    except ValueError:
        p.error(f"--sizes takes comma-separated numbers of MB, got {args.sizes!r}")
    if not args.sizes or min(args.sizes) <= 0:
        p.error("--sizes needs at least one size > 0")
    args.pairs = comma_list(p, args.pairs, list(bench_reshard.PAIRS), "pair")
    if args.out is None:
        args.out = default_out("storage_sweep.json", args.quick, "bench_sweep_quick.json")
    if args.plot is None:
        args.plot = str(Path(args.out).with_suffix(".png"))
    return args


def _shown(path: Path) -> str:
    """``path`` relative to the checkout when it is inside it (result JSON kept in git stays portable)."""
    try:
        return str(path.resolve().relative_to(Path(__file__).resolve().parent.parent))
    except ValueError:
        return str(path)


def point(size_mb: float, doc: dict[str, Any], pair: str) -> dict[str, Any]:
    """One (size, pair) row of the sweep from a bench_reshard result document."""
    rec = next(r for r in doc["pairs"] if r["pair"] == pair)
    lim = rec.get("limits", {})
    ucp, dcp_ = rec["formats"].get("ucp", {}), rec["formats"].get("dcp", {})
    needed = ucp.get("needed_bytes")
    return {
        "size_mb": size_mb, "state_bytes": doc["state_bytes"], "pair": pair, "needed_bytes": needed,
        "ucp_load_s": ucp.get("load_s"), "dcp_load_s": dcp_.get("load_s"),
        "ucp_load_s_runs": ucp.get("load_s_runs"), "dcp_load_s_runs": dcp_.get("load_s_runs"),
        "ucp_pulled_bytes": ucp.get("pulled_bytes"), "dcp_pulled_bytes": dcp_.get("pulled_bytes"),
        "limit_s": lim.get("limit_s"), "read_bytes_per_s": lim.get("read_bytes_per_s"),
        "ucp_over_limit": lim.get("ucp_over_limit"), "dcp_over_limit": lim.get("dcp_over_limit"),
        "ucp_over_dcp": lim.get("ucp_over_dcp"),
        "ucp_peak_anon_per_rank_max": ucp.get("peak_anon_growth_max"),
        "ucp_s_per_needed_gb": ratio(ucp.get("load_s"), None if needed is None else needed / GB),
        "dcp_s_per_needed_gb": ratio(dcp_.get("load_s"), None if needed is None else needed / GB),
        "limit_s_per_needed_gb": ratio(lim.get("limit_s"), None if needed is None else needed / GB),
    }


def table(points: list[dict[str, Any]]) -> str:
    """Markdown table of the sweep, one row per (pair, size)."""
    rows = [[p["pair"], f"{p['state_bytes'] / MB:.0f}", f"{p['needed_bytes'] / MB:.0f}",
             fmt_num(p["dcp_load_s"], ".3f"), fmt_num(p["ucp_load_s"], ".3f"), fmt_num(p["limit_s"], ".3f"),
             fmt_num(p["ucp_over_limit"], ".2f"), fmt_num(p["dcp_over_limit"], ".2f"),
             fmt_num(p["ucp_over_dcp"], ".2f"), fmt_num(p["dcp_s_per_needed_gb"], ".2f"),
             fmt_num(p["ucp_s_per_needed_gb"], ".2f"), fmt_num(p["limit_s_per_needed_gb"], ".2f")]
            for p in sorted(points, key=lambda p: (p["pair"], p["state_bytes"]))]
    return markdown_table(["pair", "state MB", "needed MB", "dcp s", "ucp s", "limit s", "ucp/limit", "dcp/limit",
                           "ucp/dcp", "dcp s/GB", "ucp s/GB", "limit s/GB"], rows)


def plot(points: list[dict[str, Any]], pairs: Sequence[str], path: Path) -> bool:
    """Cold load time against needed bytes, one panel per pair, to ``path``; False without matplotlib."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[demo]'): no plot", flush=True)
        return False
    fig, axes = plt.subplots(1, len(pairs), figsize=(5.2 * len(pairs), 4.2), squeeze=False)
    series = [("dcp_load_s", "DCP FileSystemReader (median)", "tab:blue", "o-"),
              ("dcp_load_s_min", "DCP, best of the repeats", "tab:blue", "o:"),
              ("ucp_load_s", "ucp_dcp UCPStorageReader (median)", "tab:orange", "s-"),
              ("ucp_load_s_min", "ucp_dcp, best of the repeats", "tab:orange", "s:"),
              ("limit_s", "physical limit (needed bytes / best cold read bandwidth)", "black", "--")]
    for ax, pair in zip(axes[0], pairs):
        pts = sorted((p for p in points if p["pair"] == pair), key=lambda p: p["needed_bytes"])
        xs = [p["needed_bytes"] / GB for p in pts]
        for key, label, color, style in series:
            # the best repeat is the least disturbed by other jobs on a shared machine
            ys = [min(p[key[:-4] + "_runs"] or [None]) if key.endswith("_min") else p[key] for p in pts]
            if all(y is not None for y in ys):
                # the limit is proportional to the needed bytes: draw it from the origin
                ax.plot(([0.0] + xs) if key == "limit_s" else xs, ([0.0] + ys) if key == "limit_s" else ys,
                        style, color=color, label=label)
        src, dst = bench_reshard.PAIRS[pair]
        ax.set_title(f"{bench_reshard.LAYOUTS[src].name} -> {bench_reshard.LAYOUTS[dst].name}: cold load, "
                     "slowest rank", fontsize=10)
        ax.set_xlabel("needed bytes (GB, all target ranks)")
        ax.set_ylabel("s")
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot written to {path}", flush=True)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """One bench_reshard run per size, the sweep table, the JSON and the plot; non-zero if a run failed."""
    args = parse_args(argv)
    t0 = time.perf_counter()
    out = Path(args.out)
    runs_dir = out.with_suffix("")  # per-size JSON next to the summary
    runs: dict[str, Any] = {}
    points: list[dict[str, Any]] = []
    failures: list[str] = []
    for size in args.sizes:
        run_out = runs_dir / f"size_{size:g}mb.json"
        argv_run = ["--size-mb", f"{size:g}", "--pairs", ",".join(args.pairs), "--formats", "dcp,ucp",
                    "--repeats", str(args.repeats), "--probe-mb", f"{args.probe_mb:g}", "--out", str(run_out)]
        if args.hidden:
            argv_run += ["--hidden", str(args.hidden)]
        if args.workdir:
            argv_run += ["--workdir", str(Path(args.workdir) / f"size_{size:g}")]
        if args.verbose:
            argv_run.append("--verbose")
        print(f"\n##### size {size:g} MB: bench_reshard {' '.join(argv_run)}", flush=True)
        rc = bench_reshard.main(argv_run)
        doc = json.loads(run_out.read_text())
        if args.workdir:
            shutil.rmtree(Path(args.workdir) / f"size_{size:g}", ignore_errors=True)
        runs[f"{size:g}"] = {"rc": rc, "json": _shown(run_out), "load_avg": doc.get("load_avg"),
                             "storage_limits": doc.get("storage_limits", {}).get("best"),
                             "verdicts": doc.get("verdicts"), "wall_s": doc.get("wall_s")}
        if rc:
            failures += [f"size {size:g} MB: {f}" for f in doc.get("failures", [])] or [f"size {size:g}: rc {rc}"]
        points += [point(size, doc, pair) for pair in args.pairs]
    # One bandwidth for the whole sweep (the best of every run's start and end measurements),
    # so the limit is one straight line through the origin and every size is judged alike.
    bws = [r["storage_limits"]["read_bytes_per_s"] for r in runs.values() if r.get("storage_limits")]
    read_bw = max(bws) if bws else None
    for pt in points:
        pt["run_limit_s"], pt["run_read_bytes_per_s"] = pt["limit_s"], pt["read_bytes_per_s"]
        pt["read_bytes_per_s"] = read_bw
        pt["limit_s"] = ratio(pt["needed_bytes"], read_bw)
        pt["ucp_over_limit"] = ratio(pt["ucp_load_s"], pt["limit_s"])
        pt["dcp_over_limit"] = ratio(pt["dcp_load_s"], pt["limit_s"])
        pt["limit_s_per_needed_gb"] = ratio(pt["limit_s"], pt["needed_bytes"] / GB)
    if read_bw:
        print(f"\nread bandwidth for the limit: {read_bw / 1e9:.2f} GB/s (best of {len(bws)} runs' measurements; "
              "per run: " + ", ".join(f"{k} MB {r['storage_limits']['read_bytes_per_s'] / 1e9:.2f}"
                                      for k, r in runs.items() if r.get("storage_limits")) + " GB/s)")
    text = table(points)
    print("\n=== size sweep: cold load against state size (slowest rank, median) ===")
    print(text)
    print("s/GB: seconds per needed GB; flat across sizes = time linear in the needed bytes")
    config = {**vars(args), "out": _shown(out), "plot": _shown(Path(args.plot))}
    summary = {"config": config, "read_bytes_per_s": read_bw, "runs": runs, "points": points, "table_md": text,
               "failures": failures,
               "wall_s": time.perf_counter() - t0}
    write_json(out, summary)
    print(f"summary written to {out}")
    if not args.no_plot:
        summary["plot"] = str(args.plot) if plot(points, args.pairs, Path(args.plot)) else None
        write_json(out, summary)
    print_failures(failures, bar=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
