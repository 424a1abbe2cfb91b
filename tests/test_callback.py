"""GradientAccumulationCallback against the large-batch reference."""

import re

from conftest import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import KERAS
from conftest import OPTIMIZERS
from conftest import make_data
from conftest import make_model
from conftest import max_weight_diff

from tfaccum import GradientAccumulationCallback

TOL = 1e-5
# 100 samples in micro-batches of 8: 13 micro-batches per epoch, the last of
# 4 samples; windows of 4 leave a partial window of one short micro-batch.
MICRO, STEPS, EPOCHS = 8, 4, 3


class WeightRecorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epoch_end_weights = []
        self.batch_kernels = []
        self.batch_logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.batch_kernels.append(np.array(self.model.layers[0].kernel))
        self.batch_logs.append(dict(logs))

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_end_weights.append(self.model.get_weights())


def fit_pair(kind="sequential", optimizer="sgd", sample_weight=None,
             fit_kwargs=None, compile_kwargs=None, callback_kwargs=None,
             data=None, micro=MICRO, steps=STEPS, epochs=EPOCHS):
    x, y = data if data is not None else make_data()
    fit_kwargs = dict(fit_kwargs or {})
    fit_kwargs.setdefault("shuffle", False)
    reference = make_model(kind, optimizer, **dict(compile_kwargs or {}))
    reference.fit(x, y, batch_size=micro * steps, epochs=epochs, verbose=0,
                  sample_weight=sample_weight, **fit_kwargs)
    model = make_model(kind, optimizer, **dict(compile_kwargs or {}))
    callback = GradientAccumulationCallback(
        accumulation_steps=steps, **(callback_kwargs or {}))
    history = model.fit(x, y, batch_size=micro, epochs=epochs, verbose=0,
                        sample_weight=sample_weight, callbacks=[callback],
                        **fit_kwargs)
    return reference, model, callback, history


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "sample_weight"])
def test_accumulated_equals_large_batch_step_for_step(optimizer, weighted):
    x, y = make_data()
    sample_weight = np.linspace(0.1, 2.0, 100).astype("float32") if weighted else None
    fit = dict(epochs=EPOCHS, shuffle=False, verbose=0, sample_weight=sample_weight)
    reference, ref_recorder = make_model(optimizer=optimizer), WeightRecorder()
    reference.fit(x, y, batch_size=32, callbacks=[ref_recorder], **fit)
    model, recorder = make_model(optimizer=optimizer), WeightRecorder()
    callback = GradientAccumulationCallback(accumulation_steps=4)
    model.fit(x, y, batch_size=8, callbacks=[callback, recorder], **fit)

    # After every update: micro-batches 4, 8, 12 of each epoch and the flush
    # of the 13th (our callback runs first, so the recorder sees it).
    after_updates = [kernel for i, kernel in enumerate(recorder.batch_kernels)
                     if i % 13 in (3, 7, 11, 12)]
    assert len(after_updates) == len(ref_recorder.batch_kernels) == 4 * EPOCHS
    for step, (ours, theirs) in enumerate(zip(after_updates, ref_recorder.batch_kernels)):
        np.testing.assert_allclose(ours, theirs, atol=TOL, err_msg=f"update {step + 1}")
    assert max_weight_diff(reference, model) < TOL
    # The comparison is meaningful: training moved the weights.
    assert max_weight_diff(make_model(optimizer=optimizer), model) > 1e-2
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == 12
    assert callback.micro_steps == 13 * EPOCHS
    assert callback.optimizer_steps == 4 * EPOCHS
    assert callback.flushes == EPOCHS
    assert callback.dropped_micro_steps == 0


def test_plain_micro_batch_training_differs():
    """Guards the reference: without accumulation the weights do differ."""
    x, y = make_data()
    reference = make_model(optimizer="adam")
    reference.fit(x, y, batch_size=32, epochs=EPOCHS, shuffle=False, verbose=0)
    plain = make_model(optimizer="adam")
    plain.fit(x, y, batch_size=8, epochs=EPOCHS, shuffle=False, verbose=0)
    assert max_weight_diff(reference, plain) > 1e-2


