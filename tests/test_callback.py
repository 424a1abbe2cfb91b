"""GradientAccumulationCallback against the large-batch reference."""

import inspect
import re

import numpy as np
import pytest
import tensorflow as tf

from reference import BACKEND
from reference import BatchRecorder
from reference import KERAS
from reference import OPTIMIZERS
from reference import compare
from reference import keras
from reference import make_data
from reference import make_model
from reference import max_diff
from reference import max_weight_diff
from reference import not_on_torch

from tfaccum import GradientAccumulationCallback

TOL = 1e-5
# 100 samples in micro-batches of 8: 13 micro-batches per epoch, the last of
# 4 samples; windows of 4 leave a partial window of one short micro-batch.
MICRO, STEPS, EPOCHS = 8, 4, 3


def fit_pair(kind="sequential", optimizer="sgd", compile_kwargs=None, data=None,
             micro=MICRO, steps=STEPS, epochs=EPOCHS, **kwargs):
    """tfaccum and the large batch from the same MLP, update for update (see `compare`)."""
    x, y = data if data is not None else make_data()
    return compare(lambda: make_model(kind, optimizer, **dict(compile_kwargs or {})), x, y,
                   micro=micro, steps=steps, epochs=epochs, **kwargs)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "sample_weight"])
def test_accumulated_equals_large_batch_step_for_step(optimizer, weighted):
    sample_weight = np.linspace(0.1, 2.0, 100).astype("float32") if weighted else None
    pair = fit_pair(optimizer=optimizer, sample_weight=sample_weight)
    # After every update: micro-batches 4, 8, 12 of each epoch and the flush
    # of the 13th.
    assert len(pair.ours) == len(pair.theirs) == 4 * EPOCHS
    assert pair.diff < TOL
    assert max_weight_diff(pair.reference, pair.model) < TOL  # EMA written alike
    # The comparison is meaningful: training moved the weights.
    assert pair.moved(lambda: make_model(optimizer=optimizer)) > 1e-2
    callback, model = pair.callback, pair.model
    assert int(model.optimizer.iterations) == int(pair.reference.optimizer.iterations) == 12
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
    assert fit_pair(kind=kind, optimizer="adam").diff < TOL


def test_class_weight():
    x, y = make_data()
    labels = (y[:, 0] > 0).astype("int32")
    kwargs = dict(loss="sparse_categorical_crossentropy")

    def classifier(seed=1):
        keras.utils.set_random_seed(seed)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2, activation="softmax")])
        model.compile(optimizer=keras.optimizers.Adam(0.01), **kwargs)
        return model

    pair = compare(classifier, x, labels, micro=MICRO, steps=STEPS, epochs=EPOCHS,
                   class_weight={0: 0.3, 1: 2.0})
    assert pair.diff < TOL


@pytest.mark.parametrize(
    "compile_kwargs",
    [pytest.param(dict(steps_per_execution=3), marks=not_on_torch("steps_per_execution")),
     dict(run_eagerly=True), pytest.param(dict(jit_compile=True), marks=not_on_torch("jit_compile"))],
    ids=["steps_per_execution", "run_eagerly", "jit_compile"],
)
def test_compile_modes(compile_kwargs):
    pair = fit_pair(optimizer="adam", compile_kwargs=compile_kwargs)
    assert pair.diff < TOL
    assert pair.callback.optimizer_steps == 12
    assert pair.callback.micro_steps == 39  # micro-batches, not executions


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


@pytest.mark.parametrize("optimizer,drop_remainder", [
    ("adamw_clipnorm", False), ("adam_ema", False), ("adamw_clipnorm", True)])
def test_the_step_that_finds_no_data_ends_no_window(optimizer, drop_remainder):
    """On a dataset of unknown length an epoch ends with a step that finds no
    data; here its micro-batch would have filled the window (13 micro-batches
    in windows of 7: 6 are open). Nothing of the window's end may run in it:
    not the weight decay, the EMA or the optimizer's count, which need no
    gradient. With `drop_remainder` the micro-batch's size is static."""
    x, y = make_data(n=104)
    known = tf.data.Dataset.from_tensor_slices((x, y))
    reference = make_model(optimizer=optimizer)
    reference.fit(known.batch(56), epochs=EPOCHS, verbose=0)
    model = make_model(optimizer=optimizer)
    callback = GradientAccumulationCallback(accumulation_steps=7)
    model.fit(known.filter(lambda *_: True).batch(8, drop_remainder=drop_remainder),
              epochs=EPOCHS, verbose=0, callbacks=[callback])
    assert max_weight_diff(reference, model) < TOL
    assert callback.micro_steps == 13 * EPOCHS and callback.flushes == EPOCHS
    assert int(model.optimizer.iterations) == callback.optimizer_steps == 2 * EPOCHS


