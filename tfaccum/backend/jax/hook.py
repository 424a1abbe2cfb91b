"""The accumulating train function on Keras 3's JAX backend, installed on a compiled model.

The same hook as TensorFlow's (`tfaccum.AccumulationHook`: arguments,
counters, `flush`, `drop`, `remove`), made of what JAX does differently: the
host counts the window and picks a compiled step for each micro-batch
(`step.py`); the accumulators are arrays the hook holds, donated to each
step and updated in place.
"""

import random

import jax.numpy as jnp
import numpy as np

from tfaccum import _keras as keras_models
from tfaccum import checks
from tfaccum import interrupts
from tfaccum import items as said_items
from tfaccum.backend.jax import _keras_on_jax
from tfaccum.backend.jax import window_backup
from tfaccum.backend.jax.devices import for_distribution
from tfaccum.backend.jax.installation import ModelInstallation
from tfaccum.backend.jax.precision import Rounding
from tfaccum.observing import WindowObserver
from tfaccum.observing import tell
from tfaccum.backend.jax.step import CompiledSteps
from tfaccum.backend.jax.window_program import WindowProgram
from tfaccum.backend.jax import batch_norm
from tfaccum.backend.jax.gradient_cache import CachedWindow
from tfaccum.backend.jax.gradient_cache import check_served as check_window_loss_served
from tfaccum.hook_front import HookFront
from tfaccum.counts import HostCounts
from tfaccum.counts import Window
from tfaccum.counts import DEVICE_WINDOW_COUNTS
from tfaccum.counts import WINDOW_COUNTS
from tfaccum.counts import device_index
from tfaccum.window_losses import window_loss_of