@pytest.mark.parametrize("kind", ["functional", "subclassed"])
def test_model_kinds(kind):
    reference, model, _, _ = fit_pair(kind=kind, optimizer="adam")
    assert max_weight_diff(reference, model) < TOL


def test_class_weight():
    x, y = make_data()
    labels = (y[:, 0] > 0).astype("int32")
    kwargs = dict(loss="sparse_categorical_crossentropy")

    def classifier(seed=1):
        keras.utils.set_random_seed(seed)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2, activation="softmax")])
        model.compile(optimizer=keras.optimizers.Adam(0.01), **kwargs)
        return model

    class_weight = {0: 0.3, 1: 2.0}
    reference = classifier()
    reference.fit(x, labels, batch_size=32, epochs=EPOCHS, shuffle=False,
                  class_weight=class_weight, verbose=0)
    model = classifier()
    model.fit(x, labels, batch_size=8, epochs=EPOCHS, shuffle=False,
              class_weight=class_weight, verbose=0,
              callbacks=[GradientAccumulationCallback(accumulation_steps=4)])
    assert max_weight_diff(reference, model) < TOL


@pytest.mark.parametrize(
    "compile_kwargs",
    [dict(steps_per_execution=3), dict(run_eagerly=True), dict(jit_compile=True)],
    ids=["steps_per_execution", "run_eagerly", "jit_compile"],
)
def test_compile_modes(compile_kwargs):
    reference, model, callback, _ = fit_pair(optimizer="adam",
                                             compile_kwargs=compile_kwargs)
    assert max_weight_diff(reference, model) < TOL
    assert callback.optimizer_steps == 12


def test_dataset_of_unknown_length():
    x, y = make_data()
    known = tf.data.Dataset.from_tensor_slices((x, y))
    unknown = known.filter(lambda *_: True)
    assert unknown.cardinality() == tf.data.UNKNOWN_CARDINALITY
    reference = make_model(optimizer="adam")
    reference.fit(known.batch(32), epochs=EPOCHS, verbose=0)
    model = make_model(optimizer="adam")
    callback = GradientAccumulationCallback(accumulation_steps=4)
    model.fit(unknown.batch(8), epochs=EPOCHS, verbose=0, callbacks=[callback])
    assert max_weight_diff(reference, model) < TOL
    assert callback.micro_steps == 13 * EPOCHS
    assert callback.flushes == EPOCHS
    # Plain Keras counts one phantom step per epoch here (when the data runs
    # out); our updates wait for the data, so only real updates are counted.
    assert int(model.optimizer.iterations) == callback.optimizer_steps == 12


def test_flush_happens_before_validation():
    x, y = make_data()
    val = make_data(n=40, seed=3)
    reference, model, _, history = fit_pair(
        optimizer="adam", fit_kwargs=dict(validation_data=val))
    ref_history = reference.history.history
    np.testing.assert_allclose(history.history["val_loss"],
                               ref_history["val_loss"], rtol=1e-5)
    assert max_weight_diff(reference, model) < TOL


def test_flush_before_earlier_callbacks_see_epoch_end():
    """A callback listed before ours (e.g. a checkpoint) sees flushed weights."""
    x, y = make_data()
    reference = make_model(optimizer="adam")
    ref_recorder = WeightRecorder()
    reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
                  callbacks=[ref_recorder])
    model = make_model(optimizer="adam")
    recorder = WeightRecorder()
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
              callbacks=[recorder, GradientAccumulationCallback(accumulation_steps=4)])
    for ours, theirs in zip(recorder.epoch_end_weights, ref_recorder.epoch_end_weights, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            np.testing.assert_allclose(a, b, atol=TOL)


def test_weights_do_not_move_inside_a_window():
    x, y = make_data()
    model = make_model(optimizer="sgd")
    recorder = WeightRecorder()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[GradientAccumulationCallback(accumulation_steps=4), recorder])
    kernels = recorder.batch_kernels
    assert len(kernels) == 13
    for step in range(1, 13):
        changed = not np.array_equal(kernels[step], kernels[step - 1])
        # Updates happen at micro-batches 4, 8, 12 (index 3, 7, 11); the 13th
        # is the epoch's last, and the partial window is flushed right after it.
        assert changed == (step in (3, 7, 11, 12)), step


