"""Runs the benchmark set and writes its tables into benchmarks/RESULTS.md.

Each table sits in RESULTS.md between `<!-- benchmark: NAME -->` and
`<!-- /benchmark -->`; this script runs each benchmark once (with the
arguments RESULTS.md states), takes the table it printed and puts it in
place under one line that says where and when it was measured (machine,
date, library versions, commit), so that a table rerun alone (`--only`)
still says its own. The file's header says the same of the last run. The
prose around a table (what it says, with its spread) is still read and
written by a person: `git diff benchmarks/RESULTS.md` shows what moved.

    python benchmarks/run_all.py            # everything (about 2 hours on 2 cores)
    python benchmarks/run_all.py --only memory,precision
    python benchmarks/run_all.py --device gpu   # the GPU's own tables (gpu-...)
    make benchmarks

On a GPU (`--device gpu`, or `auto` where TensorFlow sees one) the set is
`GPU_TABLES`, written between markers of their own (`gpu-...`): a GPU run
adds its figures beside the CPU's and never writes over them. Each can run
alone (`--only gpu-memory`), to fit a machine lent for minutes.
"""

import argparse
import datetime
import importlib.metadata
import os
import pathlib
import platform
import re
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "RESULTS.md"

# name: (script and arguments, which printed table RESULTS.md shows)
TABLES = {
    "exactness-sequences": (["exactness.py"], 1),
    "exactness-optimizers": (["exactness.py"], 0),
    "distributed": (["distributed.py"], 0),
    "throughput-mlp": (["throughput.py", "--width", "512", "--samples", "512",
                        "--rounds", "100", "--no-memory"], 1),
    "throughput-wall": (["throughput.py", "--width", "1024", "--micro-batch", "32",
                         "--steps", "4", "--samples", "8192", "--rounds", "30",
                         "--clock", "wall", "--threads", "0", "--no-memory"], 1),
    "throughput-cnn": (["throughput.py", "--model", "cnn", "--micro-batch", "16",
                        "--samples", "512", "--rounds", "30", "--no-memory"], 1),
    "step-time-wall": (["step_time.py", "--rounds", "150"], 1),
    "step-time-cpu": (["step_time.py", "--width", "512", "--micro-batch", "8", "--steps", "8",
                       "--rounds", "400", "--clock", "cpu", "--threads", "1"], 1),
    "memory": (["memory.py", "--repeats", "3"], 0),
    "memory-rss": (["memory.py", "--repeats", "3", "--allocator", "default",
                    "--variants", "keras,tfaccum,bfloat16"], 0),
    "step-ops": (["step_ops.py"], 0),
    "precision": (["precision.py"], 0),
    "sparse-window": (["sparse_window.py"], 0),
    "dashboard": (["dashboard.py"], 0),
    "window-loss": (["window_loss.py", "--repeats", "2"], 0),
    "window-loss-jax": (["window_loss.py", "--repeats", "3", "--backend", "jax"], 0),
    "jax": (["jax_backend.py", "--repeats", "5"], 0),
    "jax-data-parallel": (["jax_backend.py", "--repeats", "3", "--devices", "2"], 0),
    "torch": (["torch_backend.py", "--repeats", "3"], 0),
    "backup": (["backup_cost.py", "--repeats", "3"], 0),
}
# On a GPU: the wider models of the CPU's tables (an MLP of 1M weights is all
# launch overhead there), timed as users run them (wall clock, TensorFlow's
# threads; Keras' `jit_compile="auto"` picks XLA), and peak memory read from
# the GPU's allocator. Rounds are fewer: a lent machine is held for minutes.
GPU_THROUGHPUT = ["throughput.py", "--width", "4096", "--micro-batch", "64", "--steps", "4",
                  "--samples", "16384", "--rounds", "10", "--clock", "wall", "--threads", "0"]
GPU_TABLES = {
    "gpu-throughput-epochs": (GPU_THROUGHPUT, 0),  # one run gives both tables
    "gpu-throughput": (GPU_THROUGHPUT, 1),
    "gpu-step-time": (["step_time.py", "--width", "4096", "--micro-batch", "64",
                       "--rounds", "60", "--clock", "wall", "--threads", "0"], 1),
    "gpu-memory": (["memory.py", "--repeats", "2"], 0),
}
MARKER = re.compile(r"<!-- benchmark: (?P<name>[\w-]+) -->\n(?P<body>.*?)<!-- /benchmark -->",
                    re.DOTALL)
HEADER = re.compile(r"<!-- run -->\n.*?<!-- /run -->", re.DOTALL)
# Whose versions a table's line gives (the ones installed that the benchmarks import).
LIBRARIES = ("tensorflow", "keras", "tf_keras", "jax", "torch", "keras-hub")


def tables_of(text):
    """The Markdown tables in a benchmark's output, in order (each a string)."""
    tables, current = [], []
    for line in text.splitlines():
        if line.startswith("|"):
            current.append(line.rstrip())
        elif current:
            tables.append("\n".join(current))
            current = []
    if current:
        tables.append("\n".join(current))
    return tables


