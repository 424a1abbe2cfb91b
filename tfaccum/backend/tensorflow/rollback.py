"""A step that fails leaves the model as it was.

A refusal (a `StepError`, or any error) raised while the accumulating step
runs for the first time must not leave the model changed, so that a plain
`fit` afterwards equals a model never handed to tfaccum. Two things could
change it:

- While the step traces, variables made inside it (the slots of an
  optimizer first built by the step, a second optimizer made lazily, a
  metric's totals) get their values only when the traced function first
  runs: a trace that raises leaves them without any. `StepRollback` gives
  them their initial values.
- Run eagerly (`run_eagerly=True`), the step has already updated whatever
  it updates when the refusal is found (a GAN's two optimizers apply before
  tfaccum can count them). The first step after each install is watched:
  the model's and its optimizers' variables are set back, and variables it
  made get their initial values again.
"""

import contextlib
import warnings

import tensorflow as tf

from tfaccum.backend.tensorflow import _keras_on_tf


class StepRollback:
    """Undoes what a failed first step did to a model's variables.

    Args:
        model: The Keras model whose step is watched.
    """

    def __init__(self, model):
        self.model = model
        self._watch_eager = True

    def arm(self):
        """Watches the next eager step (called at each install)."""
        self._watch_eager = True

    @contextlib.contextmanager
    def guard(self):
        """Runs a step; if it raises, puts back what it changed, then re-raises."""
        tracing = not tf.executing_eagerly()
        if not tracing and not self._watch_eager:
            yield
            return
        before = [] if tracing else _values(_keras_on_tf.stateful_variables(self.model))
        made = []

        def record(next_creator, **kwargs):
            variable = next_creator(**kwargs)
            initial = kwargs.get("initial_value")
            if not tracing:  # made eagerly: its value now is its initial value
                initial = _copy(variable)
            made.append((variable, initial))
            return variable

        try:
            with tf.variable_creator_scope(record):
                yield
        except BaseException:
            with tf.init_scope():
                for variable, value in before:
                    variable.assign(value)
                _initialize(made, tracing)
            raise
        if not tracing:
            self._watch_eager = False


def _values(variables):
    return [(variable, _copy(variable)) for variable in variables]


def _copy(variable):
    return tf.identity(tf.convert_to_tensor(variable))


def _initialize(made, tracing):
    """Gives variables made in a failed step their initial values.

    Made while tracing, only those still uninitialized (never run) need it,
    and their initial value must be computed again eagerly: a callable is
    called again; a tensor of the trace is read where it is a constant
    (zeros, ones, a fixed seed: what optimizers, metrics and seed
    generators start from).
    """
    unknown = []
    for variable, initial in made:
        if tracing and _initialized(variable):
            continue
        value = initial
        if tracing:
            value = initial() if callable(initial) else tf.get_static_value(initial)
        if value is None:
            unknown.append(variable.name)
            continue
        variable.assign(value)
    if unknown:
        warnings.warn(
            "A train step that failed while it traced made variables whose initial "
            f"values cannot be computed again outside it: {unknown}. They are left "
            "uninitialized. Build the model (and its optimizers) before `fit`.",
            stacklevel=4)


def _initialized(variable):
    try:
        return bool(variable.is_initialized())
    except (AttributeError, tf.errors.OpError):
        return True