def test_leftover_drop():
    x, y = make_data()
    reference = make_model(optimizer="adam")
    # Dropping the partial window of 4 samples is training on the first 96.
    reference.fit(x[:96], y[:96], batch_size=32, epochs=EPOCHS, shuffle=False, verbose=0)
    model = make_model(optimizer="adam")
    callback = GradientAccumulationCallback(accumulation_steps=4, leftover="drop")
    model.fit(x, y, batch_size=8, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[callback])
    assert max_weight_diff(reference, model) < TOL
    assert callback.dropped_micro_steps == EPOCHS
    assert callback.flushes == 0
    assert callback.optimizer_steps == 3 * EPOCHS == int(model.optimizer.iterations)


def test_leftover_carry_windows_span_epochs():
    x, y = make_data()
    epochs = 3
    # The micro-batch stream of 3 epochs, grouped 4 at a time across epoch
    # boundaries; the 39th micro-batch is flushed alone when fit ends.
    micro_batches = [(x[i:i + 8], y[i:i + 8]) for _ in range(epochs) for i in range(0, 100, 8)]
    reference = make_model(optimizer="adam")
    for start in range(0, len(micro_batches), 4):
        window = micro_batches[start:start + 4]
        reference.train_on_batch(np.concatenate([w[0] for w in window]),
                                 np.concatenate([w[1] for w in window]))
    model = make_model(optimizer="adam")
    callback = GradientAccumulationCallback(accumulation_steps=4, leftover="carry")
    model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0, callbacks=[callback])
    assert max_weight_diff(reference, model) < TOL
    assert callback.micro_steps == 39
    assert callback.optimizer_steps == 10
    assert callback.flushes == 1  # only at the end of fit


def test_learning_rate_schedule_sees_updates():
    def optimizer():
        schedule = keras.optimizers.schedules.PiecewiseConstantDecay([2, 5], [0.05, 0.02, 0.005])
        return keras.optimizers.SGD(schedule)

    reference, model, callback, _ = fit_pair(optimizer=optimizer)
    assert max_weight_diff(reference, model) < TOL
    assert int(model.optimizer.iterations) == callback.optimizer_steps == 12


def test_accumulation_schedule_dict_and_callable():
    x, y = make_data()
    reference = make_model(optimizer="adam")
    reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=16, epochs=4, initial_epoch=2, shuffle=False, verbose=0)
    for steps in ({0: 4, 2: 2}, lambda epoch: 4 if epoch < 2 else 2):
        model = make_model(optimizer="adam")
        callback = GradientAccumulationCallback(accumulation_steps=steps)
        model.fit(x, y, batch_size=8, epochs=4, shuffle=False, verbose=0, callbacks=[callback])
        assert max_weight_diff(reference, model) < TOL
        assert callback.optimizer_steps == 2 * 4 + 2 * 7


def test_dict_schedule_before_first_key_is_one():
    x, y = make_data()
    reference = make_model(optimizer="sgd")
    reference.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=16, epochs=2, initial_epoch=1, shuffle=False, verbose=0)
    model = make_model(optimizer="sgd")
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
              callbacks=[GradientAccumulationCallback(accumulation_steps={1: 2})])
    assert max_weight_diff(reference, model) < TOL


