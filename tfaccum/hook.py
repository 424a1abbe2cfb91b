"""The accumulating train step, installed on and removed from a compiled model.

`GradientAccumulationCallback` uses this for `fit`; it is public for loops
that drive the model themselves (`train_on_batch`, or `fit` without the
callback's epoch bookkeeping).

A micro-step flows one way: the step tracer (`step.py`) hands a `MicroBatch`
to the hook, which adds it to (or leaves it out of) the window state
(`window.py`); the replication (`replication.py`) ends a full window, the
optimizer applies it, and the observers see an `Update`.
"""

import warnings

import tensorflow as tf

from tfaccum import _keras
from tfaccum import checks
from tfaccum import gradients
from tfaccum import replication
from tfaccum.gradient_cache import CachedGradients
from tfaccum.gradient_cache import CachingStep
from tfaccum.configuration import Configuration
from tfaccum.counts import Counters
from tfaccum.counts import with_counter_properties
from tfaccum.moments import window_observers
from tfaccum.observers import Window
from tfaccum.patching import ModelInstallation
from tfaccum.patching import installed_on
from tfaccum.rollback import StepRollback
from tfaccum.sources import AccumulatedGradients
from tfaccum.step import StepError
from tfaccum.step import StepTracer
from tfaccum.window import WindowState
from tfaccum.window_loss import window_loss_of

# On one device, a hook's first flushes and drops run eagerly (see `_run`).
EAGER_HOST_ENDS = 2



