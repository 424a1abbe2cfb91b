"""`tfaccum.BackupAndRestore`: a run killed at any micro-batch resumes exactly.

Each chain runs `backup_script.py` in fresh processes: once without a kill
(the reference), then killed (SIGKILL) at micro-batches drawn at random, each
time run again, until a run finishes. The finished run must have the
reference's weights (within 1e-6), `optimizer.iterations`, counters, noise
scale and dashboard series (every point once).
"""

import json
import os
import random
import signal
import subprocess
import sys
import warnings

import numpy as np
import pytest

from reference import KERAS
from reference import keras
from reference import make_data
from reference import make_model
from reference import not_on_torch
from reference import weights_of
from tfaccum import BackupAndRestore
from tfaccum import GradientAccumulationCallback
from tfaccum import backup_files

SCRIPT = os.path.join(os.path.dirname(__file__), "backup_script.py")
BACKEND = keras.backend.backend()
# Micro-batches per epoch and epochs of the script's default run (40 samples of
# 4, windows of 3: each epoch ends in a partial window).
EPOCH, EPOCHS = 10, 3


def run(config, tmp_path, name):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    env = dict(os.environ, KERAS_BACKEND=BACKEND, TF_CPP_MIN_LOG_LEVEL="3",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    result = subprocess.run([sys.executable, SCRIPT, str(path)], env=env, capture_output=True,
                            text=True, timeout=600)
    return result


def finished(config, tmp_path, name):
    result = run(config, tmp_path, name)
    assert result.returncode == 0, result.stderr[-3000:]
    out = np.load(config["out"])
    return {"weights": [out[k] for k in out.files if k.startswith("arr_")],
            "logs": json.loads(str(out["logs"])),
            "iterations": int(out["iterations"]), "counters": json.loads(str(out["counters"])),
            "noise_scale": float(out["noise_scale"])}


def killed(config, tmp_path, name, expected=-signal.SIGKILL):
    result = run(config, tmp_path, name)
    assert result.returncode == expected, result.stderr[-3000:]


def series(log_dir):
    """Every point of every event file under `log_dir`: `{tag: [(step, value)]}`."""
    from tensorboard.backend.event_processing import event_file_loader
    from tensorboard.util import tensor_util

    points = {}
    for root, _, names in os.walk(log_dir):
        for name in sorted(names):
            if not name.startswith("events.out.tfevents"):
                continue
            for event in event_file_loader.EventFileLoader(os.path.join(root, name)).Load():
                for value in event.summary.value:
                    number = np.asarray(tensor_util.make_ndarray(value.tensor)).ravel()
                    points.setdefault(value.tag, []).append(
                        (event.step, tuple(np.round(number.astype(float), 5))))
    return {tag: sorted(p) for tag, p in points.items()}


def calls_left(directory):
    """The micro-batches a run from the backup in `directory` will see (those it passes over too)."""
    backup = backup_files.BackupFiles(str(directory), False).read()
    return (EPOCHS - (backup[0]["epoch"] if backup else 0)) * EPOCH


def check_resumed(reference, resumed):
    for ours, theirs in zip(resumed["weights"], reference["weights"]):
        assert np.max(np.abs(ours - theirs)) <= 1e-6
    assert resumed["iterations"] == reference["iterations"]
    assert resumed["counters"] == reference["counters"]
    # The last epoch's logs: its metrics' sums went into the backup too.
    assert resumed["logs"].keys() == reference["logs"].keys()
    for name, value in reference["logs"].items():
        np.testing.assert_allclose(resumed["logs"][name], value, rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(resumed["noise_scale"], reference["noise_scale"], rtol=1e-5)


def chain(tmp_path, seed, kills, **options):
    """The reference, then a run killed at each of `kills` in turn (an `at` of
    `None` is drawn at random), then the run that finishes: checked alike."""
    draw = random.Random(seed)
    base = dict(options)
    log_dir = options.pop("log_dir", False)
    reference_config = dict(base, backup_dir=str(tmp_path / "reference_backup"),
                            out=str(tmp_path / "reference.npz"))
    config = dict(base, backup_dir=str(tmp_path / "backup"), out=str(tmp_path / "resumed.npz"))
    if log_dir:
        reference_config["log_dir"] = str(tmp_path / "reference_logs")
        config["log_dir"] = str(tmp_path / "logs")
    reference = finished(reference_config, tmp_path, "reference")
    for index, (during, at) in enumerate(kills):
        at = at or draw.randint(1, calls_left(tmp_path / "backup") - 1)
        killed(dict(config, kill={"during": during, "at": at}), tmp_path, f"killed{index}",
               expected=3 if during == "sigterm" else -signal.SIGKILL)
    resumed = finished(config, tmp_path, "resumed")
    check_resumed(reference, resumed)
    assert not os.path.exists(tmp_path / "backup"), "a completed fit deletes its backup"
    if log_dir:
        ours, theirs = series(config["log_dir"]), series(reference_config["log_dir"])
        assert ours.keys() == theirs.keys() and ours
        for tag in theirs:
            assert [s for s, _ in ours[tag]] == [s for s, _ in theirs[tag]], tag
            for (_, a), (_, b) in zip(ours[tag], theirs[tag]):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=tag)
    return reference, resumed


@pytest.mark.keras3  # tf_keras is refused (the last test)
def test_killed_at_random_micro_batches_resumes_exactly(tmp_path):
    # Kills drawn anywhere (mid-window, mid-epoch), a preemption notice, the
    # noise scale and the dashboard on.
    chain(tmp_path, 0, [("batch", None), ("sigterm", 4), ("batch", None), ("batch", None)],
          save_freq=4, log_dir=True)


@pytest.mark.keras3  # tf_keras is refused (the last test)
def test_killed_during_a_backup_and_during_a_flush_resumes_exactly(tmp_path):
    # `carry`: the window a backup holds at an epoch's end spans epochs. The
    # optimizer's EMA and batch normalization's moving statistics go with it.
    chain(tmp_path, 1, [("save", 6), ("flush", 4), ("batch", None)], leftover="carry",
          save_freq=2, ema=True, batch_norm=True)


@pytest.mark.keras3  # tf_keras is refused (the last test)
def test_killed_in_the_first_and_last_epochs_with_backups_at_epoch_ends(tmp_path):
    chain(tmp_path, 2, [("batch", 7), ("batch", EPOCH + 5)], leftover="drop",
          save_freq="epoch")


@pytest.mark.keras3  # tf_keras is refused (the last test)
@not_on_torch("devices")
def test_two_devices_resume_exactly(tmp_path):
    # DataParallel on JAX, MirroredStrategy's two replicas on TensorFlow.
    chain(tmp_path, 3, [("batch", None)], devices=True, save_freq=3, batch_size=8)


@pytest.mark.keras3  # tf_keras is refused (the last test)
@pytest.mark.parametrize("source", ["pydataset", "tf.data"])
def test_data_sources_of_one_order_resume_exactly(tmp_path, source):
    if source == "tf.data" and BACKEND != "tensorflow":
        pytest.skip("a tf.data pipeline is fed to Keras on TensorFlow here")
    chain(tmp_path, 4, [("batch", None)], source=source, save_freq=5)


# -- in one process: arguments, damaged or foreign backups, data, held windows -------------


@pytest.mark.keras3  # tf_keras is refused (the last test)
def test_arguments_are_checked_by_name():
    with pytest.raises(ValueError, match=r"`backup_dir` must be a non-empty path.*''"):
        BackupAndRestore("")
    for save_freq in (0, "batch", True, 2.5):
        with pytest.raises(ValueError, match=rf"`save_freq` must be.*{save_freq!r}"):
            BackupAndRestore("b", save_freq=save_freq)
    assert repr(BackupAndRestore("b", save_freq=3)) == (
        "BackupAndRestore(backup_dir='b', save_freq=3, double_checkpoint=False, "
        "delete_checkpoint=True)")


def fit(model, x, y, *callbacks, **kwargs):
    kwargs = dict(dict(batch_size=4, epochs=1, shuffle=False, verbose=0), **kwargs)
    return model.fit(x, y, callbacks=list(callbacks), **kwargs)


@pytest.mark.keras3  # tf_keras is refused (the last test)
def test_a_backup_of_another_model_is_refused_and_the_model_kept(tmp_path):
    x, y = make_data(24)
    fit(make_model(), x, y, GradientAccumulationCallback(accumulation_steps=3),
        BackupAndRestore(tmp_path, save_freq=2, delete_checkpoint=False))
    other = make_model(features=4)
    before = weights_of(other)
    with pytest.raises(ValueError, match=r"taken of another model: its variables' shapes"):
        fit(other, x[:, :4], y, GradientAccumulationCallback(accumulation_steps=3),
            BackupAndRestore(tmp_path, save_freq=2))
    for ours, theirs in zip(weights_of(other), before):
        np.testing.assert_array_equal(ours, theirs)
    # The same model without the accumulation callback: refused, nothing assigned.
    plain = make_model()
    before = weights_of(plain)
    with pytest.raises(ValueError, match=r"holds an accumulation window, and this fit has no"):
        fit(plain, x, y, BackupAndRestore(tmp_path, save_freq=2))
    for ours, theirs in zip(weights_of(plain), before):
        np.testing.assert_array_equal(ours, theirs)
    # The same model with another optimizer: refused before a weight is assigned.
    same = make_model(optimizer="adam")
    before = weights_of(same)
    with pytest.raises(ValueError, match=r"then its optimizer's"):
        fit(same, x, y, GradientAccumulationCallback(accumulation_steps=3),
            BackupAndRestore(tmp_path, save_freq=2))
    for ours, theirs in zip(weights_of(same), before):
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.keras3  # tf_keras is refused (the last test)
def test_a_damaged_backup_falls_back_to_the_previous_one_or_says_so(tmp_path):
    files = backup_files.BackupFiles(str(tmp_path), double_checkpoint=True)
    files.write({"n": 1}, {"a": np.zeros(2)})
    files.write({"n": 2}, {"a": np.ones(2)})
    assert files.read()[0] == {"n": 2}
    (tmp_path / "latest.npz").write_bytes(b"cut short")
    meta, arrays = files.read()
    assert meta == {"n": 1} and arrays["a"].tolist() == [0, 0]
    single = backup_files.BackupFiles(str(tmp_path), double_checkpoint=False)
    with pytest.raises(ValueError, match=r"cannot be read .* Delete the directory"):
        single.read()


@pytest.mark.keras3  # tf_keras is refused (the last test)
def test_data_a_resume_cannot_read_alike_is_warned_about_when_fit_starts(tmp_path):
    x, y = make_data(24)
    for kwargs, said in [({"shuffle": True}, r"shuffle=True \(a resumed epoch"),
                         ({"steps_per_epoch": 3, "epochs": 2}, r"steps_per_epoch=3")]:
        with pytest.warns(UserWarning, match=said):
            fit(make_model(), x, y, GradientAccumulationCallback(accumulation_steps=3),
                BackupAndRestore(tmp_path / "w"), **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        fit(make_model(), x, y, GradientAccumulationCallback(accumulation_steps=3),
            BackupAndRestore(tmp_path / "quiet"))


@pytest.mark.keras3  # tf_keras is refused (the last test)
def test_a_window_the_hook_cannot_hold_is_backed_up_at_its_end(tmp_path, monkeypatch):
    # A window-wide loss (or outputs counted apart on JAX and PyTorch) keeps
    # what a backup cannot hold: the backup waits for the window's end.
    from tfaccum.hook_front import HookFront

    monkeypatch.setattr(HookFront, "backup_refusal", lambda hook: "a test's window",
                        raising=False)
    written = []
    write = backup_files.BackupFiles.write
    monkeypatch.setattr(backup_files.BackupFiles, "write", lambda self, meta, arrays: (
        written.append((meta, arrays)), write(self, meta, arrays))[-1])
    x, y = make_data(24)
    fit(make_model(), x, y, GradientAccumulationCallback(accumulation_steps=4),
        BackupAndRestore(tmp_path, save_freq=1))
    # After the window, and after the epoch's last micro-batch flushed the rest.
    assert [meta["micro_batch"] for meta, _ in written] == [4, 6]
    assert all(int(arrays["window/counts/window_micro_batches"]) == 0 for _, arrays in written)


@pytest.mark.skipif(KERAS != "tf_keras", reason="a Keras 3 model is served")
def test_tf_keras_is_refused_by_name():
    x, y = make_data(8)
    with pytest.raises(ValueError, match=r"serves Keras 3; this model is tf_keras'"):
        fit(make_model(), x, y, BackupAndRestore("unused"))