def test_metrics_update_every_micro_batch():
    x, y = make_data()
    model = make_model(optimizer="sgd", metrics=["mae"])
    recorder = WeightRecorder()
    initial = make_model(optimizer="sgd")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[GradientAccumulationCallback(accumulation_steps=4), recorder])
    logs = recorder.batch_logs
    assert len(logs) == 13
    # The first micro-batch's loss is that of the untouched model on it.
    first = float(keras.losses.MeanSquaredError()(y[:8], initial.predict(x[:8], verbose=0)))
    assert logs[0]["loss"] == pytest.approx(first, rel=1e-5)
    assert len({round(entry["mae"], 7) for entry in logs}) == 13


def test_one_callback_serves_several_fits():
    x, y = make_data()
    callback = GradientAccumulationCallback(accumulation_steps=4)
    model = make_model(optimizer="adam")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[callback])
    assert callback.micro_steps == 26  # counted per fit
    assert callback.optimizer_steps == 8
    assert int(model.optimizer.iterations) == 12
    reference = make_model(optimizer="adam")
    reference.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    assert max_weight_diff(reference, model) < TOL


def test_refit_reuses_the_traced_step_until_recompiled():
    x, y = make_data()
    model = make_model(optimizer="adam")
    callback = GradientAccumulationCallback(accumulation_steps=4)
    functions = []
    seen = keras.callbacks.Callback()
    seen.on_train_begin = lambda logs=None: functions.append(model.train_function)
    for _ in range(2):
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[callback, seen])
    first_hook = callback.hook
    assert functions[0] is functions[1]
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mae")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[callback, seen])
    assert callback.hook is not first_hook and functions[2] is not functions[0]
    assert callback.optimizer_steps == 4 and int(model.optimizer.iterations) == 4


def test_verbose_prints_epoch_summary(capsys):
    x, y = make_data()
    model = make_model()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[GradientAccumulationCallback(accumulation_steps=4, verbose=1)])
    out = capsys.readouterr().out
    assert ("Epoch 1: 13 micro-steps, 4 optimizer updates (accumulation_steps=4); "
            "flushed a partial window of 1 micro-batch (4 samples); noise scale "
            "B_simple=") in out
    assert re.search(r"B_simple=[-\d.e+]+ \(suggests accumulation_steps=\d+\)\.", out)


def test_repr_and_config():
    callback = GradientAccumulationCallback(accumulation_steps={0: 8, 5: 4}, leftover="carry")
    assert repr(callback) == ("GradientAccumulationCallback(accumulation_steps={0: 8, 5: 4}, "
                              "reduction='auto', leftover='carry', verbose=0, skip_nonfinite=None, "
                              "noise_scale=None, log_dir=None, scalars=False, write_interval=30.0, "
                              "sparse_gradients='rows')")
    assert GradientAccumulationCallback(**callback.get_config()).get_config() == callback.get_config()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(reduction="average"), r"`reduction` must be one of 'auto', 'samples', 'mean', 'sum'. Received: reduction='average'"),
        (dict(leftover="keep"), r"`leftover` must be one of 'flush', 'carry', 'drop'. Received: leftover='keep'"),
        (dict(verbose=2), r"`verbose` must be 0 or 1. Received: verbose=2"),
    ],
)
def test_bad_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GradientAccumulationCallback(accumulation_steps=4, **kwargs)


def test_unknown_keyword_names_it_and_suggests():
    with pytest.raises(TypeError, match=r"`accumulation_step` \(did you mean `accumulation_steps`\?\)"):
        GradientAccumulationCallback(accumulation_step=4)
    with pytest.raises(TypeError, match=r"Unrecognized keyword arguments.*`frobnicate`.*Received: \{'frobnicate': 1\}"):
        GradientAccumulationCallback(accumulation_steps=4, frobnicate=1)


def test_options_are_keyword_only():
    with pytest.raises(TypeError):
        GradientAccumulationCallback(4)


