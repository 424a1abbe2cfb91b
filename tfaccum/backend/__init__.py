"""The frameworks accumulation runs on: one package each.

What is arithmetic of accumulation (reductions, counts, schedules, leftover
policies, the noise scale's estimates, the summaries' series) lives in
`tfaccum`'s top-level modules and imports no framework. What a framework
does (tracing the step, its conditionals, replication across devices,
sparse gradients, writing summaries) lives in a package here:
`tfaccum.backend.tensorflow` serves Keras 3 on TensorFlow and tf_keras.
A new framework is a new package beside it, with the names the callback
asks a backend for (see `tfaccum.backend.tensorflow`).
"""

import importlib

from tfaccum import _keras


def for_model(model):
    """The backend package that serves `model`, or a clear error naming its backend."""
    _keras.check_backend(model)
    return importlib.import_module(f"tfaccum.backend.{_keras.api_for(model).backend()}")
