"""A hook that belongs to one `fit` at a time: the callback's fit-scoping.

Keras tells no callback when `fit` fails (another callback raising,
KeyboardInterrupt, ...). `FitScope` makes a hook belong to the running `fit`
however that `fit` ends: the next `fit` or `train_on_batch` of the model first
removes a hook whose `fit` did not end, so the model trains plainly without
anyone removing it by hand; the partial window left when `fit` ends is applied
before Keras writes the optimizer's EMA into the weights; and a hook removed
at the end of a `fit` is kept on the model, so that a callback of the same
configuration reinstalls it instead of tracing the train step again.

A `fit` that raised keeps the weights of its last completed update on every
backend: its open window stays pending (dropped when the model next trains),
and the end-of-fit work that Keras still runs on the way out (on JAX) never
replaces the exception with its own.
"""

import sys
import warnings

from tfaccum.patching import InstancePatch

# The last hook a callback removed from a model: a new callback with the
# same configuration reinstalls it instead of tracing a train step again.
_SPARE_HOOK_ATTRIBUTE = "_tfaccum_spare_hook"


class FitScope:
    """Scopes accumulation hooks to the `fit` that installed them.

    Args:
        end_fit: Called (with no argument) to end a `fit` that is still open
            when Keras finalizes the optimizer's variables.
        stop_fit: Called instead while an exception leaves `fit` (Keras
            finalizes in a `finally` on some backends); what it raises is
            said in a warning, and the exception goes on.
    """

    def __init__(self, end_fit, stop_fit):
        self.hook = None
        self.fit_ended = True
        self._end_fit = end_fit
        self._stop_fit = stop_fit

    def reusable(self, model, configuration):
        """This scope's or the model's spare hook made with `configuration`, or `None`."""
        spare = model.__dict__.get(_SPARE_HOOK_ATTRIBUTE)
        for hook in (self.hook, spare):
            if (hook is not None and hook.model is model
                    and hook.configuration == configuration and hook.can_reinstall()):
                return hook
        return None

    def begin(self, hook, reinstall):
        """Makes `hook` this `fit`'s: reinstalled, or new (then scoped to the `fit`)."""
        if reinstall:
            hook.reinstall()
        else:
            try:
                self._scope(hook)
            except BaseException:
                hook.installation.loop_running = False
                hook.remove()
                raise
        self.hook = hook
        hook.installation.loop_running = True
        self.fit_ended = False

    def end(self):
        """The `fit`'s loop is over (its last window is the caller's to end first)."""
        self.fit_ended = True
        if self.hook is not None:
            self.hook.installation.loop_running = False

    def retire(self):
        """Removes the hook when `fit` ends and keeps it as the model's spare."""
        hook = self.hook
        hook.remove()
        hook.model.__dict__[_SPARE_HOOK_ATTRIBUTE] = hook

    def abandon(self):
        """Drops what is pending and removes the hook (an error aborts `fit`)."""
        if self.hook is not None and self.hook.installed:
            self.end()
            self.hook.drop()
            self.hook.remove()

    def _scope(self, hook):
        model = hook.model

        def ended_first(name):
            def call(*args, **kwargs):
                self._remove_stale(hook)
                return getattr(model, name)(*args, **kwargs)

            call.__name__ = name
            return call

        for name in ("fit", "train_on_batch"):
            hook.installation.hold(InstancePatch(model, name, ended_first(name)))
        finalize = InstancePatch(model.optimizer, "finalize_variable_values", None)

        def finalize_variable_values(var_list):
            if hook.installed and not self.fit_ended:
                if sys.exc_info()[1] is None:
                    self._end_fit()
                else:
                    self._stopped(sys.exc_info()[1])
            return finalize.original()(var_list)

        finalize.value = finalize_variable_values
        hook.installation.hold(finalize)

    def _stopped(self, exception):
        """`fit` is leaving with `exception`: the loop is over; nothing here replaces it."""
        self.end()
        try:
            self._stop_fit()
        except Exception as error:  # noqa: BLE001 - the user's exception goes on
            warnings.warn(
                f"`fit` stopped with {type(exception).__name__}; on the way out the "
                f"accumulation callback could not finish its work: {type(error).__name__}: "
                f"{error}", stacklevel=3)

    def _remove_stale(self, hook):
        """Removes a hook whose `fit` stopped without ending (an exception)."""
        if not hook.installed:
            return
        self.end()
        hook.installation.loop_running = False
        window = hook.drop()
        try:
            hook.uninstall()
        except Exception as error:  # noqa: BLE001 - the model is plain again
            warnings.warn(
                "Could not write what the accumulation summaries of the "
                f"unfinished `fit` held: {type(error).__name__}: {error}",
                stacklevel=3,
            )
        warnings.warn(
            "Removed the accumulation hook of model "
            f"{hook.model.name!r} left by a `fit` that did not finish "
            "(it raised an exception); discarded its "
            f"{window.micro_batches} pending micro-batches ({window.samples} "
            "samples). This call trains the model plainly unless it is given "
            "a GradientAccumulationCallback.",
            stacklevel=3,
        )
