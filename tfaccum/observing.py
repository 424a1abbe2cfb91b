"""What watches the window: one protocol and two records, the same on every backend.

An observer (the noise-scale estimator, the dashboard's summaries, pooled
batch statistics) sees each micro-batch as a `MicroStep` and each update as
an `Update`, inside the backend's compiled step. Its device state is a dict
of arrays that the backend keeps for it (variables on TensorFlow, arrays
carried through the compiled steps on JAX): a method takes the state and
returns the entries it changes, so that a backend writes only those.
"""


class _Record:
    """Named fields, each given as a value or as a function computing it.

    A function runs when an observer first reads the field (once per traced
    step): a squared norm reads every gradient, so it is computed only where
    an observer asks for it.
    """

    FIELDS = ()

    def __init__(self, **fields):
        unknown = set(fields) - set(self.FIELDS)
        if unknown:
            raise TypeError(
                f"{type(self).__name__} has no fields {sorted(unknown)}; its fields "
                f"are {', '.join(self.FIELDS)}.")
        self._given = fields

    def __getattr__(self, name):
        if name.startswith("_") or name not in self.FIELDS:
            raise AttributeError(name)
        value = self._given.get(name)
        if callable(value):
            value = value()
        setattr(self, name, value)  # read once
        return value

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(sorted(self._given))})"


class MicroStep(_Record):
    """One micro-batch, as observers see it.

    Fields:
        squared_norm: Squared L2 norm of its gradient as the window adds it
            (loss scaling undone), float32; 0 where not `measured`.
        mean_squared_norm: The same of the gradient of its mean loss over its
            samples (differs under `reduction="sum"`).
        items: Its weight in the window's unit: its samples, or the items
            (tokens) its loss averaged over.
        measured_items: `items` where `measured`, else 0: what an estimate of
            its size takes.
        samples: Its samples.
        loss: Its loss as Keras logs it, or `None` where the step showed none.
        measured: Whether its gradient tells its own (not multiplied by 0: a
            micro-batch that counts no item weighs nothing); `True` where that
            is known while tracing.
        moments: `{layer: [(count, mean, variance) of each call]}` of its
            accumulation-aware normalisation layers, where the step hands
            them to observers (JAX; TensorFlow's layers stage their own).
    """

    FIELDS = ("squared_norm", "mean_squared_norm", "items", "measured_items", "samples", "loss",
              "measured", "moments")


class Update(_Record):
    """A window applied through the optimizer, as observers see it.

    Fields:
        squared_norm: Squared L2 norm of the applied gradient (loss scaling
            undone).
        mean_squared_norm: The same of the gradient of the mean loss over the
            window's samples (differs under `reduction="sum"`).
        variables: The variables the window updates.
        variable_squares: Each one's squared gradient norm as applied
            (`None` where it got none; loss scaling not undone).
        gradient_scale: What the applied gradient is multiplied by (loss
            scaling), or `None`.
        window: `{name: count}` of the window (`window_micro_batches`,
            `window_samples`, `window_items`, `window_nonfinite`).
        counts: The hook's counts before the update where the step knows them
            (TensorFlow, which ends windows inside it), else `None`.
        iterations: `optimizer.iterations` after the update, likewise.
        loss: The window's loss, its micro-batches' losses weighted as their
            gradients, where the backend computes it, else `None`.
    """

    FIELDS = ("squared_norm", "mean_squared_norm", "variables", "variable_squares",
              "gradient_scale", "window", "counts", "iterations", "loss")


class WindowObserver:
    """Base class of what watches the window. Every method is optional.

    Device methods run inside the compiled step and return the entries of
    the observer's state they change (a dict; `{}` for none):
        initial(): its state before any window, a dict of arrays of
            `self.hook.ops` (`{}`: none).
        on_micro_step(state, step): a `MicroStep` was added to the window.
        on_leave_out(state, step): a `MicroStep` was left out (a non-finite
            gradient under `skip_nonfinite`).
        on_apply(state, update): the window was applied as an `Update`.
        on_reset(state): the window was emptied (after an update, or
            dropped).

    Host methods:
        on_install(hook): the hook was installed on its model (`self.hook`).
        on_uninstall(hook): the hook is being removed.
        after_apply(iterations, window, counts): a window ended, where the
            backend ends windows on the host (JAX); TensorFlow ends them in the
            step, where `Update.counts` tells them. `window["applied"]` says
            whether it made an update (not where every micro-batch was left
            out); under `skip_nonfinite` the values are device scalars.

    `state()` reads the state now. An observer on TensorFlow may keep
    variables of its own besides (what cannot be a dict of arrays: a
    buffer of rows, a layer's statistics) and return `{}`.

    Attributes:
        per_replica: Whether every replica feeds it its own share (with
            several replicas on TensorFlow); else each machine's first one.
        reads_micro_batch_gradients: Whether it compares each micro-batch's
            own gradient with the window's (a window-wide loss has none).
    """

    per_replica = False
    reads_micro_batch_gradients = False
    hook = None

    def initial(self):
        return {}

    def on_micro_step(self, state, step):
        return {}

    def on_leave_out(self, state, step):
        return {}

    def on_apply(self, state, update):
        return {}

    def on_reset(self, state):
        return {}

    def on_install(self, hook):
        self.hook = hook

    def on_uninstall(self, hook):
        pass

    def after_apply(self, iterations, window, counts):
        pass

    def state(self):
        """This observer's state now (`None` before its hook made it)."""
        return None if self.hook is None else self.hook.observer_state(self)


def tell(observers, method, *records):
    """Calls `method` of each observer with its state and `records`; its hook
    keeps the entries it changed. Inside a traced step (TensorFlow) or on the
    host; JAX's compiled step merges the entries into the state it carries."""
    for observer in observers:
        changed = getattr(observer, method)(observer.state(), *records)
        if changed:
            observer.hook.set_observer_state(observer, changed)

