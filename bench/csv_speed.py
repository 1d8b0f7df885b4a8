"""CSV writing: slotscope's column-wise CsvWriter against pandas' to_csv, same table, same run.

    /tmp/venv/bin/python bench/csv_speed.py [LOG] [--table tasks] [--repeat 3] [--batch-rows N]

LOG defaults to bench/out/100MB/llama-server.log. The table is built once with
read_server_logs and made text with for_text (timed apart); then pandas and CsvWriter write
it to /dev/null alternately, ``--repeat`` times each (wall and CPU seconds, medians), their
bytes are compared once, and the peak memory of each for one batch is measured: Python and
numpy allocations (tracemalloc) plus pyarrow's (a proxy pool's high-water mark).
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import pandas as pd
import pyarrow as pa

from slotscope.output import CsvWriter, for_text
from slotscope.server_log import read_server_logs

ROOT = Path(__file__).resolve().parent.parent


def iso_strftime(col: pd.Series) -> pd.Series:
    """output.iso for UTC as it was before (strftime), for comparison."""
    text = col.dt.strftime("%Y-%m-%dT%H:%M:%S.%f").str.replace(r"\.000000$", "", regex=True) + "+00:00"
    return text.where(col.notna(), "")


def timed(fn) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def peak_bytes(fn) -> int:  # type: ignore[no-untyped-def]
    """Peak of Python/numpy allocations plus peak of pyarrow's, while fn runs (an upper bound)."""
    pool = pa.proxy_memory_pool(pa.default_memory_pool())
    old = pa.default_memory_pool()
    pa.set_memory_pool(pool)
    tracemalloc.start()
    try:
        fn()
        _, py_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        pa.set_memory_pool(old)
    return py_peak + pool.max_memory()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", nargs="?", default=str(ROOT / "bench" / "out" / "100MB" / "llama-server.log"))
    ap.add_argument("--table", default="tasks", choices=["tasks", "gen_samples", "prefill_samples"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--batch-rows", type=int, default=100_000, help="rows of the batch whose peak memory is measured")
    ap.add_argument("--add-times", action="store_true",
                    help="add UTC wall-clock columns from the *_s ones (as logs with wall times have) to time for_text too")
    args = ap.parse_args()

    t = time.perf_counter()
    df = getattr(read_server_logs([args.log]), args.table)
    print(f"{args.table} of {args.log}: {len(df):,} rows x {df.shape[1]} columns, read in {time.perf_counter() - t:.1f} s")
    if args.add_times:
        start = pd.Timestamp("2025-05-01T08:00:00", tz="UTC")
        times = [c for c in df.columns if c.endswith("_s") and df[c].dtype == "float64"][:4]
        df = df.assign(**{c[:-2] + "_wall": start + pd.to_timedelta(df[c].round(6), unit="s").dt.as_unit("us") for c in times})
        old = timed(lambda: df.assign(**{c[:-2] + "_wall": iso_strftime(df[c[:-2] + "_wall"]) for c in times}))[0]
        print(f"added {len(times)} UTC time columns; their ISO text by strftime (before): {old:.3f} s")
    t = time.perf_counter()
    text = for_text(df)
    print(f"for_text: {time.perf_counter() - t:.3f} s; dtypes: {dict(text.dtypes.astype(str).value_counts())}")

    with open(os.devnull, "w") as null:
        runs: dict[str, list[tuple[float, float]]] = {"pandas": [], "CsvWriter": []}
        for _ in range(args.repeat):
            runs["pandas"].append(timed(lambda: text.to_csv(null, index=False)))
            runs["CsvWriter"].append(timed(lambda: CsvWriter(null).write(text)))
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in runs.items()}
    for k, (w, c) in med.items():
        print(f"{k:10s} wall {w:7.3f} s  cpu {c:7.3f} s  (runs: {', '.join(f'{w:.2f}' for w, _ in runs[k])})")
    print(f"speed-up: wall {med['pandas'][0] / med['CsvWriter'][0]:.1f}x, cpu {med['pandas'][1] / med['CsvWriter'][1]:.1f}x")

    ours = io.StringIO()
    CsvWriter(ours).write(text)
    print("bytes identical:", ours.getvalue() == text.to_csv(index=False), f"({len(ours.getvalue()):,} chars)")
    del ours

    batch = text.iloc[: args.batch_rows]
    own = batch.memory_usage(deep=True, index=False).sum()
    with open(os.devnull, "w") as null:
        mine = peak_bytes(lambda: CsvWriter(null).write(batch))
        theirs = peak_bytes(lambda: batch.to_csv(null, index=False))
        whole = peak_bytes(lambda: CsvWriter(null).write(text))
    mb = 1e6
    print(f"peak memory, one batch of {len(batch):,} rows ({own / mb:.1f} MB in memory): CsvWriter {mine / mb:.1f} MB "
          f"({mine / own:.2f}x the batch), pandas {theirs / mb:.1f} MB ({theirs / own:.2f}x)")
    print(f"peak memory, whole table as one batch ({text.memory_usage(deep=True, index=False).sum() / mb:.0f} MB): CsvWriter {whole / mb:.1f} MB")


if __name__ == "__main__":
    sys.exit(main())
