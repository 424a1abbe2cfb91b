"""What only the PyTorch backend has: its refusals by name, and Keras' own
accumulation on torch measured against the large batch beside tfaccum's.

Every behaviour the backends share is tested once, in the suite's other files,
which the torch pass runs too (`KERAS_BACKEND=torch`, `make test`); conftest.py
leaves this file out of the other passes.
"""

import numpy as np
import pytest

import tfaccum
from reference import compare
from reference import keras
from reference import make_data
from reference import make_model
from reference import max_diff
from reference import refused_then_plain

TOL = 1e-5


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


class FakeDistribution:
    """What Keras' torch backend would hand a distribution (3.15 has none: its
    `DataParallel` cannot be made on torch)."""


@pytest.mark.parametrize("case", ["jit_compile", "window_loss", "own_step", "distribution"])
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
    else:
        monkeypatch.setattr(keras.distribution, "distribution", lambda: FakeDistribution())
        match = r"keras.distribution.FakeDistribution"
    refused_then_plain(build, x, y, "PyTorch backend does not serve .*" + match)


def test_several_processes_are_refused_by_name_before_anything_changes(monkeypatch):
    """Under an initialized `torch.distributed` (here one gloo process on
    127.0.0.1) Keras 3.15 trains each process apart and 3.16 wraps the model
    in DistributedDataParallel, which all-reduces every micro-batch: refused."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    try:
        x, y = make_data(n=32)
        refused_then_plain(lambda: make_model(optimizer="adam"), x, y,
                           r"PyTorch backend does not serve several processes "
                           r"\(torch.distributed is initialized: world size 1, backend 'gloo'\)")
    finally:
        dist.destroy_process_group()


def test_an_observer_of_no_backend_is_refused_by_name():
    model = make_model(optimizer="adam")
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=r"observers made for another backend \(\['object'\]\)"):
        tfaccum.AccumulationHook.watched_by(model, [object()], accumulation_steps=2)
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
    updates, 3.1e-2 away); tfaccum flushes it (12 updates, as batch 32 makes; 3e-8 away)."""
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


@pytest.mark.parametrize("case", ["skip_nonfinite", "bfloat16", "mixed_float16"])
def test_outputs_that_count_differently_meet_the_other_options(case):
    # Each output's gradient taken apart (test_items.py: the options off);
    # here with the options they meet. 50 sequences in micro-batches of 4,
    # windows of 4.
    from test_items import sequences as padded
    from test_items import two_heads

    tokens, labels, _, _ = padded()
    y = {"per_token": labels,
         "per_sequence": labels.mean(axis=1, keepdims=True).astype("float32")}
    build, kwargs, left_out = (lambda: two_heads("adam")), {}, ()
    if case == "skip_nonfinite":  # the sixth micro-batch of each epoch left out
        y["per_sequence"][21] = np.nan
        kwargs, left_out = {"skip_nonfinite": True}, [(0, 5), (1, 5)]
    elif case == "bfloat16":
        kwargs = {"accumulator_dtype": "bfloat16"}
    else:  # a LossScaleOptimizer: each output's share scaled too
        def build():
            keras.config.set_dtype_policy("mixed_float16")
            try:
                return two_heads(keras.optimizers.LossScaleOptimizer(
                    keras.optimizers.Adam(0.01), initial_scale=2.0**8))
            finally:
                keras.config.set_dtype_policy("float32")
    result = compare(build, tokens, y, micro=4, steps=4, epochs=2, left_out=left_out,
                     callback_kwargs=kwargs)
    assert result.diff < {"bfloat16": 2e-3, "mixed_float16": 2e-3}.get(case, TOL), result.diff
    assert result.moved(lambda: two_heads("adam")) > 1e-2
