"""Differential fuzzing: random windows, tfaccum against plain Keras at the large batch.

Hypothesis draws what a window can hold: masks (fully masked micro-batches
and windows among them), zero and non-zero sample weights, class weights,
`count_items()` counts, micro-batch sizes with a short last one, leftover
policies, reductions, regularisers, and `skip_nonfinite` with NaN injected
into chosen micro-batches. Each case is trained twice: by tfaccum, and by a
plain Keras model with one `train_on_batch` per window the oracle
(`reference.windows`) says tfaccum applies. Weights must agree within 1e-5
after every update, stay finite where Keras' do, and the counters must
match the oracle's.

`make test` runs a fixed, derandomised set of 25 (about a minute); `make
fuzz` draws 300 at random (`FUZZ_EXAMPLES=`, `FUZZ_SEED=` to repeat a run).
A case the fuzzer shrinks to becomes an ordinary test in
tests/test_degenerate.py.
"""

import dataclasses
import os

import numpy as np
import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from reference import BACKEND
from reference import all_finite
from reference import fit_accumulated
from reference import keras
from reference import largest_update_diff
from reference import micro_batches
from reference import ops
from reference import train_large_batches
from reference import windows

import tfaccum

TOL = 1e-5
T, FEATURES, CLASSES = 4, 3, 3
EXAMPLES = int(os.environ.get("TFACCUM_FUZZ_EXAMPLES", "25"))
RANDOM = os.environ.get("TFACCUM_FUZZ_RANDOM") == "1"


class CountedTokenLoss(keras.losses.Loss):
    """A token mean that says its count with `count_items()`, `k` per token."""

    def __init__(self, k=1, name="counted_token_loss"):
        super().__init__(reduction="sum", name=name)
        self.k = k

    def call(self, y_true, y_pred):
        valid = ops.cast(y_true >= 0, "float32")  # padding is labelled -1
        per_token = keras.losses.sparse_categorical_crossentropy(
            ops.maximum(y_true, 0), y_pred, from_logits=True) * valid
        items = tfaccum.count_items(self.k * ops.sum(valid))
        return ops.divide_no_nan(self.k * ops.sum(per_token), items)


@dataclasses.dataclass(frozen=True)
class Case:
    head: str  # "tokens": a loss per token (masks reach it); "sequence": one per sequence
    loss: str  # "compiled", "counted" (count_items, k=1), "counted2" (k=2), "sum"
    regularizer: bool
    optimizer: str
    reduction: str
    leftover: str
    micro: int
    steps: int
    epochs: int
    lengths: tuple  # unmasked time steps per sample (0: every token masked)
    sample_weight: tuple | None
    class_weight: tuple | None
    poisoned: frozenset  # micro-batches whose gradient is NaN (in every epoch)
    skip_nonfinite: bool | None

    @property
    def n(self):
        return len(self.lengths)


@st.composite
def cases(draw):
    head = draw(st.sampled_from(["tokens", "sequence"]))
    loss = draw(st.sampled_from(
        ["compiled", "counted", "counted2"] if head == "tokens" else ["compiled", "sum"]))
    micro = draw(st.integers(1, 5))
    steps = draw(st.integers(1, 4))
    n = draw(st.integers(1, 22))
    epochs = draw(st.integers(1, 2))
    # A sequence head pools over its tokens: it needs at least one.
    lengths = draw(st.lists(st.integers(0 if head == "tokens" else 1, T), min_size=n, max_size=n))
    count = -(-n // micro)
    if head == "tokens":  # whole micro-batches (so whole windows) of padding
        for index in draw(st.sets(st.integers(0, count - 1), max_size=count)):
            for sample in range(index * micro, min(n, (index + 1) * micro)):
                lengths[sample] = 0
    sample_weight = class_weight = None
    if loss == "compiled":
        sample_weight = draw(st.none() | st.lists(
            st.sampled_from([0.0, 0.5, 1.0, 2.5]), min_size=n, max_size=n).map(tuple))
    if head == "sequence" and loss == "compiled" and sample_weight is None and draw(st.booleans()):
        class_weight = tuple(draw(st.lists(st.sampled_from([0.0, 0.5, 2.0]), min_size=CLASSES,
                                           max_size=CLASSES)))
    poisoned = frozenset()
    skip_nonfinite = draw(st.sampled_from([None, True]))
    if skip_nonfinite:
        poisoned = frozenset(draw(st.sets(st.integers(0, count - 1), max_size=2)))
        for index in poisoned:  # the NaN goes to an unmasked token
            lengths[index * micro] = max(lengths[index * micro], 1)
    if loss == "sum":
        reduction = "sum"
    elif head == "sequence" and loss == "compiled":
        reduction = draw(st.sampled_from(["auto", "samples"]))
    else:
        reduction = "auto"
    return Case(
        head=head, loss=loss, regularizer=draw(st.booleans()),
        optimizer=draw(st.sampled_from(["sgd", "adam"])), reduction=reduction,
        leftover=draw(st.sampled_from(["flush", "carry", "drop"])), micro=micro, steps=steps,
        epochs=epochs, lengths=tuple(lengths), sample_weight=sample_weight,
        class_weight=class_weight, poisoned=poisoned, skip_nonfinite=skip_nonfinite)


# -- models, built once per kind and reset between cases ------------------------------

_MODELS = {}


def _build(case):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((T, FEATURES))
    # A counted loss sees no Keras mask (it would weigh its mean per token).
    hidden = inputs if case.loss.startswith("counted") else keras.layers.Masking(0.0)(inputs)
    regularizer = keras.regularizers.L2(0.05) if case.regularizer else None
    hidden = keras.layers.Dense(4, activation="tanh", kernel_regularizer=regularizer)(hidden)
    if case.head == "sequence":
        hidden = keras.layers.GlobalAveragePooling1D()(hidden)
    model = keras.Model(inputs, keras.layers.Dense(CLASSES)(hidden))
    if case.loss in ("counted", "counted2"):
        loss = CountedTokenLoss(k=1 if case.loss == "counted" else 2)
    else:
        loss = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="sum" if case.loss == "sum" else "sum_over_batch_size")
    optimizer = (keras.optimizers.SGD(0.1, momentum=0.9) if case.optimizer == "sgd"
                 else keras.optimizers.Adam(0.02))
    model.compile(optimizer=optimizer, loss=loss)
    model.optimizer.build(model.trainable_variables)
    initial = ([w.copy() for w in model.get_weights()],
               [v.numpy() for v in model.optimizer.variables])
    return model, initial


