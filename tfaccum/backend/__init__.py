"""The frameworks accumulation runs on: one package each, behind one interface.

What is arithmetic of accumulation (reductions, counts, schedules, leftover
policies, the noise scale's estimates, writing the summaries) lives in
`tfaccum`'s top-level modules and imports no framework. What a framework
does (tracing or compiling the step, replication across devices, sparse
gradients, recording the summaries' rows) lives in a package here, whose
`BACKEND` is a `Backend`: `tfaccum.backend.tensorflow` serves Keras 3 on
TensorFlow and tf_keras, `tfaccum.backend.jax` Keras 3 on JAX. A new
framework is a new package with its `Backend`.
"""

import abc
import importlib

from tfaccum import _keras
from tfaccum._keras import private
from tfaccum.noise_scale import NoiseScaleEstimator


class Backend(abc.ABC):
    """What the callback and `install_accumulation_hook` ask of a framework.

    One instance per backend package (its `BACKEND`), chosen once per model
    by `for_model`, as Keras picks a trainer per backend. A subclass names
    its hook and observer classes and answers the questions below; an option
    or a part of a model it does not serve is refused by name when its hook
    is made (the hook's checks), before anything on the model changes.

    Attributes:
        name: Keras' name of the backend (`keras.backend.backend()`).
        hook_class: Its `AccumulationHook` (on `tfaccum.hook_front.HookFront`).
        summaries_class: Its dashboard observer, made as
            `summaries_class(log_dir, scalars=, write_interval=, noise=)`.
    """

    # The attributes above: a subclass sets each as a class attribute.
    name = property(abc.abstractmethod(lambda self: None))
    hook_class = property(abc.abstractmethod(lambda self: None))
    estimator_class = NoiseScaleEstimator  # every backend's: its state is arrays of `hook.ops`
    summaries_class = property(abc.abstractmethod(lambda self: None))

    @abc.abstractmethod
    def writes_summaries(self, model):
        """Whether this process (or worker) writes `model`'s summaries."""

    @abc.abstractmethod
    def layer_observer_kinds(self, model):
        """The observer classes `model`'s layers need (pooled batch statistics)."""

    @abc.abstractmethod
    def layer_observers(self, model):
        """Those observers, made for `model`."""

    # -- what every backend does alike ------------------------------------------------

    def observer_kinds(self, model, *, noise_scale, summaries):
        """The observer classes of a hook for `model` (a `Configuration`'s `observers`)."""
        return ([self.estimator_class] * bool(noise_scale)
                + [self.summaries_class] * bool(summaries)
                + list(self.layer_observer_kinds(model)))

    def make_hook(self, model, configuration, *, log_dir, scalars, write_interval):
        """A hook of `configuration` for the callback, with the observers its
        `observers` name, at windows of 1 (each epoch sets its length)."""
        kinds = configuration.observers
        estimator = self.estimator_class() if self.estimator_class in kinds else None
        summaries = (self.summaries_class(log_dir, scalars=scalars, write_interval=write_interval,
                                          noise=estimator)
                     if self.summaries_class in kinds else None)
        observers = [o for o in (estimator, summaries) if o is not None]
        return self.hook_class.made_with(model, configuration,
                                         observers + list(self.layer_observers(model)),
                                         accumulation_steps=1)

    def install(self, model, **arguments):
        """A hook installed by hand (`install_accumulation_hook`)."""
        return self.hook_class.watched_by(model, self.layer_observers(model), **arguments)

    def estimator_of(self, hook):
        """`hook`'s noise-scale observer, or `None`."""
        return next((o for o in hook.observers if isinstance(o, self.estimator_class)), None)

    def summaries_of(self, hook):
        """`hook`'s dashboard observer, or `None`."""
        return next((o for o in hook.observers if isinstance(o, self.summaries_class)), None)

    def __repr__(self):
        return f"<tfaccum backend {self.name!r}>"


def for_model(model):
    """The `Backend` that serves `model`, or a clear error naming its backend."""
    _keras.check_backend(model)
    backend = importlib.import_module(f"tfaccum.backend.{_keras.api_for(model).backend()}").BACKEND
    private.check()  # the backend's adapters have looked up what they read of Keras
    return backend
