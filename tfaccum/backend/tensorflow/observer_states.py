"""The observers' states on TensorFlow: variables of this machine, read where used.

An observer (`tfaccum.observing.WindowObserver`) returns the entries of its
state that a micro-step, an update or a reset changes; here each entry is a
variable, read only when the observer reads it and written only when it
changed, so an observer costs the step no more ops than one that kept
variables of its own. Nothing is mirrored across replicas: with several,
each machine's observers see its first replica (`devices.py`).
"""

import collections.abc
import functools

import tensorflow as tf

from tfaccum.backend.tensorflow import _keras_on_tf
from tfaccum.backend.tensorflow.gradients import squared_norm
from tfaccum.observing import MicroStep
from tfaccum.observing import Update


class ObserverStates:
    """Each observer's state, as variables made once (when the hook is installed)."""

    def __init__(self):
        self._variables = {}  # id(observer) -> {name: variable}

    def make(self, observers):
        for observer in observers:
            if id(observer) not in self._variables:
                self._variables[id(observer)] = {
                    name: _keras_on_tf.local_variable(value, f"{type(observer).__name__}_{name}")
                    for name, value in observer.initial().items()}

    def read(self, observer):
        """`observer`'s state: a mapping that reads a variable when an entry is read."""
        variables = self._variables.get(id(observer))
        return None if variables is None else _Reads(variables)

    def write(self, observer, entries):
        variables = self._variables[id(observer)]
        for name, value in entries.items():
            variables[name].assign(value)


class _Reads(collections.abc.Mapping):
    """Variables read once each, when first looked up."""

    def __init__(self, variables):
        self._variables = variables
        self._values = {}

    def __getitem__(self, name):
        if name not in self._values:
            self._values[name] = self._variables[name].read_value()
        return self._values[name]

    def __iter__(self):
        return iter(self._variables)

    def __len__(self):
        return len(self._variables)


def observed_micro_step(grads, *, samples, items, loss, gradient_scale, mean_divisor,
                        weighs_items):
    """The `MicroStep` observers see of a micro-batch's gradients.

    `gradient_scale`: what `grads` are multiplied by relative to the
    micro-batch's own loss gradient (loss scaling, sample weighting), or
    `None`; `mean_divisor`: its samples under `reduction="sum"`, else `None`;
    `weighs_items`: whether its weight in the window is its items (known
    while tracing): then one weighed 0 counted none, nothing to select.
    """
    square = functools.cache(lambda: _divided(squared_norm(grads), gradient_scale))
    measured = True
    if gradient_scale is not None:
        measured = functools.cache(lambda: tf.not_equal(gradient_scale, 0.0))
    items = samples if items is None else items
    measured_items = items
    if gradient_scale is not None and not weighs_items:
        measured_items = lambda: tf.where(measured(), items, tf.zeros_like(items))  # noqa: E731
    return MicroStep(
        squared_norm=square, mean_squared_norm=lambda: _divided(square(), mean_divisor),
        items=items, measured_items=measured_items, samples=samples, loss=loss,
        measured=measured)


def observed_update(grads, variables, gradient_scale, mean_divisor, **fields):
    """The `Update` observers see of the gradients applied (`fields`: the rest)."""
    squares = functools.cache(
        lambda: [None if g is None else squared_norm([g]) for g in grads])
    square = functools.cache(
        lambda: _divided(tf.add_n([sq for sq in squares() if sq is not None]), gradient_scale))
    return Update(squared_norm=square, mean_squared_norm=lambda: _divided(square(), mean_divisor),
                  variables=list(variables), variable_squares=squares,
                  gradient_scale=gradient_scale, **fields)


def _divided(square, scale):
    """A squared norm of gradients multiplied by `scale`, undone (`None`: as is; 0: 0)."""
    if scale is None:
        return square
    return tf.math.divide_no_nan(square, tf.square(tf.cast(scale, tf.float32)))
