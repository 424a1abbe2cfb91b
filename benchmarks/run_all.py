"""Runs the benchmark set and writes its tables into README.md.

Each README table a benchmark makes sits between `<!-- benchmark: NAME -->`
and `<!-- /benchmark -->`; this script runs each benchmark once (with the
arguments the README states), takes the table it printed and puts it in
place, so the README's figures are what the scripts measured, here and
now. The prose around a table (what it says, with its spread) is still
read and written by a person: `git diff README.md` shows what moved.

    python benchmarks/run_all.py            # everything (about 2 hours on 2 cores)
    python benchmarks/run_all.py --only memory,precision
    make benchmarks
"""

import argparse
import pathlib
import re
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

# name: (script and arguments, which printed table the README shows)
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
    "step-ops": (["step_ops.py"], 0),
    "precision": (["precision.py"], 0),
    "sparse-window": (["sparse_window.py"], 0),
    "dashboard": (["dashboard.py"], 0),
    "window-loss": (["window_loss.py", "--repeats", "2"], 0),
}
MARKER = re.compile(r"<!-- benchmark: (?P<name>[\w-]+) -->\n(?P<body>.*?)<!-- /benchmark -->",
                    re.DOTALL)


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


def run(arguments):
    command = [sys.executable, str(ROOT / "benchmarks" / arguments[0]), *arguments[1:]]
    print("$", " ".join(command[1:]), flush=True)
    start = time.perf_counter()
    out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    print(out, f"({time.perf_counter() - start:.0f} s)", sep="", flush=True)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help=f"comma-separated, of: {', '.join(TABLES)}")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(TABLES)
    unknown = sorted(set(names) - set(TABLES))
    if unknown:
        parser.error(f"unknown benchmark table(s) {unknown}; known: {', '.join(TABLES)}")
    readme = README.read_text()
    marked = {m["name"] for m in MARKER.finditer(readme)}
    missing = sorted(set(names) - marked)
    if missing:
        parser.error(f"README.md has no <!-- benchmark: NAME --> block for {missing}")
    outputs, written = {}, {}
    for name in names:
        arguments, index = TABLES[name]
        key = tuple(arguments)
        if key not in outputs:
            outputs[key] = run(arguments)
        written[name] = tables_of(outputs[key])[index]
    # Read again: the README may have been edited while the benchmarks ran (hours).
    readme = MARKER.sub(
        lambda m: (f"<!-- benchmark: {m['name']} -->\n{written[m['name']]}\n<!-- /benchmark -->"
                   if m["name"] in written else m.group(0)), README.read_text())
    README.write_text(readme)
    print(f"README.md: wrote {', '.join(written)}")


if __name__ == "__main__":
    main()
