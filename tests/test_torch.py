"""What only the PyTorch backend has: its refusals by name, and Keras' own
accumulation on torch measured against the large batch beside tfaccum's.

Every behaviour the backends share is tested once, in the suite's other files,
which the torch pass runs too (`KERAS_BACKEND=torch`, `make test`); conftest.py
leaves this file out of the other passes.
"""

import numpy as np
import pytest

import tfaccum
from reference import keras
from reference import make_data
from reference import make_model
from reference import max_diff

TOL = 1e-5


def never_handed(build, x, y):
    model = build()
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    return model


def refused_then_plain(build, x, y, match):
    """The refusal names what is refused, and leaves a model that trains as one
    never handed to tfaccum (weights and optimizer iterations)."""
    model = build()
    with pytest.raises(ValueError, match=match):
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[
            tfaccum.GradientAccumulationCallback(accumulation_steps=2)])
    assert tfaccum.remove_accumulation_hook(model) is None
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    reference = never_handed(build, x, y)
    assert max_diff(model, reference) < 1e-7
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy())


class OwnStep(keras.Sequential):
    def train_step(self, data):
        return dict(super().train_step(data), mine=1.0)


def own_step():
    keras.utils.set_random_seed(1)
    model = OwnStep([keras.Input((5,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def window_loss():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=tfaccum.InBatchSoftmax())
    return model


def two_outputs_counted_apart():
    keras.utils.set_random_seed(1)
    tokens = keras.Input((6,), dtype="int32")
    embedded = keras.layers.Embedding(10, 4, mask_zero=True)(tokens)
    per_token = keras.layers.Dense(3, name="per_token")(embedded)
    per_sequence = keras.layers.Dense(1, name="per_sequence")(
        keras.layers.GlobalAveragePooling1D()(embedded))
    model = keras.Model(tokens, {"per_token": per_token, "per_sequence": per_sequence})
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss={
        "per_token": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "per_sequence": "mse"})
    return model


def sequences(n=32):
    rng = np.random.default_rng(5)
    x = rng.integers(1, 10, size=(n, 6)).astype("int32")
    x[np.arange(6)[None, :] >= rng.integers(1, 7, size=n)[:, None]] = 0
    return x, {"per_token": rng.integers(0, 3, size=(n, 6)).astype("int32"),
               "per_sequence": rng.normal(size=(n, 1)).astype("float32")}


class FakeDistribution:
    """What Keras' torch backend would hand a distribution (3.15 has none: its
    `DataParallel` cannot be made on torch)."""


@pytest.mark.parametrize("case", ["jit_compile", "window_loss", "own_step", "several_counts",
                                  "distribution"])
def test_what_torch_does_not_serve_is_refused_by_name(case, monkeypatch):
    x, y = make_data(n=32)
    build = lambda: make_model(optimizer="adam")  # noqa: E731
    if case == "jit_compile":
        build = lambda: make_model(optimizer="adam", jit_compile=True)  # noqa: E731
        match = r"jit_compile=True \(torch.compile"
    elif case == "window_loss":
        build, match = window_loss, r"window-wide losses"
    elif case == "own_step":
        build, match = own_step, r"OwnStep.train_step"
    elif case == "several_counts":
        (x, y), build = sequences(), two_outputs_counted_apart
        match = r"several outputs whose losses count different items.*\['per_token'\]"
    else:
        monkeypatch.setattr(keras.distribution, "distribution", lambda: FakeDistribution())
        match = r"keras.distribution.FakeDistribution"
    refused_then_plain(build, x, y, "PyTorch backend does not serve .*" + match)


def test_an_observer_of_no_backend_is_refused_by_name():
    model = make_model(optimizer="adam")
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=r"observers made for another backend \(\['object'\]\)"):
        tfaccum.AccumulationHook(model, accumulation_steps=2, observers=[object()])
    assert tfaccum.remove_accumulation_hook(model) is None
    assert max_diff(model.get_weights(), before) == 0


def test_accumulation_aware_batch_normalization_is_refused_by_name():
    with pytest.raises(ImportError, match=r"tfaccum.AccumBatchNormalization is not served on "
                       r"Keras' 'torch' backend"):
        tfaccum.AccumBatchNormalization  # noqa: B018
    model = keras.Sequential([keras.Input((5,)), keras.layers.BatchNormalization(),
                              keras.layers.Dense(1)])
    with pytest.raises(ImportError, match=r"AccumBatchNormalization is not served on Keras' "
                       r"'torch' backend"):
        tfaccum.convert_batch_norm(model)
    assert type(model.layers[0]) is keras.layers.BatchNormalization


def test_keras_own_accumulation_is_not_the_large_batch_and_tfaccum_is():
    """The issue's measurement: an MLP, 100 samples, micro-batches of 8 four at a
    time, Adam, 3 epochs. Keras' own carries each epoch's partial window (9
    updates, 3.3e-2 away); tfaccum flushes it (12 updates, as batch 32 makes)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, 5)).astype("float32")
    y = rng.normal(size=(100, 1)).astype("float32")

    def build(**optimizer_kwargs):
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(0.01, **optimizer_kwargs), loss="mse")
        return model

    large = build()
    large.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    keras_own = build(gradient_accumulation_steps=4)
    keras_own.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    ours = build()
    ours.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
             callbacks=[tfaccum.GradientAccumulationCallback(accumulation_steps=4)])
    assert int(large.optimizer.iterations.numpy()) == int(ours.optimizer.iterations.numpy()) == 12
    assert max_diff(ours, large) < TOL
    assert max_diff(keras_own, large) > 1e-2  # what users of Keras' own get on torch
