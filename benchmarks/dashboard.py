"""How fast the Accumulation dashboard answers a team sharing one TensorBoard.

Writes 5 runs x 20,000 updates (the callback's per-update series and 4
accumulator norms each) as event files, starts a real `tensorboard` process
on 127.0.0.1 and sends 2,000 requests from 16 concurrent clients, one third
`/runs` and two thirds `/series` (the requests the page makes), once with
TensorBoard's default retention and once with
`--samples_per_plugin=accumulation=0` (everything kept). Prints requests per
second, latency percentiles, the first (uncached) answer of each run's series,
and TensorBoard's resident memory before and after. Each row is measured on
`--repeats` fresh TensorBoard processes (median and range), for each of
TensorBoard's loaders: its Rust data server (`--load_fast=true`, what
`auto` picks where it runs) and its Python loader (`--load_fast=false`,
what `auto` falls back to where the data server cannot run).

    python benchmarks/dashboard.py [--runs 5] [--updates 20000] [--requests 2000]
        [--clients 16] [--repeats 3] [--loaders rust,python]
"""

import argparse
import concurrent.futures
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.proto import summary_pb2
from tensorboard.compat.proto import tensor_pb2
from tensorboard.compat.proto import tensor_shape_pb2
from tensorboard.compat.proto import types_pb2
from tensorboard.summary.writer import event_file_writer

from tfaccum import dashboard_schema

API = "data/plugin/accumulation/"


def write_runs(root, runs, updates, variables, seed=0):
    """Event files as the callback writes them: one point per tag per update."""
    rng = np.random.default_rng(seed)
    tags = [(dashboard_schema.TAG_PREFIX + name, dashboard_schema.create_summary_metadata(kind))
            for name, kind in dashboard_schema.UPDATE_SERIES]
    tags += [(f"{dashboard_schema.ACCUMULATOR_PREFIX}layer_{v}/kernel",
              dashboard_schema.create_summary_metadata(dashboard_schema.Kind.ACCUMULATOR_NORM,
                                                       variable=f"layer_{v}/kernel"))
             for v in range(variables)]
    leftover = [(dashboard_schema.TAG_PREFIX + name, dashboard_schema.create_summary_metadata(kind))
                for name, kind in dashboard_schema.LEFTOVER_SERIES]
    shape = tensor_shape_pb2.TensorShapeProto()
    for r in range(runs):
        writer = event_file_writer.EventFileWriter(str(root / f"run-{r}"))
        values = rng.random((updates, len(tags)))
        for step in range(1, updates + 1):
            summary = summary_pb2.Summary()
            chosen = tags + (leftover if step % 200 == 0 else [])
            row = list(values[step - 1]) + [2.0, 3.0, 24.0][:len(chosen) - len(tags)]
            for (tag, meta), value in zip(chosen, row):
                summary.value.add(
                    tag=tag, metadata=meta if step <= 200 else None,
                    tensor=tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT,
                                                  tensor_shape=shape, float_val=[value]))
            writer.add_event(event_pb2.Event(wall_time=1e9 + step, step=step, summary=summary))
        writer.close()


class TensorBoard:
    """`tensorboard` in a subprocess on 127.0.0.1, a free port."""

    def __init__(self, logdir, *flags):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir),
             "--host", "127.0.0.1", "--port", "0", *flags],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
        self.url, self.log = None, []
        started = threading.Event()

        def read():
            for line in self.process.stderr:
                self.log.append(line)
                found = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
                if found and self.url is None:
                    self.url = found.group(1)
                    started.set()
            started.set()

        threading.Thread(target=read, daemon=True).start()
        started.wait(120)
        if self.url is None:
            self.stop()
            raise SystemExit("TensorBoard did not start:\n" + "".join(self.log[-20:]))

    def get(self, path):
        with urllib.request.urlopen(self.url + path, timeout=120) as response:
            return response.read()

    def rss_mb(self):
        """Resident memory of TensorBoard and its helpers (the Rust data server)."""
        total = 0
        pids = subprocess.run(["pgrep", "-g", str(self.process.pid)], capture_output=True,
                              text=True).stdout.split()
        for pid in pids:
            try:
                fields = Path(f"/proc/{pid}/statm").read_text().split()
                total += int(fields[1]) * os.sysconf("SC_PAGE_SIZE")
            except OSError:
                pass
        return total / 2**20

    def stop(self):
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(30)