@with_counter_properties
class AccumulationHook:
    """Makes a compiled model update its weights once per window of micro-batches.

    Creating the hook installs it: the model's `train_step` gets wrapped so
    that the gradients its optimizer receives are summed into accumulators,
    and the optimizer is called once every `accumulation_steps` micro-batches
    with their normalised sum. `remove()` restores the plain model, and every
    attribute the hook set is put back as it was. The model's `train_step`
    (Keras' default, or an override) must apply its gradients through
    `self.optimizer.apply_gradients()` or `self.optimizer.apply()`, at most
    once per step; a step of a model with nothing to train passes through.

    A window that is not full is kept until `flush()` (apply it now,
    normalised by what it holds) or `drop()` (discard it). All per-step work
    runs inside the model's compiled train function; counters are read from
    the device only when you ask for them.

    A model compiled with a `tfaccum.WindowLoss` (in-batch negatives) trains
    through gradient caching instead (`tfaccum.gradient_cache`): the loss is
    computed over the whole window, and the update is still the large batch's.

    The optimizer receives the gradient the large batch would have produced:
    the same values and the same type. A sparse (`IndexedSlices`) gradient,
    such as an embedding's, arrives as the window's rows in one
    `IndexedSlices` (with `sparse_gradients="rows"`).

    Args:
        model: A compiled Keras model.
        accumulation_steps: Integer >= 1, micro-batches per optimizer update.
            Change it between steps with `set_accumulation_steps()`.
        reduction, skip_nonfinite, sparse_gradients, accumulator_dtype: As
            `GradientAccumulationCallback`'s, where each is documented.
        observers: `WindowObserver`s told of every micro-step, update and
            reset (e.g. `AccumulationSummaries`, `NoiseScaleEstimator`, and
            `moments.window_observers(model, strategy)` for the model's
            `AccumBatchNormalization` layers, which `install_accumulation_hook`
            and the callback add).

    Example:

    ```python
    hook = tfaccum.install_accumulation_hook(model, accumulation_steps=4)
    for x_batch, y_batch in micro_batches:
        model.train_on_batch(x_batch, y_batch)
    hook.flush()   # apply a partial last window
    hook.remove()  # back to a plain Keras model
    ```

    It is also a context manager that flushes and removes itself on exit:

    ```python
    with tfaccum.install_accumulation_hook(model, accumulation_steps=4):
        model.fit(x, y, batch_size=8, epochs=3)
    ```
    """

    def __init__(self, model, *, accumulation_steps, reduction="auto", skip_nonfinite=None,
                 sparse_gradients="rows", accumulator_dtype="float32", observers=()):
        api = _keras.api_for_model_argument(model, "model")
        checks.check_compiled(model, api, installed_on(model))
        configuration = Configuration.resolve(
            reduction=reduction, skip_nonfinite=skip_nonfinite,
            sparse_gradients=sparse_gradients, accumulator_dtype=accumulator_dtype,
            observers=[type(observer) for observer in observers])
        self._make(model, api, configuration, observers, accumulation_steps)

    @classmethod
    def made_with(cls, model, configuration, observers, *, accumulation_steps):
        """A hook of a resolved `Configuration`, with its `observers` made (the callback's)."""
        api = _keras.api_for_model_argument(model, "model")
        checks.check_compiled(model, api, installed_on(model))
        hook = cls.__new__(cls)
        hook._make(model, api, configuration, observers, accumulation_steps)
        return hook

    def _make(self, model, api, configuration, observers, accumulation_steps):
        optimizer = model.optimizer
        self.model = model
        self.observers = list(observers)
        self.configuration = configuration
        strategy = model.distribute_strategy
        checks.check_accumulator_dtype_meets(configuration.accumulator_dtype, strategy)
        self.reduction = configuration.reduction
        self.skip_nonfinite = configuration.skips_nonfinite(
            _keras.scales_loss_dynamically(optimizer))
        self.reduction.check(model)
        loss_share = _keras.replica_loss_share(model)
        # Rows cannot be kept under XLA (fixed shapes): dense, with a warning.
        self._sparse_rows = configuration.sparse_rows and not model.jit_compile
        self.state = WindowState(strategy, self.reduction, loss_share=loss_share,
                                 sparse_rows=self._sparse_rows,
                                 dtype=configuration.dense_dtype)
        self.counts = self.state.counts
        self.window = self.state.accumulators
        # The step is chosen once: a window-wide loss keeps each micro-batch's
        # forward pass (gradient caching) and its window's end replays them;
        # any other model's step hands its gradients to the accumulators.
        self.window_loss = window_loss_of(model)
        if self.window_loss is not None:
            checks.check_window_loss_meets(
                model, self.window_loss, configuration)
            cache = CachedGradients(model, self.state)

            def apply_gradients(grads, variables, reduced=False):  # no patch is active
                api.apply(getattr(optimizer, api.apply_method), grads, variables, reduced)

            self._replication = replication.for_model(
                model, self.state, apply_gradients, self.observers, skip_nonfinite=False,
                source=cache)
            self._step = CachingStep(model, self.state, self._replication, cache).train_step
        else:
            self._tracer = StepTracer(
                model, counts_items=self.reduction.counts_items, weigh=self.state.weight,
                # Weighting the loss by the micro-batch's weight weights every
                # gradient at once (cheaper than scaling each accumulated one),
                # except under dynamic loss scaling, whose scale must stay a power of 2.
                weight_in_loss=api.scales_loss_in_step
                and not _keras.scales_loss_dynamically(optimizer),
                loss_share=loss_share, on_micro_batch=self._micro_step)
            self._replication = replication.for_model(
                model, self.state, self._tracer.apply_gradients, self.observers,
                skip_nonfinite=self.skip_nonfinite, source=AccumulatedGradients(self.state))
            self._step = self._accumulating_step
        self.installation = ModelInstallation(model, self._train_step, self)
        self._rollback = StepRollback(model)
        self._functions = {}
        self._host_runs = {}
        self._replication.prepare()
        self._make_variables_ahead(api)
        self.set_accumulation_steps(accumulation_steps)
        self._install()

    def _make_variables_ahead(self, api):
        """Makes the optimizer's variables and the accumulators now.

        A `tf.function` that makes variables on its first call traces twice;
        made here, Keras' own step on a built model traces once (Keras itself
        builds the optimizer in its first trace on one device). Embedding
        tables get rows as well as a dense accumulator; the trace keeps one.
        """
        model = self.model
        if not model.built or not _keras.trains_with_keras_step(model):
            return
        with tf.init_scope(), model.distribute_strategy.scope():
            api.build_optimizer(model.optimizer, model.trainable_variables)
            self.window.create_dense(model.trainable_variables, provisional=True)
            # Replicas made theirs dense for good (`prepare`): no rows there.
            self.window.create_rows(_keras.embedding_tables(model))

    # -- installation ---------------------------------------------------

    @staticmethod
    def installed_on(model):
        """The hook installed on `model`, or `None`."""
        return installed_on(model)

    @property
    def installed(self):
        """Whether the hook is installed on its model now."""
        return self.installation.installed

    def _install(self):
        # Observers first: a layer's window must be in place before the
        # train step traces.
        for observer in self.observers:
            observer.on_install(self)
        self._rollback.arm()
        self.installation.install()

    def can_reinstall(self):
        """Whether `reinstall()` can reuse this hook's compiled step.

        True unless the hook is installed, the model was compiled again, or
        its trainable variables or execution settings changed since.
        """
        return self.installation.can_reinstall()

    def reinstall(self):
        """Installs this hook again with zeroed counters, reusing its traced step.

        Saves re-tracing the train function when the same model is fitted
        again (for example `fit` called once per epoch).
        """
        if not self.can_reinstall():
            raise ValueError(
                "This hook cannot be reinstalled: it is installed, or the "
                f"model {self.model.name!r} was recompiled or changed since. "
                "Create a new one with `tfaccum.install_accumulation_hook()`."
            )
        self.state.zero()
        self._replication.zero()
        for observer in self.observers:
            observer.on_reset()
        self._install()

    def remove(self):
        """Restores the plain model. Warns if a window was left pending.

        Raises an error when called while the model's `fit` is running (from
        a callback): the running `fit` needs the train function it has.
        """
        if not self.installed:
            return
        if self.installation.loop_running is not False and _keras.fit_is_running(self.model):
            raise RuntimeError(
                "The accumulation hook of model "
                f"{self.model.name!r} cannot be removed while its `fit` is "
                "running: the running `fit` calls the accumulating train "
                "function. To stop accumulating, stop training "
                "(`model.stop_training = True`); the callback removes the hook "
                "when `fit` ends. Received: a call to remove the hook from "
                "inside `fit`."
            )
        pending = self.pending
        if pending.micro_batches:
            warnings.warn(
                f"Removing the accumulation hook discards {pending.micro_batches} "
                f"micro-batches ({pending.samples} samples) that were never "
                "applied. Call `hook.flush()` (or `hook.drop()`) before "
                "`hook.remove()` to decide what happens to them.",
                stacklevel=2,
            )
        self.uninstall()

    def uninstall(self):
        """Puts the model back as it was, whatever is pending; observers are told first.

        The model is restored even if an observer raises (e.g. summaries
        that cannot be written); the error then propagates.
        """
        try:
            for observer in self.observers:
                observer.on_uninstall(self)
        finally:
            self.installation.uninstall()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        if exc_type is None:
            self.flush()
        else:
            self.drop()
        self.remove()
        return False

    # -- configuration ----------------------------------------------------

    @property
    def accumulation_steps(self):
        return int(self.state.steps.numpy())

    def set_accumulation_steps(self, accumulation_steps):
        """Sets the window length used from the next micro-batch on."""
        self.state.steps.assign(checks.check_steps(accumulation_steps))

    # -- counters -----------------------------------------------------------

    @property
    def counters(self):
        """The counters now, as one `Counters` snapshot (a single device read)."""
        return Counters.read(self.counts)

    @property
    def pending(self):
        """The `Window` accumulated but not yet applied.

        With several replicas its samples are summed over them: every worker
        must read it (as it must call `flush()` and `drop()`).
        """
        return self._replication.pending(self._run)

    def __repr__(self):
        counts = self.counts.numpy()
        return (
            f"AccumulationHook(model={self.model.name!r}, "
            f"accumulation_steps={self.accumulation_steps}, "
            f"reduction={self.reduction!r}, installed={self.installed}, "
            f"micro_steps={counts['micro_steps']}, "
            f"optimizer_steps={counts['optimizer_steps']})"
        )

    # -- the per-step graph -------------------------------------------------------

    def _train_step(self, data):
        with self._rollback.guard():  # a refusal leaves the model as it was
            try:
                return self._step(data)
            except StepError:
                self.uninstall()  # `fit` stops here; leave a plain model behind.
                raise

    def _accumulating_step(self, data):
        """The model's own step, its gradients handed to `_micro_step`."""
        logs, nothing = self._tracer.train_step(self.installation.original_train_step(), data)
        if nothing:  # nothing to train: Keras warns and skips the update; so do we
            self.counts.add(self.counts.delta(micro_steps=1))
        return logs

    def _micro_step(self, micro):
        """Adds a `MicroBatch` to the window (or leaves it out); ends a full window."""
        state, replicas = self.state, self._replication
        self.reduction.check(self.model)
        replicas.check(micro)
        state.track(micro, replicas.create)
        if self.configuration.sparse_rows:
            state.warn_if_densified(micro, "jit_compile=True (XLA needs fixed shapes)"
                                    if self.model.jit_compile else "several replicas")
        observers = replicas.observers_here()
        seen = state.micro_step(micro)
        totals = replicas.totals_per_micro_batch

        def add():
            delta = state.add(micro, totals)
            for observer in observers:
                observer.on_micro_step(seen)
            return delta

        def leave_out():
            replicas.leave_out()
            for observer in observers:
                observer.on_leave_out(seen)
            return state.leave_out(totals)

        if self.skip_nonfinite:
            delta = tf.cond(gradients.all_finite(micro.grads), add, leave_out)
        else:
            delta = add()
        # This update depends on `samples`, so on the micro-batch's data: when
        # a dataset of unknown length runs out, it cannot run before
        # `get_next()` fails (Keras' own `optimizer.iterations` can, and
        # counts a phantom step per epoch that way).
        self.counts.add(delta)
        replicas.after_micro_step()

    # -- host-triggered window ends -----------------------------------------

    def _run(self, name, graph):
        """Runs `graph` as a `Window`: eagerly, or compiled once.

        On one device the first `EAGER_HOST_ENDS` runs of each graph are
        eager: a flush happens once an epoch, and tracing the window's end
        (the optimizer's update, the observers) for an epoch or two costs
        more than running it op by op (a fit of two epochs of a small masked
        model: about 0.7 s of 3.8). Later runs are compiled once.
        """
        runs = self._host_runs[name] = self._host_runs.get(name, 0) + 1
        if self.model.run_eagerly or (
                self._replication.ends_eagerly and runs <= EAGER_HOST_ENDS):
            function = graph
        else:
            if name not in self._functions:
                self._functions[name] = tf.function(graph, autograph=False)
            function = self._functions[name]
        with self.model.distribute_strategy.scope():
            micro_batches, samples = function()
        return Window(int(micro_batches), int(samples))

    def flush(self):
        """Applies a partial window now, normalised by what it holds.

        Returns:
            The `Window` that was applied (`Window(0, 0)` if none was pending).
        """
        if not self._anything_pending():
            return Window(0, 0)
        return self._run("flush", self._replication.flush_graph)

    def drop(self):
        """Discards a partial window; it is counted in `dropped_micro_steps`.

        Returns:
            The `Window` that was discarded.
        """
        if not self._anything_pending():
            return Window(0, 0)
        return self._run("drop", self._replication.drop_graph)

    def _anything_pending(self):
        # A host read of the counts: an empty window (an epoch that ended on
        # a window's end) neither traces nor runs the window-end graph.
        # Every worker reads the same total, so all skip it or none.
        return self._replication.traced and self._replication.pending(self._run).micro_batches > 0


