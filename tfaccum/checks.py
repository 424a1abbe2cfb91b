"""Every argument check of the public API, in one place.

Each raises early, Keras' way: naming the argument and what it received, and
saying what it takes.
"""

import difflib
import numbers
import os
import warnings

from tfaccum.dashboard_schema import LEFTOVER_POLICIES as LEFTOVERS
from tfaccum import _keras
from tfaccum.reduction import Reduction

REDUCTIONS = ("auto", "samples", "mean", "sum")
SPARSE_GRADIENTS = ("rows", "dense")
ACCUMULATOR_DTYPES = ("float32", "bfloat16")
# The window length lives in an int64 variable.
MAX_STEPS = 2**63 - 1


def is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_steps(value, received=None):
    """Returns `value` as an `int` >= 1, or raises saying what was received.

    `received` describes where `value` came from; it defaults to
    `accumulation_steps=<value>`.
    """
    received = received or f"accumulation_steps={value!r}"
    if not is_int(value):
        raise TypeError(
            "`accumulation_steps` must be an integer >= 1. "
            f"Received: {received} (of type {type(value).__name__})"
        )
    if value < 1:
        raise ValueError(
            f"`accumulation_steps` must be an integer >= 1. Received: {received}"
        )
    if value > MAX_STEPS:
        raise ValueError(
            "`accumulation_steps` must be an integer >= 1 and below 2**63 "
            f"(it is kept as an int64). Received: {received}"
        )
    return int(value)


def check_compiled(model, api, existing):
    """Raises unless a hook can be installed on `model` (`existing`: its hook, if any)."""
    if not api.is_compiled(model):
        raise ValueError(
            "The model must be compiled before gradient accumulation can "
            "be installed on it: call `model.compile(optimizer=..., "
            f"loss=...)` first. Received: model={model.name!r} with "
            f"optimizer={getattr(model, 'optimizer', None)!r}"
        )
    optimizer = model.optimizer
    built_in = api.built_in_accumulation_steps(optimizer)
    if built_in:
        raise ValueError(
            "The model's optimizer already accumulates gradients itself "
            f"(gradient_accumulation_steps={built_in}); accumulating "
            "again would multiply the window. Compile the model with an "
            "optimizer without `gradient_accumulation_steps` and let "
            "tfaccum accumulate. Received: "
            f"{type(optimizer).__name__}(gradient_accumulation_steps="
            f"{built_in})"
        )
    if existing is not None:
        raise ValueError(
            f"Model {model.name!r} already has an accumulation hook "
            f"installed ({existing!r}). Remove it first with "
            "`hook.remove()` or `tfaccum.remove_accumulation_hook(model)`."
        )


def check_reinstallable(reinstallable, model):
    """Refuses `hook.reinstall()` where its traced step no longer fits `model`."""
    if not reinstallable:
        raise ValueError(
            "This hook cannot be reinstalled: it is installed, or the "
            f"model {model.name!r} was recompiled or changed since. "
            "Create a new one with `tfaccum.install_accumulation_hook()`."
        )


def check_removable(loop_running, model):
    """Refuses removing a hook from inside the `fit` that runs its train function.

    `loop_running`: whether the `fit` owning the hook is in its loop (`None`
    for a hook installed by hand: any running `fit` counts).
    """
    if loop_running is not False and _keras.fit_is_running(model):
        raise RuntimeError(
            "The accumulation hook of model "
            f"{model.name!r} cannot be removed while its `fit` is "
            "running: the running `fit` calls the accumulating train "
            "function. To stop accumulating, stop training "
            "(`model.stop_training = True`); the callback removes the hook "
            "when `fit` ends. Received: a call to remove the hook from "
            "inside `fit`."
        )