def wait_loaded(tb, runs, updates, keep_all):
    """Until every run is listed with all its updates and, keeping all, every
    run's series reads them all; then until TensorBoard lists the same twice."""
    import json

    deadline = time.monotonic() + 1800
    previous = None
    while time.monotonic() < deadline:
        try:
            listed = json.loads(tb.get(API + "runs"))["runs"]
            loaded = len(listed) == runs and all(r["updates"] == updates for r in listed)
            if loaded and keep_all:  # (other parameters: the measured answers stay cold)
                loaded = all(
                    json.loads(tb.get(API + f"series?run={r['run']}&points={updates}"))[
                        "sampled"] == updates for r in listed)
            if loaded and listed == previous:
                return
            previous = listed if loaded else None
        except OSError:
            pass
        time.sleep(2)
    raise SystemExit("TensorBoard never loaded the runs:\n" + "".join(tb.log[-20:]))


def load(tb, runs, requests, clients):
    """Latencies (s) of `requests` requests from `clients` threads, and the wall time."""
    paths = [API + "runs" if i % 3 == 0 else API + f"series?run=run-{i % runs}"
             for i in range(requests)]

    def timed(path):
        start = time.perf_counter()
        tb.get(path)
        return time.perf_counter() - start

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        latencies = list(pool.map(timed, paths))
    return latencies, time.perf_counter() - start


def percentile(values, q):
    return float(np.percentile(np.asarray(values) * 1000, q))


def measure(root, args, flags, keep_all):
    """One fresh TensorBoard: its first answers, then the concurrent load."""
    tb = TensorBoard(root, *flags)
    try:
        wait_loaded(tb, args.runs, args.updates, keep_all)
        first = []
        for r in range(args.runs):
            begin = time.perf_counter()
            tb.get(API + f"series?run=run-{r}")
            first.append(time.perf_counter() - begin)
        before = tb.rss_mb()
        latencies, wall = load(tb, args.runs, args.requests, args.clients)
        after = tb.rss_mb()
    finally:
        tb.stop()
    return dict(rate=len(latencies) / wall, p50=percentile(latencies, 50),
                p90=percentile(latencies, 90), p99=percentile(latencies, 99),
                first=statistics.median(first) * 1000, before=before, after=after)


def spread(results, key, digits=0):
    """`median (min-max)` of one figure over the repeated measurements."""
    values = sorted(r[key] for r in results)
    median = statistics.median(values)
    if len(values) == 1:
        return f"{median:.{digits}f}"
    return f"{median:.{digits}f} ({values[0]:.{digits}f}-{values[-1]:.{digits}f})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--updates", type=int, default=20_000)
    parser.add_argument("--variables", type=int, default=4)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3,
                        help="fresh TensorBoard processes per row (the spread between them)")
    parser.add_argument("--loaders", default="rust,python",
                        help="TensorBoard's loaders to measure: rust (--load_fast=true), "
                             "python (--load_fast=false)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        start = time.perf_counter()
        write_runs(root, args.runs, args.updates, args.variables)
        print(f"wrote {args.runs} runs x {args.updates} updates in "
              f"{time.perf_counter() - start:.0f} s; {args.requests} requests from "
              f"{args.clients} clients; median (min-max) of {args.repeats} fresh TensorBoards",
              flush=True)
        print("| loader | retention | requests/s | p50 (ms) | p90 (ms) | p99 (ms) "
              "| first series per run (ms) | memory before -> after (MB) |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for loader in args.loaders.split(","):
            fast = {"rust": "true", "python": "false"}[loader]
            for label, flags, keep_all in (
                    ("default (1,000 points)", [], False),
                    ("keep all (`accumulation=0`)", ["--samples_per_plugin=accumulation=0"],
                     True)):
                results = [measure(root, args, [f"--load_fast={fast}", *flags], keep_all)
                           for _ in range(args.repeats)]
                memory = (f"{statistics.median(r['before'] for r in results):.0f} -> "
                          f"{statistics.median(r['after'] for r in results):.0f}")
                print(f"| {loader} | {label} | {spread(results, 'rate')} | "
                      f"{spread(results, 'p50')} | {spread(results, 'p90')} | "
                      f"{spread(results, 'p99')} | {spread(results, 'first')} | {memory} |",
                      flush=True)


if __name__ == "__main__":
    main()