class AccumulationHook(HookFront):
    """The `AccumulationHook` on Keras' JAX backend: see `HookFront`.

    What JAX does not serve yet is refused by name when the hook is made,
    before anything on the model changes (`check_served`).
    """

    backend_name = "jax"
    window_backup = window_backup  # what a backup holds of the hook

    def _make(self, model, api, configuration, observers, accumulation_steps):
        check_served(model, configuration, observers)
        configuration.reduction.check(model)
        self.model = model
        self.configuration = configuration
        self.reduction = configuration.reduction
        self.observers = list(observers)
        self.devices = for_distribution(_keras_on_jax.distribution())
        self.counts = HostCounts(self.devices)
        self.skip_nonfinite = configuration.skips_nonfinite(
            keras_models.scales_loss_dynamically(model.optimizer))
        self._steps = checks.check_steps(accumulation_steps)
        self._accumulators = None  # made at the first micro-batch
        self._observed = None  # the observers' device states, likewise
        # Seeded by `keras.utils.set_random_seed` (Python's generator): the
        # bfloat16 roundings are drawn from it.
        rounding = Rounding(configuration.accumulator_dtype, seed=random.getrandbits(31))
        self._compiled = CompiledSteps(model, self.reduction, self.observers,
                                       jit=model.jit_compile and not model.run_eagerly,
                                       devices=self.devices, rounding=rounding,
                                       skip_nonfinite=self.skip_nonfinite,
                                       staging=batch_norm.staging_for(self.observers))
        self.windows = WindowProgram(self)
        self.cached = CachedWindow(self, self._compiled.jit) if window_loss_of(model) else None
        self.installation = ModelInstallation(model, self._train_function, self)
        self._install()

    # -- installation ---------------------------------------------------

    def _install(self):
        for observer in self.observers:
            observer.on_install(self)
        self.installation.install()
        # `optimizer.iterations` as the host counts it: read once, then
        # one more per update (the summaries' steps).
        self._iterations = int(np.asarray(self.model.optimizer.iterations.value))

    def _zero(self):
        self.counts.zero()
        self._accumulators = self._observed = None

    def uninstall(self):
        try:
            super().uninstall()
        finally:
            self._accumulators = None  # the window's memory, freed (observers are read after)
            if self.cached is not None:
                self.cached.reset()

    # -- configuration and counters ---------------------------------------------------

    @property
    def accumulation_steps(self):
        return self._steps

    def set_accumulation_steps(self, accumulation_steps):
        self._steps = checks.check_steps(accumulation_steps)

    ops = jnp  # the array namespace observers compute with

    def observer_state(self, observer):
        """`observer`'s device state now, or `None` before the first micro-batch."""
        return None if self._observed is None else self._observed[self.observers.index(observer)]

    def set_observer_state(self, observer, entries):
        """Sets the entries of `observer`'s state given (none before the first micro-batch)."""
        if self._observed is not None:
            observed = list(self._observed)
            index = self.observers.index(observer)
            observed[index] = dict(observed[index], **entries)
            self._observed = tuple(observed)

    @property
    def pending(self):
        # Its samples are kept: a device read where micro-batches may be left out.
        values = self.counts.numpy() if self.skip_nonfinite else self.counts.values
        return Window(values["window_micro_batches"], values["window_samples"])

    # -- the train function ---------------------------------------------------------

    def _train_function(self, state, iterator):
        """Keras' `train_function(state, iterator)`: `steps_per_execution` micro-batches.

        Each micro-step donates the state it is given: an interrupt waits
        until its outputs are the state Keras writes back (`_keras_on_jax.publish`),
        so that it never leaves the variables with deleted arrays.
        """
        _keras_on_jax.publish(self.model, state)  # before anything is donated
        batches = _keras_on_jax.execution_batches(
            iterator, self.model.steps_per_execution, self.installation.one_batch)
        if self.windows.serves():
            return self.windows.execution(state, batches)
        logs = None
        for data in batches:
            logs, state = self._interruptible_step(state, data)
        if logs is None:
            raise StopIteration  # the data ended: Keras' own train function says so
        return logs, state

    def _interruptible_step(self, state, data, step=None):
        with interrupts.deferred(lambda: _keras_on_jax.write_published(self.model)):
            logs, state = (step or self._micro_step)(state, data)
            _keras_on_jax.publish(self.model, state)
        return logs, state

    def _micro_step(self, state, data):
        if not state[0]:
            # Keras makes no update for a model without trainable weights:
            # its own step runs, a micro-step is counted and nothing joins a
            # window (as on TensorFlow, where no gradient reaches the hook).
            logs, state = self.model.train_step(state, data)
            self.counts.add(micro_steps=1)
            return logs, state
        if self._observed is None:
            self._observed = tuple(observer.initial() for observer in self.observers)
        counts = self.counts
        # A step or window end that fails while it first traces (a refusal)
        # leaves a plain model: what it had is put back (Keras' trainer
        # emptied the variables while the step held them), the hook removed.
        first = counts.values["micro_steps"] == 0 or (
            counts.values["optimizer_steps"] == 0
            and counts.values["window_micro_batches"] + 1 >= self._steps)
        given = state
        try:
            if self.cached is not None:
                return self.cached.micro_step(state, data)
            samples = _keras_on_jax.batch_size(data)
            if self._accumulators is None:
                self._accumulators = self._compiled.new_accumulators(state, data)
            logs, state, self._accumulators, self._observed, counts.on_device, said = (
                self._compiled.accumulate(state, self._accumulators, self._observed,
                                          counts.on_device, data, self._window_vector(),
                                          jnp.asarray(samples, jnp.int32)))
            if self._compiled.says_counts:
                check_said(self, state, said)
            counts.add(micro_steps=1, samples=samples, window_micro_batches=1,
                       window_samples=samples)
            if counts.values["window_micro_batches"] >= self._steps:
                trainable, non_trainable, optimizer_variables, metrics = state
                trainable, optimizer_variables = self._apply(trainable, optimizer_variables)
                state = (trainable, batch_norm.moved(self.observers, non_trainable),
                         optimizer_variables, metrics)
        except Exception:
            if first:
                _keras_on_jax.restore(self.model, given if state is given else state)
                self._accumulators = self._observed = None
                self.uninstall()  # `fit` stops here
            raise
        return logs, state

    def _window_vector(self):
        """The open window's counts, then the micro-step's number (`step.STEP`)."""
        return jnp.asarray(self.counts.window_values() + [self.counts.values["micro_steps"]],
                           jnp.int32)

    def _apply(self, trainable, optimizer_variables):
        """Applies the open window: normalised in place, then the optimizer's update
        (two compiled functions, so that no step holds a second copy of the window)."""
        counts = self.counts
        self._accumulators, self._observed, counts.on_device, window, contributing = (
            self._compiled.normalize(self._accumulators, self._observed, counts.on_device,
                                     self._window_vector()))
        trainable, optimizer_variables = self._compiled.apply(
            trainable, optimizer_variables, self._accumulators, contributing)
        self._ended(window, contributing, optimizer_variables)
        return trainable, optimizer_variables

    def _ended(self, window, contributing, optimizer_variables):
        """Counts a window's end and tells the observers (`window`: its counts on
        the device; `contributing`: whether it made an update)."""
        counts = self.counts
        # What the observers are told is the device's where it decided (not read here).
        if self.skip_nonfinite:
            window = dict(zip(WINDOW_COUNTS, window), applied=contributing)
        else:
            window = dict({name: counts.values[name] for name in WINDOW_COUNTS},
                          window_items=window[WINDOW_COUNTS.index("window_items")])
        counts.add(optimizer_steps=1)
        counts.clear_window()
        self._iterations += 1
        totals, iterations = counts.values, self._iterations
        if self.skip_nonfinite:
            totals = counts.unread(jnp)
            # A copy: the next step is given (and donates) the optimizer's state.
            iterations = jnp.copy(optimizer_variables[_keras_on_jax.iterations_position(
                self.model.optimizer)])
        for observer in self.observers:
            observer.after_apply(iterations, window, totals)

    # -- host-triggered window ends -----------------------------------------

    def flush(self):
        window = self.pending
        if not window.micro_batches:
            return window
        model = self.model
        # The update donates the variables' arrays: an interrupt waits for
        # the new ones to be assigned.
        with interrupts.deferred():
            self.counts.add(flushes=int(window.samples > 0))  # none where all was left out
            if self.cached is not None:
                self.cached.flush()
                return window
            trainable, optimizer_variables = self._apply(*_keras_on_jax.state_of(model))
            for variable, value in zip(model.trainable_variables, trainable):
                variable.assign(value)
            for variable, value in zip(model.optimizer.variables, optimizer_variables):
                variable.assign(value)
            for variable, value in zip(model.non_trainable_variables, batch_norm.moved(
                    self.observers, [v.value for v in model.non_trainable_variables])):
                variable.assign(value)
            _keras_on_jax.republish(model)
        return window

    def drop(self):
        window = self.pending
        if window.micro_batches:  # the next micro-batch overwrites the accumulators
            self.counts.add(dropped_micro_steps=window.micro_batches)
            self.counts.clear_window()
            for name in DEVICE_WINDOW_COUNTS:
                self.counts.on_device = self.counts.on_device.at[..., device_index(name)].set(0)
            tell(self.observers, "on_reset")
            if self.cached is not None:
                self.cached.reset()
        return window