def install_accumulation_hook(model, *, accumulation_steps, reduction="auto", skip_nonfinite=None,
                              sparse_gradients="rows", accumulator_dtype="float32"):
    """Installs gradient accumulation on a compiled model and returns the hook.

    See `AccumulationHook` for the arguments; `hook.remove()` undoes it. The
    hook stays installed until removed, across any number of `fit` calls.
    The model's `AccumBatchNormalization` layers pool their windows.

    Example:

    ```python
    with tfaccum.install_accumulation_hook(model, accumulation_steps=4):
        model.fit(x, y, batch_size=8)  # updates once every 4 batches
    ```
    """
    _keras.api_for_model_argument(model, "model")
    return AccumulationHook(
        model, accumulation_steps=accumulation_steps, reduction=reduction,
        skip_nonfinite=skip_nonfinite, sparse_gradients=sparse_gradients,
        accumulator_dtype=accumulator_dtype,
        observers=window_observers(model, model.distribute_strategy))


def remove_accumulation_hook(model):
    """Removes the accumulation hook from `model`, if one is installed.

    Returns:
        The removed `AccumulationHook`, or `None` if none was installed.
    """
    _keras.api_for_model_argument(model, "model")
    hook = installed_on(model)
    if hook is not None:
        hook.remove()
    return hook
