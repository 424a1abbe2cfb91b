"""Every pair of options, trained and compared with its large-batch reference.

A covering array (built below, greedily and deterministically) holds every
pair of settings of the options at least once in a few rows. Each row trains
a tiny model with the callback and, from the same micro-batch stream, a
reference that applies each window as one large batch with
`train_on_batch` on one device; the two must agree (1e-5; 1e-4 under mixed
precision, whose float16 forward passes round differently per batch shape).
The callback's run is on one device or on two replicas (MirroredStrategy).
"""

import itertools

import numpy as np
import pytest

from reference import KERAS
from reference import keras
from reference import mirrored
from reference import train_large_batches
from reference import windows

import tfaccum
from tfaccum import GradientAccumulationCallback

pytestmark = pytest.mark.backend(
    "tensorflow",
    reason="its covering array crosses TensorFlow-only options (MirroredStrategy, skip_nonfinite, bfloat16 accumulators, BN)")

FACTORS = {
    "reduction": ["auto", "samples", "mean", "sum"],
    "leftover": ["flush", "carry", "drop"],
    "skip_nonfinite": [None, True, False],
    "noise_scale": [None, True, False],
    "schedule": ["constant", "dict", "callable"],
    "log_dir": [False, True],
    "use_ema": [False, True],
    "batch_norm": [False, True] if KERAS == "keras3" else [False],
    "mixed_precision": [False, True],
    "sample_weight": [False, True],
    "steps_per_execution": [1, 3],
    "strategy": ["one_device", "mirrored"],
}


def allowed(row):
    """Whether a (partial) row is a combination tfaccum accepts.

    With several replicas a non-finite share is left out alone, which
    reduction="mean" cannot weigh: refused (tested in test_distribution).
    """
    needed = ("reduction", "skip_nonfinite", "mixed_precision", "strategy")
    if not all(name in row for name in needed):
        return True
    skip = row["skip_nonfinite"]
    skips = skip is True or (skip is None and row["mixed_precision"])
    return not (row["strategy"] == "mirrored" and row["reduction"] == "mean" and skips)
SCHEDULES = {  # 4 micro-batches per window in epoch 0, then 2
    "constant": 4,
    "dict": {0: 4, 1: 2},
    "callable": lambda epoch: 4 if epoch == 0 else 2,
}
MICRO, SAMPLES, EPOCHS = 8, 104, 2  # 13 equal micro-batches per epoch
POISONED = (0, 5)  # (epoch-independent) micro-batch whose target is NaN


def covering_array(factors):
    """Rows (dicts) in which every pair of two factors' levels appears."""
    names = list(factors)
    uncovered = {
        (a, va, b, vb)
        for a, b in itertools.combinations(names, 2)
        for va in factors[a]
        for vb in factors[b]
    }
    rows = []
    while uncovered:
        row = {}
        for name in names:  # each factor takes the level covering most new pairs
            def gain(level):
                return sum(
                    1
                    for (a, va, b, vb) in uncovered
                    if (a == name and va == level and row.get(b, vb) == vb and b in row)
                    or (b == name and vb == level and row.get(a, va) == va and a in row)
                    or (a == name and va == level and b not in row)
                )
            levels = [level for level in factors[name] if allowed({**row, name: level})]
            row[name] = max(levels, key=lambda level: (gain(level), -factors[name].index(level)))
        covered = {
            (a, va, b, vb) for (a, va, b, vb) in uncovered if row[a] == va and row[b] == vb
        }
        assert covered, "the greedy choice must make progress"
        uncovered -= covered
        rows.append(row)
    return rows


ROWS = covering_array(FACTORS)


def test_the_array_covers_every_pair():
    for a, b in itertools.combinations(FACTORS, 2):
        seen = {(row[a], row[b]) for row in ROWS}
        assert seen == set(itertools.product(FACTORS[a], FACTORS[b])), (a, b)
    assert len(ROWS) < 20  # small enough for a few minutes on 2 cores
    assert all(allowed(row) for row in ROWS)


def data(row):
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(SAMPLES, 5)) * np.arange(1, 6) + np.arange(5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1)) / 5 + 0.1 * rng.normal(size=(SAMPLES, 1))).astype("float32")
    weights = np.linspace(0.2, 2.0, SAMPLES).astype("float32") if row["sample_weight"] else None
    if poisoned(row):
        y[POISONED[1] * MICRO + 2, 0] = np.nan
    return x, y, weights


def poisoned(row):
    """Whether the row feeds a non-finite micro-batch (only where it is skipped)."""
    skip = row["skip_nonfinite"]
    return skip is True or (skip is None and row["mixed_precision"])


