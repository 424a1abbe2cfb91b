"""Keras' private names, each looked up once, by what the installed Keras has.

tfaccum reads a few names Keras does not publish (each adapter module says
which, and `docs/how-it-works.md` lists them). An adapter looks each one up
here when it is imported: where Keras versions name a thing differently,
the first candidate the installed Keras has is taken, never a version
string parsed. A name no candidate gives is recorded, and the first `fit`
with tfaccum raises `KerasNotServedError` naming the installed Keras and
the newest one tfaccum was tested with (`check()`), rather than an
`ImportError` from inside tfaccum.
"""

import importlib
import warnings

import keras
from packaging.version import Version

# The newest Keras the suite ran on (`make test-next`; the Makefile's
# NEXT_KERAS pins the same version, tests/test_structure.py checks it).
NEWEST_TESTED = "3.16.0.dev2026102704"
NEWEST_RELEASE_TESTED = "3.15.1"  # what a user is told to install instead
REPORT_TO = "tfaccum's issue tracker (the repository you installed it from)"

_missing = {}  # "module.name" -> the candidates looked for
_warned = []


class KerasNotServedError(RuntimeError):
    """The installed Keras lacks a private name tfaccum reads."""


class Missing:
    """Stands for a name the installed Keras lacks: any use raises the error."""

    def __init__(self, where):
        self.where = where

    def __call__(self, *args, **kwargs):
        refuse([self.where])

    def __getattr__(self, name):
        refuse([self.where])

    def __bool__(self):
        return False


def refuse(wheres):
    """Raises `KerasNotServedError` for the private names `wheres` this Keras lacks."""
    raise KerasNotServedError(
        f"tfaccum reads Keras internals that this Keras does not have: "
        f"{', '.join(sorted(wheres))}. Installed: Keras {keras.__version__}; tfaccum was "
        f"tested up to Keras {NEWEST_TESTED}. Install the newest release it was tested "
        f"with (pip install 'keras=={NEWEST_RELEASE_TESTED}'), or report it to {REPORT_TO}.")


def module_attribute(module, *names):
    """The first of `names` that `module` (a dotted path) has, or a `Missing`.

    Example:

    ```python
    Trainer = module_attribute("keras.src.backend.jax.trainer", "Trainer", "JAXTrainer")
    ```
    """
    try:
        found = importlib.import_module(module)
    except ImportError:
        found = None
    for name in names:
        if hasattr(found, name):
            return getattr(found, name)
    _missing[f"{module}.{names[0]}"] = names
    return Missing(f"{module}.{names[0]}")


def check():
    """Raises `KerasNotServedError` if an adapter found a name missing; warns once
    where Keras is newer than the newest tested (the adapters still decide)."""
    if _missing:
        refuse(_missing)
    if not _warned and Version(keras.__version__) > Version(NEWEST_TESTED):
        _warned.append(True)
        warnings.warn(
            f"tfaccum was tested up to Keras {NEWEST_TESTED}; Keras {keras.__version__} is "
            f"newer. The private parts of Keras that tfaccum reads are all there, so it "
            f"runs; if training looks wrong, please report it to {REPORT_TO}, naming both "
            f"versions.", stacklevel=2)


def optional_attribute(module, name):
    """`module`'s `name`, or `None` where this Keras has none (a difference
    between versions, not a missing name)."""
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None