def test_flush_happens_before_validation():
    x, y = make_data()
    val = make_data(n=40, seed=3)
    pair = fit_pair(optimizer="adam", validation_data=val)
    assert pair.diff < TOL
    # Validation after each epoch saw that epoch's last update: the large batch's.
    reference = make_model(optimizer="adam")
    reference.fit(x, y, batch_size=32, epochs=EPOCHS, shuffle=False, verbose=0,
                  validation_data=val)
    np.testing.assert_allclose(pair.model.history.history["val_loss"],
                               reference.history.history["val_loss"], rtol=1e-5)


def test_flush_before_earlier_callbacks_see_epoch_end():
    """A callback listed before ours (e.g. a checkpoint) sees flushed weights."""
    x, y = make_data()
    pair = fit_pair(optimizer="adam", epochs=2)
    recorder = BatchRecorder()
    model = make_model(optimizer="adam")
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
              callbacks=[recorder, GradientAccumulationCallback(accumulation_steps=4)])
    epoch_ends = [pair.theirs[3], pair.theirs[7]]  # each epoch's last update, flushed
    for ours, theirs in zip(recorder.epoch_weights, epoch_ends, strict=True):
        assert max_diff(ours, theirs) < TOL


def test_weights_do_not_move_inside_a_window():
    x, y = make_data()
    model = make_model(optimizer="sgd")
    recorder = BatchRecorder()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[GradientAccumulationCallback(accumulation_steps=4), recorder])
    kernels = recorder.kernels
    assert len(kernels) == 13
    for step in range(1, 13):
        changed = not np.array_equal(kernels[step], kernels[step - 1])
        # Updates happen at micro-batches 4, 8, 12 (index 3, 7, 11); the 13th
        # is the epoch's last, and the partial window is flushed right after it.
        assert changed == (step in (3, 7, 11, 12)), step


def test_leftover_drop():
    pair = fit_pair(optimizer="adam", leftover="drop")  # the large batch of the first 96
    assert pair.diff < TOL
    callback, model = pair.callback, pair.model
    assert callback.dropped_micro_steps == EPOCHS
    assert callback.flushes == 0
    assert callback.micro_steps == 13 * EPOCHS
    assert callback.optimizer_steps == 3 * EPOCHS == int(model.optimizer.iterations)


def test_leftover_carry_windows_span_epochs():
    # The micro-batch stream of 3 epochs, grouped 4 at a time across epoch
    # boundaries; the 39th micro-batch is flushed alone when fit ends.
    pair = fit_pair(optimizer="adam", leftover="carry")
    assert pair.diff < TOL
    callback = pair.callback
    assert callback.micro_steps == 39
    assert callback.optimizer_steps == 10
    assert callback.flushes == 1  # only at the end of fit
    assert callback.dropped_micro_steps == 0


def test_learning_rate_schedule_sees_updates():
    def optimizer():
        schedule = keras.optimizers.schedules.PiecewiseConstantDecay([2, 5], [0.05, 0.02, 0.005])
        return keras.optimizers.SGD(schedule)

    pair = fit_pair(optimizer=optimizer)
    assert pair.diff < TOL
    assert int(pair.model.optimizer.iterations) == pair.callback.optimizer_steps == 12


def test_accumulation_schedule_dict_and_callable():
    for steps in ({0: 4, 2: 2}, lambda epoch: 4 if epoch < 2 else 2):
        pair = fit_pair(optimizer="adam", steps=steps, epochs=4)
        assert pair.diff < TOL
        assert pair.callback.optimizer_steps == 2 * 4 + 2 * 7


def test_dict_schedule_before_first_key_is_one():
    pair = fit_pair(optimizer="sgd", steps={1: 2}, epochs=2)  # 1, then 2
    assert len(pair.ours) == 13 + 7 and pair.diff < TOL