def build(row, reference=False):
    if row["strategy"] == "mirrored" and not reference:
        with mirrored().scope():
            return build(dict(row, strategy="built"))
    keras.utils.set_random_seed(1)
    layers = [keras.Input((5,))]
    if row["batch_norm"]:
        if reference:
            layers.append(keras.layers.BatchNormalization(momentum=0.8))
        else:  # pooled over both replicas on two
            layers.append(tfaccum.AccumBatchNormalization(momentum=0.8, synchronized=True))
    layers += [keras.layers.Dense(7, activation="tanh"), keras.layers.Dense(1)]
    model = keras.Sequential(layers)
    # SGD: unlike Adam it does not hide a gradient that is off by a factor.
    rate = 0.0005 if row["reduction"] == "sum" else 0.01
    optimizer = keras.optimizers.SGD(rate, momentum=0.9, use_ema=row["use_ema"], ema_momentum=0.9)
    if row["mixed_precision"]:
        scale = (keras.mixed_precision.LossScaleOptimizer if KERAS == "tf_keras"
                 else keras.optimizers.LossScaleOptimizer)
        optimizer = scale(optimizer, initial_scale=2**8)
    reduction = "sum" if row["reduction"] == "sum" else "sum_over_batch_size"
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.MeanSquaredError(reduction=reduction),
        # The reference applies one window per `train_on_batch` call.
        steps_per_execution=1 if reference else row["steps_per_execution"],
    )
    return model


def updates(row):
    """The oracle's windows for the row: sample indices per update."""
    schedule = GradientAccumulationCallback(accumulation_steps=SCHEDULES[row["schedule"]]).schedule

    def left_out(epoch, index):
        """The poisoned micro-batch's samples: all of them on one device, the
        poisoned one's replica's share (the first half) on two."""
        if not poisoned(row) or index != POISONED[1]:
            return set()
        start = index * MICRO
        share = MICRO // 2 if row["strategy"] == "mirrored" else MICRO
        return set(range(start, start + share))

    return windows(SAMPLES, MICRO, schedule, EPOCHS, row["leftover"], left_out)


def train_reference(row, x, y, weights):
    model = build(row, reference=True)
    train_large_batches(model, x, y, updates(row), sample_weight=weights, finalize=True)
    return model


@pytest.fixture
def policy(request):
    row = request.param
    keras.mixed_precision.set_global_policy("mixed_float16" if row["mixed_precision"] else "float32")
    yield row
    keras.mixed_precision.set_global_policy("float32")


def row_id(row):
    """The row's settings that differ from the first level of their factor."""
    return "-".join(f"{k}={v}" for k, v in row.items() if v is not FACTORS[k][0] and v != FACTORS[k][0]) or "defaults"


@pytest.mark.parametrize("policy", ROWS, ids=[row_id(r) for r in ROWS], indirect=True)
def test_pair(policy, tmp_path):
    row = policy
    x, y, weights = data(row)
    log_dir = str(tmp_path / "run") if row["log_dir"] else None
    model = build(row)
    callback = GradientAccumulationCallback(
        accumulation_steps=SCHEDULES[row["schedule"]],
        reduction=row["reduction"],
        leftover=row["leftover"],
        skip_nonfinite=row["skip_nonfinite"],
        noise_scale=row["noise_scale"],
        log_dir=log_dir,
    )
    model.fit(x, y, sample_weight=weights, batch_size=MICRO, epochs=EPOCHS,
              shuffle=False, verbose=0, callbacks=[callback])
    reference = train_reference(row, x, y, weights)

    tolerance = 1e-4 if row["mixed_precision"] else 1e-5
    if row["batch_norm"]:
        # The moving statistics see the data itself: the large batch's. (The
        # other weights train on micro-batch normalisations: not comparable.)
        pairs = [(model.layers[0].moving_mean, reference.layers[0].moving_mean),
                 (model.layers[0].moving_variance, reference.layers[0].moving_variance)]
    else:
        pairs = list(zip(model.get_weights(), reference.get_weights(), strict=True))
    for ours, theirs in pairs:
        ours = np.asarray(ours)
        assert np.isfinite(ours).all()
        np.testing.assert_allclose(ours, np.asarray(theirs), atol=tolerance, rtol=tolerance)

    applied = updates(row)
    assert callback.optimizer_steps == len(applied)
    assert callback.nonfinite_skips == (EPOCHS if poisoned(row) else 0)  # micro-batches or shares
    assert (callback.estimator is not None) == (row["noise_scale"] is not False)
    if row["log_dir"]:
        from reference import read_run
        from test_summary import steps

        assert len(steps(read_run(log_dir)[0], "applied_gradient_norm")) == len(applied)
