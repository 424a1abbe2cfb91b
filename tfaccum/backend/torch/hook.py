"""The accumulating train function on Keras 3's PyTorch backend, installed on a compiled model.

The same hook as the other backends' (`tfaccum.AccumulationHook`: arguments,
counters, `flush`, `drop`, `remove`), made of what PyTorch does differently:
the step runs eagerly, so the host counts the window, adds each micro-batch's
`.grad` to float32 accumulators and applies the window through the
optimizer at its end (`step.py`).
"""

import functools

import keras
import numpy as np
import torch

from tfaccum import _keras as keras_models
from tfaccum import checks
from tfaccum import interrupts
from tfaccum import items as said_items
from tfaccum._keras import counted_losses
from tfaccum._keras import models
from tfaccum.backend.torch import _keras_on_torch
from tfaccum.backend.torch import window_backup
from tfaccum.backend.torch import output_channels
from tfaccum.backend.torch.step import Accumulators
from tfaccum.backend.torch.step import all_finite
from tfaccum.backend.torch.step import squared_norm
from tfaccum.counts import DEVICE_WINDOW_COUNTS
from tfaccum.counts import HostCounts
from tfaccum.counts import WINDOW_COUNTS
from tfaccum.counts import Window
from tfaccum.counts import device_index
from tfaccum.hook_front import HookFront
from tfaccum.patching import TrainFunctionInstallation
from tfaccum.observing import MicroStep
from tfaccum.observing import Update
from tfaccum.observing import WindowObserver
from tfaccum.observing import tell
from tfaccum.reduction import Sum
from tfaccum.window_losses import window_loss_of


class _OnHost:
    """Where the counts the data decides are kept: on the host (the step is eager)."""

    @staticmethod
    def zeros(shape, dtype):
        return np.zeros(shape, np.int64)

    @staticmethod
    def read(array):
        return array


