"""`accumulation_steps` as a constant, a `{epoch: steps}` dict or a callable."""

import inspect

from tfaccum.checks import check_steps
from tfaccum.checks import is_int


def _check_arity(function):
    """Raises unless `function` can be called with one positional argument."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return  # a builtin without a signature: it is checked when called
    try:
        signature.bind(0)
    except TypeError:
        raise TypeError(
            "A callable `accumulation_steps` is called with the epoch (0-based) "
            "and must return the number of micro-batches per update, e.g. "
            "`lambda epoch: 8 if epoch < 5 else 4`. Received: "
            f"accumulation_steps={function!r} with signature {signature}"
        ) from None


class AccumulationSchedule:
    """Resolves `accumulation_steps` to a number of micro-batches per epoch.

    Args:
        accumulation_steps: An integer >= 1 (the same every epoch); a dict
            `{epoch: steps}` whose value applies from that epoch (0-based) on,
            with 1 before its smallest key (as Lightning's
            `GradientAccumulationScheduler`); or a callable `epoch -> steps`,
            checked each time it is called.

    Example:

    >>> schedule = AccumulationSchedule({0: 8, 5: 4})
    >>> schedule(0), schedule(4), schedule(5), schedule(100)
    (8, 8, 4, 4)
    """

    def __init__(self, accumulation_steps):
        self.accumulation_steps = accumulation_steps
        if isinstance(accumulation_steps, dict):
            if not accumulation_steps:
                raise ValueError(
                    "`accumulation_steps` must not be an empty dict. Pass "
                    "`{epoch: steps}` pairs, e.g. {0: 8, 5: 4}. "
                    "Received: accumulation_steps={}"
                )
            for epoch, steps in accumulation_steps.items():
                if not is_int(epoch) or epoch < 0:
                    raise ValueError(
                        "The keys of an `accumulation_steps` dict must be "
                        "epochs (integers >= 0). Received: "
                        f"accumulation_steps={accumulation_steps!r} with key "
                        f"{epoch!r}"
                    )
                check_steps(
                    steps,
                    received=f"accumulation_steps={accumulation_steps!r} "
                    f"with value {steps!r} for epoch {epoch!r}",
                )
            self._table = sorted(
                (int(e), int(s)) for e, s in accumulation_steps.items()
            )
            self._resolve = self._lookup
        elif callable(accumulation_steps):
            _check_arity(accumulation_steps)
            self._resolve = self._call
        else:
            check_steps(accumulation_steps)
            self._resolve = lambda epoch: int(accumulation_steps)

    def __call__(self, epoch):
        """Returns the number of micro-batches per update at `epoch`."""
        return self._resolve(epoch)

    @property
    def always_one(self):
        """Whether every epoch has windows of one micro-batch."""
        if callable(self.accumulation_steps):
            return False
        if isinstance(self.accumulation_steps, dict):
            return all(steps == 1 for _, steps in self._table)
        return self.accumulation_steps == 1

    def __repr__(self):
        return f"AccumulationSchedule({self.accumulation_steps!r})"

    def _lookup(self, epoch):
        steps = 1
        for start, value in self._table:
            if start <= epoch:
                steps = value
        return steps

    def _call(self, epoch):
        steps = self.accumulation_steps(epoch)
        return check_steps(
            steps,
            received=f"{steps!r}, returned by accumulation_steps({epoch}) "
            "at the start of that epoch",
        )
