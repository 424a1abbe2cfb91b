"""The example and the benchmark scripts run and report what they claim."""

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(script, *args):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run([sys.executable, str(ROOT / script), *args], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def printed_tables(out):
    """The Markdown tables in a script's output (run_all's parser), as rows of cells.

    Each table's header row comes first; its rule (`|---|`) is left out.
    """
    return [[line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| ")]
            for table in benchmark_module("run_all").tables_of(out)]


def test_quickstart_matches_the_large_batch_and_writes_the_demo_dashboard(tmp_path):
    out = run("examples/quickstart.py", "--epochs", "1", "--logdir", str(tmp_path))
    difference = float(re.search(r"largest weight difference: (\S+)", out).group(1))
    assert difference < 1e-5
    assert re.search(r"optimizer updates\s+22\s+22", out)
    assert dashboard_runs(tmp_path) == {"16x4": 22, "8x8": 22}


def test_exactness_benchmark_table():
    out = run("benchmarks/exactness.py", "--epochs", "1")
    dense, sequences = [table[1:] for table in printed_tables(out)]
    assert len(dense) == 5
    for name, ours, builtin, plain in dense:
        assert float(ours) < 1e-5, name
        assert float(plain) > 1e-3, name
    assert len(sequences) == 3
    for name, tokens, samples, builtin, plain in sequences:
        assert float(tokens) < 1e-5, name
        if "sample_weight" not in name:  # masks: samples are not the large batch
            assert float(samples) > 1e-3 and float(builtin) > 1e-3, name


def test_throughput_benchmark_table():
    out = run("benchmarks/throughput.py", "--rounds", "3", "--samples", "256",
              "--width", "32", "--no-memory")
    epochs, ratios = printed_tables(out)
    assert [row[0].strip() for row in epochs[1:]] == [
        "tfaccum", "tfaccum-no-noise", "tfaccum-samples", "tfaccum+log_dir", "keras", "keras-again", "micro", "large"]
    names = [row[0].strip() for row in ratios[1:]]
    assert names[0].startswith("noise floor") and "noise scale cost" in names
    for name, median, p10_p90, low_high, verdict in ratios[1:]:
        p10, p90 = map(float, p10_p90.split("-"))
        low, high = map(float, low_high.split("-"))
        assert low <= p10 <= float(median) <= p90 <= high, name
        # "within noise" exactly when the 10-90% range holds 1.
        assert (verdict.strip() == "within noise") == (p10 <= 1.0 <= p90), name


@pytest.mark.backend("tensorflow", reason="times TensorFlow's traced step; JAX's timings are "
                     "benchmarks/jax_backend.py's")
def test_step_time_benchmark_table():
    out = run("benchmarks/step_time.py", "--rounds", "3", "--width", "16", "--micro-batch", "4",
              "--steps", "2", "--windows", "1")
    times, ratios = printed_tables(out)
    assert [row[0].strip() for row in times[1:]] == [
        "keras", "keras-again", "tfaccum", "no-noise", "samples"]
    assert all(float(cell) > 0 for row in times[1:] for cell in row[1:])
    # Each ratio in both phases, the noise floor first.
    assert [(row[0].strip(), row[1].strip()) for row in ratios[1:3]] == [
        ("noise floor: Keras accumulation vs itself", "micro-steps"),
        ("noise floor: Keras accumulation vs itself", "windows")]
    assert len(ratios) == 1 + 2 * 5
    for name, phase, median, interval, rounds, verdict in ratios[1:]:
        lower, upper = map(float, interval.split("-"))
        assert lower <= float(median) <= upper, name
        assert (verdict.strip() == "within noise") == (lower <= 1.0 <= upper), (name, phase)


@pytest.mark.backend("torch", reason="Keras on PyTorch's own benchmark (the other backends': "
                     "test_throughput_benchmark_table, benchmarks/jax_backend.py)")
def test_torch_benchmark_table():
    out = run("benchmarks/torch_backend.py", "--repeats", "1", "--width", "32",
              "--samples", "128", "--epochs", "2")
    (table,) = printed_tables(out)
    assert [row[0].strip() for row in table[1:]] == [
        "plain", "keras", "tfaccum", "no-noise", "torch-loop", "large"]
    rows = {row[0].strip(): row for row in table[1:]}
    assert rows["tfaccum"][-1].strip() == "1.00 (1.00-1.00)"  # the loss column's own unit
    assert "tfaccum's epoch / Keras' own" in out


@pytest.mark.parametrize("lower, upper, expected", [
    (0.9701, 0.99996, "within noise"),  # printed 0.970-1.000: the interval shown holds 1
    (1.00004, 1.03, "within noise"),    # printed 1.000-1.030
    (0.97, 0.9994, "faster"),           # printed 0.970-0.999
    (1.0006, 1.03, "slower"),           # printed 1.001-1.030
])
def test_a_verdict_reads_the_interval_as_it_is_printed(lower, upper, expected):
    """CI once printed "1.000" as an interval's end and called it "faster" beside it."""
    verdict = benchmark_module("throughput").verdict
    assert verdict((lower + upper) / 2, lower, upper) == expected


def dashboard_runs(log_dir):
    """{run: updates} as the dashboard lists them."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider
    from tensorboard.backend.event_processing import plugin_event_multiplexer
    from tensorboard.plugins import base_plugin

    from tb_plugin.plugin import AccumulationPlugin

    multiplexer = plugin_event_multiplexer.EventMultiplexer(
        tensor_size_guidance={"accumulation": 0})
    multiplexer.AddRunsFromDirectory(str(log_dir))
    multiplexer.Reload()
    plugin = AccumulationPlugin(base_plugin.TBContext(
        data_provider=data_provider.MultiplexerDataProvider(multiplexer, str(log_dir))))
    runs = json.loads(plugin.runs_impl(context.RequestContext(), ""))["runs"]
    return {r["run"]: r["updates"] for r in runs}


@pytest.mark.backend("tensorflow", reason="tf.distribute's MirroredStrategy; JAX's DataParallel "
                     "is test_jax.py's")
def test_distributed_benchmark_counts_reductions():
    out = run("benchmarks/distributed.py", "--rounds", "1", "--samples", "512", "--width", "32")
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip()
            for line in out.splitlines() if line.startswith("| ") and "variant" not in line}
    # 512 samples / micro-batch 16 = 32 micro-steps; windows of 8 = 4 updates.
    # Keras' built-in accumulation fails there today (keras-team/keras#20582);
    # if a Keras release fixes it, its row appears instead of the failure.
    keras_row = rows.pop("keras", None)
    # With the dashboard, the noise scale and mixed precision on: still 4.
    assert rows == {"tfaccum": "4", "tfaccum + log_dir + noise_scale": "4",
                    "tfaccum mixed_float16 + log_dir + noise_scale": "4",
                    "micro": "32", "micro mixed_float16": "32", "large": "4"}
    assert keras_row is not None or "keras: fails under MirroredStrategy" in out


def benchmark_module(name):
    """A module of benchmarks/, imported in this process."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


STEP_OPS = "counts the operations of TensorFlow's traced micro-step"


@pytest.mark.backend("tensorflow", reason=STEP_OPS)
def test_item_counting_adds_only_its_count_to_a_per_sample_losss_micro_step():
    """benchmarks/step_ops.py's counts (in this process: a trace each, no training)."""
    step_ops = benchmark_module("step_ops")
    ops = {variant: step_ops.micro_step_ops(variant, width=16, micro_batch=4)[0]
           for variant in ("plain", "tfaccum", "no-noise", "samples")}
    # A loss averaged per sample counts an item for every sample: "auto"
    # weighs by them with nothing to check, as "samples" does. What it adds
    # is the loss's element count (a constant here, where the batch is static).
    added = ops["tfaccum"] - ops["samples"]
    assert sum(added.values()) <= 1, added
    per_step = {variant: sum(counter.values()) for variant, counter in ops.items()}
    assert per_step["no-noise"] < per_step["tfaccum"] < per_step["plain"], per_step


@pytest.mark.backend("tensorflow", reason=STEP_OPS)
@pytest.mark.parametrize("variant", ["tfaccum", "samples"])
def test_the_noise_scale_adds_its_norm_and_one_update_to_a_micro_step(variant):
    """What the noise scale costs a per-sample loss's micro-step, op by op."""
    step_ops = benchmark_module("step_ops")
    with_noise, without = (step_ops.micro_step_ops(name, width=16, micro_batch=4)[0]
                           for name in (variant, "no-noise"))
    added = with_noise - without
    # The micro-batch's squared norm: one read of each of the 4 gradients,
    # summed; its window sums: one read and one write of one variable (the
    # estimator's state, `tfaccum.observing`, written where it changed).
    assert added["L2Loss"] == 4 and added["AddN"] == 1, added
    assert added["ReadVariableOp"] == 1 and added["AssignVariableOp"] == 1, added
    # Weighed by its items, a micro-batch weighed 0 counted none: no select.
    assert added["SelectV2"] == 0 and added["NotEqual"] == 0, added


def test_the_readmes_proof_is_what_the_proof_prints():
    """examples/proof.py on the backend under test: tfaccum is the large batch, the
    others are not, and the README's column for that backend says what it printed."""
    rows = {row[0].strip(): float(row[1]) for row in printed_tables(run("examples/proof.py"))[0][1:]}
    assert rows["tfaccum, 8 x 4"] < 1e-6
    assert rows["Keras' gradient_accumulation_steps=4, 8 x 4"] > 1e-2
    assert rows["no accumulation, batch 8"] > 1e-1
    # The README's column for this backend, row for row: rounding noise below
    # 1e-6 differs between CPUs; the rest within 10%.
    table = [line.split("|")[1:-1] for line in (ROOT / "README.md").read_text().splitlines()
             if line.startswith("| ") and ("e-0" in line or "TensorFlow |" in line)][:4]
    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    heading = {"tensorflow": "TensorFlow", "jax": "JAX", "torch": "PyTorch"}[backend]
    column = [cell.strip() for cell in table[0]].index(heading)
    said = [float(row[column]) for row in table[1:]]
    assert len(said) == 3, said
    for printed, written in zip(rows.values(), said):
        if written < 1e-6:
            assert printed < 1e-6, (printed, written)
        else:
            assert abs(printed - written) <= 0.1 * written, (printed, written)


def test_backup_benchmark_table():
    """A backup holds one parameter copy more than Keras' own (the open window)."""
    out = run("benchmarks/backup_cost.py", "--width", "256", "--repeats", "1", "--epochs", "2")
    rows = {row[0].strip(): row for row in printed_tables(out)[0][1:]}
    assert sorted(rows) == ["idle", "keras", "none", "tfaccum"]
    ours, keras_own = (float(rows[v][2].split()[0]) for v in ("tfaccum", "keras"))
    assert abs(ours - 4.0) < 0.2 and abs(keras_own - 3.0) < 0.3


def test_every_benchmark_table_has_its_place_in_the_results():
    """`make benchmarks` writes each table between its markers in benchmarks/RESULTS.md."""
    run_all = benchmark_module("run_all")
    results = run_all.RESULTS.read_text()
    marked = [m["name"] for m in run_all.MARKER.finditer(results)]
    assert sorted(marked) == sorted(list(run_all.TABLES) + list(run_all.GPU_TABLES))
    for arguments, _ in [*run_all.TABLES.values(), *run_all.GPU_TABLES.values()]:
        assert (ROOT / "benchmarks" / arguments[0]).is_file(), arguments
    printed = "a line\n| a | b |\n|---|---|\n| 1 | 2 |\n\n(5 s)\n| c |\n|---|\n"
    assert run_all.tables_of(printed) == ["| a | b |\n|---|---|\n| 1 | 2 |", "| c |\n|---|"]


def test_a_gpu_run_writes_its_own_tables_and_never_the_cpus():
    """`run_all.py --device gpu` adds the GPU's figures beside the CPU's, never over them."""
    run_all = benchmark_module("run_all")
    assert all(name.startswith("gpu-") for name in run_all.GPU_TABLES)
    assert not any(name.startswith("gpu-") for name in run_all.TABLES)
    assert run_all.tables_for("gpu", None) == run_all.GPU_TABLES
    assert run_all.tables_for("cpu", None) == run_all.TABLES
    assert list(run_all.tables_for("gpu", "gpu-memory")) == ["gpu-memory"]
    with pytest.raises(ValueError, match=r"throughput-wall.*CPU.*--device cpu"):
        run_all.tables_for("gpu", "gpu-memory,throughput-wall")
    with pytest.raises(ValueError, match=r"gpu-memory.*GPU.*--device gpu"):
        run_all.tables_for("cpu", "gpu-memory")
    with pytest.raises(ValueError, match=r"unknown.*'nothing'"):
        run_all.tables_for("cpu", "nothing")
    # Every GPU table times as users run it there: wall clock, TensorFlow's threads.
    for name, (arguments, _) in run_all.GPU_TABLES.items():
        if arguments[0] in ("throughput.py", "step_time.py"):
            assert arguments[arguments.index("--clock") + 1] == "wall", name
            assert arguments[arguments.index("--threads") + 1] == "0", name