class AccumulationHook(HookFront):
    """The `AccumulationHook` on Keras' PyTorch backend: see `HookFront`.

    What PyTorch does not serve yet is refused by name when the hook is
    made, before anything on the model changes (`check_served`).
    """

    backend_name = "torch"
    window_backup = window_backup  # what a backup holds of the hook
    ops = keras.ops  # the tensor namespace observers compute with

    def _make(self, model, api, configuration, observers, accumulation_steps):
        check_served(model, configuration, observers)
        configuration.reduction.check(model)
        self.model = model
        self.configuration = configuration
        self.reduction = configuration.reduction
        self.observers = list(observers)
        self.counts = HostCounts(_OnHost)
        self.skip_nonfinite = configuration.skips_nonfinite(
            keras_models.scales_loss_dynamically(model.optimizer))
        self._steps = checks.check_steps(accumulation_steps)
        self._accumulators = None  # made at the first micro-batch
        self._channels = None  # likewise, where outputs count apart
        self._observed = None  # the observers' states, likewise
        self.installation = TrainFunctionInstallation(model, self._train_function, self)
        self._install()

    def _install(self):
        for observer in self.observers:
            observer.on_install(self)
        self.installation.install()

    def _zero(self):
        self.counts.zero()
        self._accumulators = self._observed = self._channels = None

    def uninstall(self):
        try:
            super().uninstall()
        finally:
            self._accumulators = self._channels = None  # the window's memory, freed

    @property
    def accumulation_steps(self):
        return self._steps

    def set_accumulation_steps(self, accumulation_steps):
        self._steps = checks.check_steps(accumulation_steps)

    def observer_state(self, observer):
        """`observer`'s state now, or `None` before the first micro-batch."""
        return None if self._observed is None else self._observed[self.observers.index(observer)]

    def set_observer_state(self, observer, entries):
        """Sets the entries of `observer`'s state given (none before the first micro-batch)."""
        if self._observed is not None:
            index = self.observers.index(observer)
            self._observed[index] = dict(self._observed[index], **entries)

    @property
    def pending(self):
        values = self.counts.numpy()
        return Window(values["window_micro_batches"], values["window_samples"])

    # -- the train function ---------------------------------------------------------

    def _train_function(self, data):
        """Keras' `train_function(data)`: a list of `steps_per_execution` micro-batches."""
        logs = None
        for batch in data:
            logs = self._micro_step(batch)
        return logs

    def _micro_step(self, data):
        model = self.model
        if not model.trainable_weights:
            # Keras makes no update for a model without trainable weights: its
            # own step runs and a micro-step is counted (as on the other backends).
            self.counts.add(micro_steps=1)
            return model.train_step(data)
        if self._observed is None:
            self._observed = [observer.initial() for observer in self.observers]
        if self._accumulators is None:
            self._accumulators = Accumulators(model.trainable_weights,
                                              self.configuration.accumulator_dtype)
        values = self.counts.values
        # A step that fails before the first update (a refusal, a bad count)
        # leaves a plain model: nothing was applied, the hook is removed.
        first = values["optimizer_steps"] == 0 and values["flushes"] == 0
        try:
            return self._add(data)
        except Exception:
            if first:
                self._accumulators = self._observed = self._channels = None
                self.uninstall()  # `fit` stops here
            raise

    def _add(self, data):
        model, counts = self.model, self.counts
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with counted_losses.loss_inputs(model) as seen, said_items.collected() as said:
            y_pred, loss = _keras_on_torch.forward_and_loss(model, x, y, sample_weight)
        said_items.check_said_once(said)
        samples = _keras_on_torch.batch_size(x)
        models.track_loss(model, loss, samples)
        averaged_over = ((said[0] if said else seen["items"]) if self.reduction.counts_items
                         else None)
        added = samples if averaged_over is None else read_count(averaged_over)
        scale = _keras_on_torch.loss_scale(self.model.optimizer)
        counted = (output_channels.counted_apart(seen["outputs"], said)
                   if self.reduction.counts_items else [])
        if counted and self._channels is None:  # the outputs that count apart, found once
            self._channels = output_channels.OutputChannels(
                counted, model.trainable_weights, self.configuration.accumulator_dtype)
        apart = self._channels.gradients(counted, model.trainable_weights, scale) if counted else None
        rest = loss if apart is None else self._channels.rest(loss, counted)
        model.optimizer.scale_loss(rest).backward()
        grads = _keras_on_torch.gradients(model)
        window = self._window()
        weight = self.reduction.weight(_int(samples), _int(added), window)
        factor = None if weight is None else float(keras.ops.convert_to_numpy(weight))
        finite = not self.skip_nonfinite or all(all_finite(g) for g in [grads, *(apart or [])])
        norm = functools.cache(  # once, where an observer asks
            lambda: squared_norm(output_channels.whole_gradient(grads, apart)) / scale ** 2)
        step = MicroStep(
            squared_norm=norm,
            mean_squared_norm=lambda: norm() / (
                max(samples, 1) ** 2 if isinstance(self.reduction, Sum) else 1),
            items=_int(added), measured_items=_int(added), samples=_int(samples),
            loss=keras.ops.cast(loss, "float32").detach(), measured=True, moments={})
        if finite:
            # The first micro-batch kept overwrites what the last window left
            # (micro-batches left out before it added nothing).
            restart = int(window["window_micro_batches"]) == int(window["window_nonfinite"])
            if self.reduction.counts_items:
                restart = restart or (int(window["window_items"]) <= 0 and added > 0)
            self._accumulators.add(grads, factor, restart)
            if apart is not None:
                opening = int(window["window_micro_batches"]) == int(window["window_nonfinite"])
                self._channels.add(apart, counted, rest, samples, opening)
            self._count_on_device(window_items=added, items=added)
            tell(self.observers, "on_micro_step", step)
        else:
            self._leave_out(samples, step)
        counts.add(micro_steps=1, samples=samples, window_micro_batches=1,
                   window_samples=samples)
        if counts.values["window_micro_batches"] >= self._steps:
            with interrupts.deferred():  # the variables are updated in place
                self._apply()
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _leave_out(self, samples, step):
        """A micro-batch with a non-finite gradient, left out (`skip_nonfinite`):
        a dynamic loss scale is halved, as Keras halves it after such a step,
        and what the window holds (scaled by it) with it."""
        if _keras_on_torch.halve_loss_scale(self.model.optimizer):
            for accumulators in [self._accumulators, *getattr(self._channels, "sums", [])]:
                accumulators.scale(0.5)
        self._count_on_device(window_nonfinite=1, nonfinite_skips=1,
                              window_samples_left_out=samples, samples_left_out=samples)
        tell(self.observers, "on_leave_out", step)

    def _count_on_device(self, **counts):
        for name, value in counts.items():
            self.counts.on_device[device_index(name)] += value

    def _window(self):
        """The open window's counts, as the reduction reads them (int64 tensors)."""
        values = self.counts.numpy()
        return {name: _int(values[name]) for name in WINDOW_COUNTS}

    def _apply(self):
        """Applies the open window: its sum divided as the reduction says, then the
        optimizer's update, once."""
        model, counts = self.model, self.counts
        window = self._window()
        values = {name: int(value) for name, value in window.items()}
        contributing = values["window_micro_batches"] - values["window_nonfinite"] > 0
        if contributing:
            denominator = self.reduction.denominator(window)
            if denominator is not None:
                denominator = float(keras.ops.convert_to_numpy(denominator))
            variables = model.trainable_weights
            _keras_on_torch.release_gradients(model)  # the last micro-batch's, read already
            grads = self._accumulators.divided(denominator, [v.value.dtype for v in variables])
            if self._channels is not None:
                grads = self._channels.combine(grads)
            if self.observers:
                scale = _keras_on_torch.loss_scale(self.model.optimizer)
                squares = [squared_norm([g]) for g in grads]
                square = sum(squares) / scale ** 2
                samples = max(values["window_samples"], 1)
                tell(self.observers, "on_apply", Update(
                    squared_norm=square,
                    mean_squared_norm=square / samples ** 2 if isinstance(self.reduction, Sum)
                    else square,
                    variables=variables, variable_squares=squares, gradient_scale=None,
                    window=window, counts=None, iterations=None,
                    loss=None if self._channels is None else keras.ops.convert_to_tensor(
                        self._channels.window_loss(values["window_samples"]), "float32")))
            with torch.no_grad():
                model.optimizer.apply(grads, variables)
            counts.add(optimizer_steps=1)
        tell(self.observers, "on_reset")
        self._end_window()
        if contributing:
            iterations = int(keras.ops.convert_to_numpy(
                keras_models.iterations(model.optimizer).value))
            done = dict(values, applied=True)
            for observer in self.observers:
                observer.after_apply(iterations, done, counts.numpy())

    def _end_window(self):
        self.counts.clear_window()
        self.counts.on_device[[device_index(name) for name in DEVICE_WINDOW_COUNTS]] = 0

    # -- host-triggered window ends -----------------------------------------

    def flush(self):
        window = self.pending
        if window.micro_batches:
            with interrupts.deferred():
                # A window whose every micro-batch was left out applies nothing: no flush.
                self.counts.add(flushes=int(window.samples > 0))
                self._apply()
        return window

    def drop(self):
        window = self.pending
        if window.micro_batches:  # the next micro-batch overwrites the accumulators
            self.counts.add(dropped_micro_steps=window.micro_batches)
            self._end_window()
            tell(self.observers, "on_reset")
        return window