def test_metrics_update_every_micro_batch():
    x, y = make_data()
    model = make_model(optimizer="sgd", metrics=["mae"])
    recorder = BatchRecorder()
    initial = make_model(optimizer="sgd")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[GradientAccumulationCallback(accumulation_steps=4), recorder])
    logs = recorder.logs
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
                              "sparse_gradients='rows', accumulator_dtype='float32')")
    assert GradientAccumulationCallback(**callback.get_config()).get_config() == callback.get_config()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(reduction="average"), r"`reduction` must be one of 'auto', 'samples', 'mean', 'sum' or a tfaccum.Reduction. Received: reduction='average'. Did you mean reduction='mean'\?"),
        (dict(reduction="Mean"), r"Received: reduction='Mean'. Did you mean reduction='mean'\?"),
        (dict(reduction="sampels"), r"Received: reduction='sampels'. Did you mean reduction='samples'\?"),
        (dict(reduction="weighted"), r"Received: reduction='weighted'.$"),
        (dict(leftover="keep"), r"`leftover` must be one of 'flush', 'carry', 'drop'. Received: leftover='keep'. Did you mean leftover='carry'\?"),
        (dict(leftover="Flush"), r"Received: leftover='Flush'. Did you mean leftover='flush'\?"),
        (dict(sparse_gradients="dens"), r"Received: sparse_gradients='dens'. Did you mean sparse_gradients='dense'\?"),
        (dict(accumulator_dtype="bf16"), r"Received: accumulator_dtype='bf16'. Did you mean accumulator_dtype='bfloat16'\?"),
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
    with pytest.raises(TypeError, match=re.escape(
            "GradientAccumulationCallback takes keyword arguments only. Received 1 positional: "
            "(4,). Name each, starting with GradientAccumulationCallback(accumulation_steps=4).")):
        GradientAccumulationCallback(4)
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: "
                                        "'accumulation_steps'"):
        GradientAccumulationCallback()
    # `help()` and `inspect` show the keywords, not `__new__`'s catch-all.
    shown = str(inspect.signature(GradientAccumulationCallback))
    assert shown.startswith("(*, accumulation_steps: 'int | dict[int, int]"), shown
    assert "accumulator_dtype: 'str' = 'float32')" in shown, shown


def test_the_epoch_summary_starts_a_line_of_its_own(capsys):
    x, y = make_data(n=40)
    make_model().fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=1, callbacks=[
        GradientAccumulationCallback(accumulation_steps=2, verbose=1)])
    out = capsys.readouterr().out
    assert "\nEpoch 1: 5 micro-steps, 3 optimizer updates" in out  # not after the bar's loss
    assert "\nGradientAccumulationCallback" not in out  # nothing was left at fit's end


@pytest.mark.parametrize("leftover, says", [
    ("flush", "each epoch flushes its window early, as one update of 5 micro-batches"),
    ("carry", "each window spans epochs: one update about every 1.6 epochs"),
    ("drop", "every epoch's micro-batches are dropped and the model never updates")])
def test_a_window_longer_than_an_epoch_warns_once(leftover, says):
    x, y = make_data(n=40)
    with pytest.warns(UserWarning) as caught:
        make_model().fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[
            GradientAccumulationCallback(accumulation_steps=8, leftover=leftover)])
    said = [str(w.message) for w in caught if "longer than an epoch" in str(w.message)]
    assert said == [f"accumulation_steps=8 is longer than an epoch of 5 micro-batches: with "
                    f"leftover={leftover!r}, {says}" + said[0][said[0].index(says) + len(says):]]
    assert said[0].endswith(".")


@pytest.mark.backend("tensorflow", reason="counts TensorFlow's traces and graph runs")
def test_no_host_reads_on_inner_batches(monkeypatch):
    """Per-batch work stays in the graph: the hook is read once per epoch."""
    from tfaccum.backend.tensorflow.hook import AccumulationHook

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