def check_served(model, configuration, observers):
    """Refuses, by name, what the JAX backend does not serve yet."""
    def refuse(what, fix, on_tensorflow=True):
        served = (" (On the TensorFlow backend it is served: KERAS_BACKEND=tensorflow.)"
                  if on_tensorflow else "")
        raise ValueError(
            f"tfaccum on Keras' JAX backend does not serve {what} yet. {fix}{served}")

    distribution = _keras_on_jax.distribution()
    if distribution is not None:
        if not _keras_on_jax.data_parallel(distribution):
            refuse(f"keras.distribution.{type(distribution).__name__} (variables split over "
                   "devices: each device's accumulators are shaped as whole variables)",
                   "Use keras.distribution.DataParallel, or one device.", on_tensorflow=False)
        norms = _keras_on_jax.batch_norm_layers(model)
        if norms:
            refuse(f"BatchNormalization under DataParallel ({norms}: each device "
                   "would normalise by its own share's statistics, not the micro-batch's as "
                   "Keras does)", "Use LayerNormalization, or one device.", on_tensorflow=False)
    # The protocol is every backend's; what an observer keeps besides is its backend's.
    others = sorted({type(o).__name__ for o in observers if not isinstance(o, WindowObserver)
                     or type(o).__module__.startswith("tfaccum.backend.tensorflow")})
    if others:
        refuse(f"observers made for TensorFlow ({others})",
               "Pass the core's or the JAX backend's (tfaccum.observing.WindowObserver).")
    own = _keras_on_jax.own_train_step(model)
    if own is not None:
        refuse(f"a `train_step` of its own ({own}.train_step: the JAX step computes the "
               "gradients itself, so yours would not run)",
               "Leave Keras' train_step (override compute_loss instead).")
    loss = window_loss_of(model)
    if loss is not None:
        check_window_loss_served(model, loss, configuration)
    toolkit = [name for name, layer in _keras_on_jax.toolkit_layers(model)
               if not isinstance(layer, batch_norm.AccumBatchNormalization)]
    if toolkit:
        refuse(f"TensorFlow's AccumBatchNormalization layers ({toolkit}: made, or "
               "converted by convert_batch_norm, where Keras ran on TensorFlow)",
               "Make them where KERAS_BACKEND=jax (tfaccum.AccumBatchNormalization, or "
               "convert_batch_norm), or save the model and load it there.")


def check_said(hook, state, said):
    """Checks the counts `count_items()` said in a step, each device's (read on
    the host once a micro-step: only a step that says one waits). A bad one
    fails `fit` before its window is applied: the model keeps the state this
    step left, the hook is removed."""
    try:
        for count in np.ravel(hook.devices.entries(said)).tolist():
            said_items.check_number(count)
    except (TypeError, ValueError):
        _keras_on_jax.restore(hook.model, state)
        hook._accumulators = hook._observed = None
        hook.uninstall()
        raise