def read_count(items):
    """A count of items (said by `count_items()`, or counted from a mask), checked
    on the host as the other backends check it: a scalar number, whole, >= 0."""
    if keras.ops.is_tensor(items) or isinstance(items, np.ndarray):
        dtype = keras.backend.standardize_dtype(items.dtype)
        said_items.check_traced(
            items, dtype_name=dtype, is_number=np.issubdtype(np.dtype(dtype), np.number)
            if dtype != "bfloat16" else True, shape=tuple(items.shape))
        items = keras.ops.convert_to_numpy(items).item()
    said_items.check_number(items)
    return int(items)


def _int(value):
    return keras.ops.convert_to_tensor(value, "int64")


def check_served(model, configuration, observers):
    """Refuses, by name, what the PyTorch backend does not serve yet."""
    def refuse(what, fix):
        raise ValueError(
            f"tfaccum on Keras' PyTorch backend does not serve {what} yet. {fix} (On the "
            "TensorFlow and JAX backends it is served.)")

    if keras.distribution.distribution() is not None:
        refuse(f"keras.distribution.{type(keras.distribution.distribution()).__name__} "
               "(one device is served)", "Train on one device.")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # Keras 3.15 would train each process apart; 3.16 wraps the model in
        # DistributedDataParallel, which all-reduces every micro-batch.
        refuse(f"several processes (torch.distributed is initialized: world size "
               f"{torch.distributed.get_world_size()}, backend "
               f"{torch.distributed.get_backend()!r})",
               "Train in one process, without torch.distributed.init_process_group().")
    if window_loss_of(model) is not None:
        refuse("window-wide losses (a loss over the whole window's batch)",
               "Use a per-micro-batch loss.")
    if model.jit_compile:
        refuse("jit_compile=True (torch.compile of the train step: the accumulating step "
               "runs eagerly)", "Compile the model with jit_compile=False.")
    others = sorted({type(o).__name__ for o in observers if not isinstance(o, WindowObserver)
                     or type(o).__module__.startswith(("tfaccum.backend.tensorflow",
                                                       "tfaccum.backend.jax"))})
    if others:
        refuse(f"observers made for another backend ({others})",
               "Pass the core's (tfaccum.observing.WindowObserver).")
    own = _keras_on_torch.own_train_step(model)
    if own is not None:
        refuse(f"a `train_step` of its own ({own}.train_step: the accumulating step "
               "computes the gradients itself, so yours would not run)",
               "Leave Keras' train_step (override compute_loss instead).")
    toolkit = _keras_on_torch.toolkit_layers(model)
    if toolkit:
        refuse(f"tfaccum's AccumBatchNormalization layers ({toolkit}: the window's "
               "pooled batch statistics)", "Use keras.layers.BatchNormalization.")