class TraceCounter(keras.layers.Layer):
    """Passes its input through; counts the graphs it is traced into."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.traces = 0

    def call(self, x):
        if tf.inside_function() and not tf.executing_eagerly():
            self.traces += 1
        return x


@pytest.mark.backend("tensorflow", reason="counts TensorFlow's traces and graph runs")
@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adam_ema"])
def test_a_built_model_traces_its_step_once(optimizer):
    # The optimizer's variables and the accumulators are made before the
    # step traces: a step that makes variables traces twice (plain Keras'
    # does, on one device: it builds the optimizer there).
    x, y = make_data()
    counter = TraceCounter()
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((5,)), counter, keras.layers.Dense(1)])
    model.compile(optimizer=OPTIMIZERS[optimizer](), loss="mse")
    callback = GradientAccumulationCallback(accumulation_steps=4)
    built = counter.traces  # building the Sequential traced it symbolically
    model.fit(x, y, batch_size=10, epochs=2, verbose=0, callbacks=[callback])
    assert counter.traces - built == 1
    assert callback.optimizer_steps == 6  # windows of 4, 4 and a flushed 2, twice


@pytest.mark.backend("tensorflow", reason="counts TensorFlow's traces and graph runs")
@pytest.mark.parametrize("sparse_gradients", ["rows", "dense"])
def test_an_embedding_model_traces_its_step_once(sparse_gradients):
    # An embedding table's gradient is sparse: its rows are made ahead too
    # (beside a dense accumulator; the trace keeps the one it uses).
    rng = np.random.default_rng(0)
    tokens, y = rng.integers(0, 20, (40, 6)), rng.normal(size=(40, 1)).astype("float32")
    counter = TraceCounter()
    keras.utils.set_random_seed(1)
    model = keras.Sequential([
        keras.Input((6,), dtype="int32"), keras.layers.Embedding(20, 4), counter,
        keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
    model.compile(optimizer=OPTIMIZERS["adam"](), loss="mse")
    callback = GradientAccumulationCallback(accumulation_steps=4,
                                            sparse_gradients=sparse_gradients)
    built = counter.traces
    model.fit(tokens, y, batch_size=5, epochs=2, verbose=0, callbacks=[callback])
    assert counter.traces - built == 1
    assert callback.optimizer_steps == 4  # windows of 4 and 4, twice


@pytest.mark.backend("tensorflow", reason="TensorFlow's hook makes the optimizer's variables "
                     "ahead; JAX refuses a train_step of its own")
def test_variables_are_made_ahead_only_for_keras_own_step():
    # A step of one's own may apply other variables than
    # `model.trainable_variables`: its optimizer is left to build in it.
    from tfaccum.backend.tensorflow import _keras_on_tf as _keras

    class OwnStep(keras.Sequential):
        def train_step(self, data):
            return super().train_step(data)

    plain, own = make_model(), OwnStep([keras.Input((5,)), keras.layers.Dense(1)])
    assert _keras.trains_with_keras_step(plain)
    assert not _keras.trains_with_keras_step(own)
    plain.train_step = lambda data: {}  # set on the instance: an override too
    assert not _keras.trains_with_keras_step(plain)


@pytest.mark.backend("tensorflow", reason="counts TensorFlow's traces and graph runs")
def test_an_empty_window_at_an_epoch_end_runs_no_graph(monkeypatch):
    # Epochs that end on a window's end: the flush (or drop) has nothing to
    # do, and neither traces nor runs its graph.
    from tfaccum.backend.tensorflow.host_ends import HostEnds

    ran = []
    original = HostEnds.run
    monkeypatch.setattr(HostEnds, "run",
                        lambda self, name, graph: (ran.append(name), original(self, name, graph))[1])
    x, y = make_data(n=96)
    for leftover in ("flush", "drop"):
        callback = GradientAccumulationCallback(accumulation_steps=4, leftover=leftover)
        make_model().fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[callback])
        assert callback.optimizer_steps == 6 and callback.flushes == 0
    assert ran == []
    callback = GradientAccumulationCallback(accumulation_steps=5)
    make_model().fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[callback])
    assert ran == ["flush", "flush"] and callback.flushes == 2


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
    if optimizer != "sgd_momentum" and KERAS == "keras3" and BACKEND == "tensorflow":
        # On Keras 3 the dense window is measurably elsewhere (tf_keras sums
        # repeated rows before its sparse updates, and JAX's embedding
        # gradients are dense: the same either way).
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