def model_for(case, role):
    """A model for `case` (`role`: "ours" or "theirs"), as freshly built."""
    key = (role, case.head, case.loss, case.regularizer, case.optimizer)
    if key not in _MODELS:
        _MODELS[key] = _build(case)
    model, (weights, optimizer_state) = _MODELS[key]
    model.set_weights(weights)
    for variable, value in zip(model.optimizer.variables, optimizer_state):
        variable.assign(value)
    return model


def data(case):
    rng = np.random.default_rng(len(case.lengths))
    x = rng.normal(size=(case.n, T, FEATURES)).astype("float32")
    x[np.arange(T)[None, :] >= np.array(case.lengths)[:, None]] = 0.0
    y = rng.integers(0, CLASSES, (case.n, T) if case.head == "tokens" else (case.n,))
    if case.loss.startswith("counted"):
        y[np.arange(T)[None, :] >= np.array(case.lengths)[:, None]] = -1
    return x, y


def poison(x, case):
    """The inputs with a NaN in the first token of each poisoned micro-batch."""
    x = x.copy()
    for index in case.poisoned:
        x[index * case.micro, 0, 0] = np.nan
    return x


def expected_counts(case):
    """What the callback's counters must read after the case's `fit`."""
    counts = dict(micro_steps=0, samples=0, items=0,
                  nonfinite_skips=len(case.poisoned) * case.epochs, flushes=0, dropped_micro_steps=0)
    lengths = np.array(case.lengths)
    batches = micro_batches(case.n, case.micro)
    position, contributing = 0, 0

    def items(indices):
        if case.head == "sequence" or case.reduction != "auto":
            return len(indices)
        k = 2 if case.loss == "counted2" else 1
        return k * int(lengths[indices].sum())

    for epoch in range(case.epochs):
        for index, indices in enumerate(batches):
            counts["micro_steps"] += 1
            position += 1
            if index not in case.poisoned:
                counts["samples"] += len(indices)
                counts["items"] += items(indices)
                contributing += 1
            if position == case.steps:
                position = contributing = 0
        if position and case.leftover == "flush":
            counts["flushes"] += contributing > 0
            position = contributing = 0
        elif position and case.leftover == "drop":
            counts["dropped_micro_steps"] += position
            position = contributing = 0
    counts["flushes"] += position > 0 and contributing > 0  # what carry leaves at the end
    return counts


def check(case):
    x, y = data(case)
    sample_weight = None if case.sample_weight is None else np.array(case.sample_weight, "float32")
    if sample_weight is not None and case.head == "tokens" and BACKEND in ("jax", "torch"):
        # Keras on JAX and PyTorch does not broadcast a weight per sample over
        # a mask per token (its `apply_mask` fails, plain Keras included): the
        # same weights, given per token.
        sample_weight = np.repeat(sample_weight[:, None], T, axis=1)
    class_weight = None if case.class_weight is None else dict(enumerate(case.class_weight))
    left_out = {(epoch, index) for epoch in range(case.epochs) for index in case.poisoned}
    updates = windows(case.n, case.micro, case.steps, case.epochs, case.leftover, left_out)
    theirs = train_large_batches(model_for(case, "theirs"), x, y, updates,
                                 sample_weight=sample_weight, class_weight=class_weight)
    callback = tfaccum.GradientAccumulationCallback(
        accumulation_steps=case.steps, reduction=case.reduction, leftover=case.leftover,
        skip_nonfinite=case.skip_nonfinite)
    if case.reduction == "sum" and case.regularizer:
        # A summed window would apply the weight regularizers once per micro-batch.
        with pytest.raises(ValueError, match=r"reduction='sum' adds .* regularized weights"):
            fit_accumulated(model_for(case, "ours"), x, y, micro=case.micro, steps=case.steps,
                            callback=callback)
        return
    ours, callback = fit_accumulated(
        model_for(case, "ours"), poison(x, case), y, micro=case.micro, steps=case.steps,
        epochs=case.epochs, callback=callback, sample_weight=sample_weight,
        class_weight=class_weight)
    counts = {name: getattr(callback, name) for name in expected_counts(case)}
    assert counts == expected_counts(case), case
    assert callback.optimizer_steps == len(updates), case
    if all(all_finite(w) for w in theirs):
        assert all(all_finite(w) for w in ours), case
    assert largest_update_diff(ours, theirs) < TOL, case


@settings(max_examples=EXAMPLES, deadline=None, derandomize=not RANDOM,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
          database=settings.default.database if RANDOM else None)
@given(cases())
def test_accumulation_equals_the_large_batch(case):
    check(case)