def test_no_host_reads_on_inner_batches(monkeypatch):
    """Per-batch work stays in the graph: the hook is read once per epoch."""
    from tfaccum.hook import AccumulationHook

    reads = []
    for name in ("flush", "drop", "pending", "micro_steps", "optimizer_steps"):
        original = getattr(AccumulationHook, name)
        if isinstance(original, property):
            wrapped = property(lambda self, f=original.fget, n=name: (reads.append(n), f(self))[1])
        else:
            def wrapped(self, *a, f=original, n=name, **k):
                reads.append(n)
                return f(self, *a, **k)
        monkeypatch.setattr(AccumulationHook, name, wrapped)
    x, y = make_data()
    model = make_model()
    callback = GradientAccumulationCallback(accumulation_steps=4)
    model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[callback])
    # A flush per epoch end and at fit end, and the pending check of
    # `remove()`: nothing per micro-batch.
    assert reads == ["flush"] * 4 + ["pending"]


@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adam", "adagrad"])
def test_embedding_gradients_equal_keras_large_batch(optimizer):
    """The optimizer receives the window's rows as the large batch's IndexedSlices.

    Keras' Adam and Adagrad square each row of an `IndexedSlices` before rows
    that repeat a token are summed: a dense sum of the window would update
    differently from Keras' own large batch.
    """
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 20, size=(100, 6))  # tokens repeat within a batch
    y = rng.normal(size=(100, 1)).astype("float32")
    optimizers = dict(OPTIMIZERS, adagrad=lambda: keras.optimizers.Adagrad(0.1))

    def build():
        keras.utils.set_random_seed(2)
        model = keras.Sequential([
            keras.Input((6,), dtype="int32"),
            keras.layers.Embedding(20, 4),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1),
        ])
        model.compile(optimizer=optimizers[optimizer](), loss="mse")
        return model

    reference = build()
    reference.fit(tokens, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    model = build()
    model.fit(tokens, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
              callbacks=[GradientAccumulationCallback(accumulation_steps=4)])
    assert max_weight_diff(reference, model) < TOL
    if optimizer != "sgd_momentum" and KERAS == "keras3":
        # On Keras 3 the dense window is measurably elsewhere (tf_keras sums
        # repeated rows before its sparse updates: the same either way).
        dense = build()
        dense.fit(tokens, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                  callbacks=[GradientAccumulationCallback(
                      accumulation_steps=4, sparse_gradients="dense")])
        assert max_weight_diff(reference, dense) > 1e-3


def test_a_new_callback_of_the_same_configuration_reuses_the_traced_step():
    x, y = make_data()
    model = make_model(optimizer="adam")
    functions = []
    seen = keras.callbacks.Callback()
    seen.on_train_begin = lambda logs=None: functions.append(model.train_function)
    first = GradientAccumulationCallback(accumulation_steps=4, log_dir=None)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[first, seen])
    second = GradientAccumulationCallback(accumulation_steps=2)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[second, seen])
    assert functions[1] is functions[0]  # not traced again
    assert second.hook is first.hook and second.estimator is first.estimator
    assert (first.optimizer_steps, second.optimizer_steps) == (7, 7)  # each counts its own fit
    # A different configuration gets its own step.
    third = GradientAccumulationCallback(accumulation_steps=2, reduction="mean")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[third, seen])
    assert functions[2] is not functions[0] and third.hook is not first.hook
    # The plain train function comes back after each fit: a plain fit does
    # not trace again either.
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[seen])
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[seen])
    assert functions[3] is functions[4]
    assert not any(f is functions[0] for f in functions[3:])


def test_noise_scale_is_not_armed_where_it_cannot_estimate():
    x, y = make_data()
    model = make_model()
    callback = GradientAccumulationCallback(accumulation_steps=1)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[callback])
    assert callback.estimator is None
    assert not any(type(o).__name__ == "NoiseScaleEstimator" for o in callback.hook.observers)
    armed = GradientAccumulationCallback(accumulation_steps={0: 1, 3: 2})
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[armed])
    assert armed.estimator is not None