def tables_for(device, only):
    """The tables a run on `device` ("cpu" or "gpu") writes: all, or those `only` names.

    Raises:
        ValueError: for a name unknown, or another device's table.
    """
    tables, other = (GPU_TABLES, TABLES) if device == "gpu" else (TABLES, GPU_TABLES)
    if not only:
        return dict(tables)
    names = only.split(",")
    elsewhere = [name for name in names if name in other]
    if elsewhere:
        their = "cpu" if device == "gpu" else "gpu"
        raise ValueError(
            f"{elsewhere} measure the {their.upper()}, not the {device.upper()} this run "
            f"measures: run them with --device {their}.")
    unknown = sorted(set(names) - set(tables))
    if unknown:
        raise ValueError(f"unknown benchmark table(s) {unknown}; known on the "
                         f"{device.upper()}: {', '.join(tables)}")
    return {name: tables[name] for name in names}


def sees_gpu():
    """Whether TensorFlow sees a GPU here (asked in a process of its own)."""
    code = "import tensorflow as tf; print(bool(tf.config.list_physical_devices('GPU')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}).stdout
    return out.strip().splitlines()[-1] == "True"


def machine(device):
    """The machine in words: its system, CPUs and, on a GPU run, the GPUs' names."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            names = [line.split(":", 1)[1].strip() for line in info if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    words = f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs ({cpu})"
    if device == "gpu":
        try:
            gpus = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                  capture_output=True, text=True, check=True).stdout.split("\n")
            words += ", GPU " + ", ".join(gpu.strip() for gpu in gpus if gpu.strip())
        except (OSError, subprocess.CalledProcessError):
            words += ", a GPU"
    return words


def versions():
    """The installed versions of the libraries the benchmarks import, e.g. `keras 3.15.1`."""
    found = []
    for name in LIBRARIES:
        for distribution in (name, f"{name}-nightly"):  # a pre-release: `keras-nightly`
            try:
                found.append(f"{name} {importlib.metadata.version(distribution)}")
                break
            except importlib.metadata.PackageNotFoundError:
                pass
    return ", ".join([f"Python {platform.python_version()}", *found])


def commit():
    """The commit measured, `-dirty` if the working tree differs from it."""
    def git(*arguments):
        return subprocess.run(["git", *arguments], capture_output=True, text=True,
                              cwd=ROOT).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def measured(device, today=None):
    """The line above each table a run writes: where and when it was measured."""
    today = today or datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    return f"Measured on {machine(device)}, {today}, {versions()}, commit {commit()}."


def write_results(text, written, line, names):
    """`text` (RESULTS.md) with the `written` tables in place, each under `line`,
    and the header saying this run measured `names`."""
    text = MARKER.sub(
        lambda m: (f"<!-- benchmark: {m['name']} -->\n_{line}_\n\n{written[m['name']]}\n"
                   "<!-- /benchmark -->" if m["name"] in written else m.group(0)), text)
    return HEADER.sub(lambda m: (f"<!-- run -->\nLast run: {', '.join(names)}. {line}\n"
                                 "<!-- /run -->"), text)


def run(arguments):
    command = [sys.executable, str(ROOT / "benchmarks" / arguments[0]), *arguments[1:]]
    print("$", " ".join(command[1:]), flush=True)
    start = time.perf_counter()
    out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    print(out, f"({time.perf_counter() - start:.0f} s)", sep="", flush=True)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated, of: "
                        f"{', '.join(TABLES)} (CPU); {', '.join(GPU_TABLES)} (GPU)")
    parser.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                        help="which set to run and write (auto: gpu where TensorFlow sees one)")
    args = parser.parse_args()
    device = args.device
    if device == "auto":
        device = "gpu" if sees_gpu() else "cpu"
    elif device == "gpu" and not sees_gpu():
        parser.error("--device gpu: TensorFlow sees no GPU here (tf.config.list_physical_devices)")
    if device == "cpu":
        # The CPU's tables time the CPU: hide any GPU from the benchmarks.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        tables = tables_for(device, args.only)
    except ValueError as error:
        parser.error(str(error))
    names = list(tables)
    results = RESULTS.read_text()
    marked = {m["name"] for m in MARKER.finditer(results)}
    missing = sorted(set(names) - marked)
    if missing:
        parser.error(f"benchmarks/RESULTS.md has no <!-- benchmark: NAME --> block for {missing}")
    outputs, written = {}, {}
    for name in names:
        arguments, index = tables[name]
        key = tuple(arguments)
        if key not in outputs:
            outputs[key] = run(arguments)
        written[name] = tables_of(outputs[key])[index]
    # Read again: RESULTS.md may have been edited while the benchmarks ran (hours).
    RESULTS.write_text(write_results(RESULTS.read_text(), written, measured(device), names))
    print(f"benchmarks/RESULTS.md: wrote {', '.join(written)}")

if __name__ == "__main__":
    main()