def check_fit_callbacks(callbacks, always_one, accumulation_steps):
    """Refuses a `fit`'s checkpoints that cannot resume accumulation; warns of
    Keras' own backups that cannot resume it exactly."""
    orbax = _keras.orbax_checkpoint_class()
    for other in callbacks:
        if (type(other).__name__ == "BackupAndRestore" and not always_one
                and not type(other).__module__.startswith("tfaccum")
                and getattr(other, "save_freq", "epoch") != "epoch"):
            warnings.warn(
                f"{type(other).__module__.split('.')[0]}.callbacks.BackupAndRestore("
                f"save_freq={other.save_freq!r}) backs up the weights of the last update, "
                "not the open window, and a resumed fit trains its epoch's first batches "
                "again: the resumed run is not the interrupted one's. tfaccum.BackupAndRestore "
                "takes the same arguments and resumes exactly at any micro-batch.",
                stacklevel=4)
        if (orbax is not None and isinstance(other, orbax)
                and not isinstance(other.save_freq, str) and not always_one):
            raise ValueError(
                "OrbaxCheckpoint with an integer `save_freq` cannot resume gradient "
                "accumulation: it counts batches from `optimizer.iterations`, which "
                "counts optimizer updates (one per window), so a resumed `fit` saves "
                "steps that already exist (StepAlreadyExistsError; Keras' own "
                "`gradient_accumulation_steps` fails alike). Use "
                "OrbaxCheckpoint(save_freq='epoch') (with `initial_epoch` when "
                "resuming), keras.callbacks.ModelCheckpoint, or tfaccum.BackupAndRestore "
                "(exact resume at any micro-batch). Received: "
                f"OrbaxCheckpoint(save_freq={other.save_freq!r}) with "
                f"accumulation_steps={accumulation_steps!r}"
            )


def check_reduction(reduction):
    """A reduction's name, or a `tfaccum.Reduction` instance."""
    if isinstance(reduction, Reduction):
        return reduction
    if isinstance(reduction, type) and issubclass(reduction, Reduction):
        raise TypeError(
            "`reduction` takes an instance of a Reduction class, not the class. "
            f"Received: reduction={reduction!r}. Pass reduction={reduction.__name__}()."
        )
    return _check_choice("reduction", reduction, REDUCTIONS, "or a tfaccum.Reduction")


def check_sparse_gradients(sparse_gradients):
    return _check_choice("sparse_gradients", sparse_gradients, SPARSE_GRADIENTS)


def check_accumulator_dtype(accumulator_dtype):
    return _check_choice("accumulator_dtype", accumulator_dtype, ACCUMULATOR_DTYPES)


def check_accumulator_dtype_meets(accumulator_dtype, strategy):
    """Refuses bfloat16 accumulators with several replicas (their sum would be bfloat16)."""
    replicas = strategy.num_replicas_in_sync
    if accumulator_dtype != "float32" and replicas > 1:
        raise ValueError(
            f"`accumulator_dtype={accumulator_dtype!r}` is not supported with several "
            f"replicas (this model's strategy has {replicas}): the replicas' windows "
            f"would be summed in {accumulator_dtype}, losing what the stochastic "
            "rounding keeps. Use accumulator_dtype=\"float32\" under a distribution "
            "strategy."
        )


# What users type for a valid value that `difflib` would not find.
_SAYINGS = {"avg": "mean", "average": "mean", "bf16": "bfloat16", "fp32": "float32",
            "float": "float32", "sparse": "rows", "apply": "flush", "keep": "carry",
            "discard": "drop"}


def _closest(value, choices):
    """The valid value `value` most likely meant, or `None`."""
    if not isinstance(value, str):
        return None
    said = value.strip().lower()
    said = _SAYINGS.get(said, said)
    if said in choices:
        return said
    close = difflib.get_close_matches(said, choices, n=1)
    return close[0] if close else None


def _check_choice(name, value, choices, alternative=None):
    if not isinstance(value, str) or value not in choices:
        alternative = f" {alternative}" if alternative else ""
        closest = _closest(value, choices)
        hint = f" Did you mean {name}={closest!r}?" if closest else ""
        raise ValueError(
            f"`{name}` must be one of {', '.join(map(repr, choices))}{alternative}. "
            f"Received: {name}={value!r}.{hint}"
        )
    return value


def check_skip_nonfinite(skip_nonfinite):
    if skip_nonfinite is not None and not isinstance(skip_nonfinite, bool):
        raise TypeError(
            "`skip_nonfinite` must be None, True or False. "
            f"Received: skip_nonfinite={skip_nonfinite!r}"
        )
    return skip_nonfinite


def check_log_dir(log_dir):
    """`log_dir` as a string, or an error if it cannot be a directory to write to.

    Nothing is created here. Paths with a scheme (`gs://...`) are left to
    TensorFlow's file system.
    """
    if log_dir is None:
        return None
    if not isinstance(log_dir, (str, os.PathLike)):
        raise TypeError(
            "`log_dir` must be a path (str or os.PathLike) or None. "
            f"Received: log_dir={log_dir!r}"
        )
    path = os.fspath(log_dir)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not path.strip():
        raise ValueError(
            "`log_dir` must name a directory; pass None for no summaries. "
            f"Received: log_dir={log_dir!r}"
        )
    if "\x00" in path:
        raise ValueError(f"`log_dir` must not hold a NUL character. Received: log_dir={log_dir!r}")
    if "://" in path:
        return path
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    problem = None
    if not os.path.isdir(existing):
        problem = f"{existing!r} is not a directory"
    elif not os.access(existing, os.W_OK | os.X_OK):
        problem = f"{existing!r} is not writable"
    if problem:
        raise ValueError(
            "`log_dir` must be a directory tfaccum can create and write "
            f"summaries to, but {problem}. Received: log_dir={log_dir!r}"
        )
    return path


def check_leftover(leftover):
    return _check_choice("leftover", leftover, LEFTOVERS)


def check_keywords_only(args, first):
    """Refuses positional arguments to a class whose arguments are keywords."""
    if args:
        raise TypeError(
            f"GradientAccumulationCallback takes keyword arguments only. Received "
            f"{len(args)} positional: {args!r}. Name each, starting with "
            f"GradientAccumulationCallback({first}={args[0]!r}).")


def reject_unknown(kwargs, known):
    if not kwargs:
        return
    hints = []
    for name in kwargs:
        close = difflib.get_close_matches(name, known, n=1)
        if close:
            hints.append(f"`{name}` (did you mean `{close[0]}`?)")
        else:
            hints.append(f"`{name}`")
    raise TypeError(
        "Unrecognized keyword arguments passed to "
        f"GradientAccumulationCallback: {', '.join(hints)}. Accepted: "
        f"{', '.join(known)}. Received: {kwargs!r}"
    )


def check_verbose(verbose):
    if not is_int(verbose) or verbose not in (0, 1):
        raise ValueError(f"`verbose` must be 0 or 1. Received: verbose={verbose!r}")
    return int(verbose)


def check_noise_scale(noise_scale, accumulation_steps, always_one):
    """`noise_scale` (None, True or False); True needs windows of 2 or more."""
    if noise_scale is not None and not isinstance(noise_scale, bool):
        raise TypeError(
            "`noise_scale` must be None, True or False. "
            f"Received: noise_scale={noise_scale!r}"
        )
    if noise_scale is True and always_one:
        raise ValueError(
            "The noise scale compares gradients at two batch sizes, the "
            "micro-batch and the window: it needs `accumulation_steps` >= 2. "
            "Received: noise_scale=True with accumulation_steps="
            f"{accumulation_steps!r}. Pass noise_scale=False, or accumulate."
        )
    return noise_scale


def check_noise_scale_at_epoch(steps, epoch, noise_scale):
    """`steps`, the schedule's window at `epoch`, unless `noise_scale=True` meets 1."""
    if steps == 1 and noise_scale:
        raise ValueError(
            "The noise scale compares gradients at two batch sizes: "
            "it needs `accumulation_steps` >= 2. Received: "
            f"noise_scale=True with accumulation_steps({epoch}) = 1 "
            "at the start of that epoch. Pass noise_scale=False."
        )
    return steps


def check_scalars(scalars, log_dir):
    if not isinstance(scalars, bool):
        raise TypeError(f"`scalars` must be True or False. Received: scalars={scalars!r}")
    if scalars and log_dir is None:
        raise ValueError(
            "`scalars=True` writes to `log_dir`: pass a `log_dir` too. Received: log_dir=None"
        )
    return scalars


def check_write_interval(write_interval):
    if (
        isinstance(write_interval, bool)
        or not isinstance(write_interval, numbers.Real)
        or not write_interval > 0
        or write_interval == float("inf")
    ):
        raise ValueError(
            "`write_interval` must be a number of seconds > 0. "
            f"Received: write_interval={write_interval!r}"
        )
    return float(write_interval)
