"""A hook's configuration, resolved once from the public arguments.

The argument checks (`checks.py`) turn what a user passed into one frozen
`Configuration`: the reduction as an object, whether sparse gradients keep
their rows, the accumulators' dtype, whether non-finite micro-batches are
left out, and the observers a hook is made with. The callback uses it both
to build a hook and to decide whether a hook it already traced can serve
again (equal configurations, same model); nothing downstream compares a
string or a class name.
"""

import dataclasses

from tfaccum import checks
from tfaccum import reduction as reductions


@dataclasses.dataclass(frozen=True)
class Configuration:
    """What an `AccumulationHook` is made with (see `GradientAccumulationCallback`'s arguments).

    Attributes:
        reduction: The `Reduction` object.
        skip_nonfinite: `True`, `False`, or `None` (on exactly under a
            `LossScaleOptimizer`; `skips_nonfinite(optimizer)` resolves it).
        sparse_rows: Whether sparse gradients keep their rows (`"rows"`).
        accumulator_dtype: `"float32"` or `"bfloat16"`, as given.
        observers: The classes of the hook's observers, in order.
    """

    reduction: reductions.Reduction
    skip_nonfinite: object
    sparse_rows: bool
    accumulator_dtype: str
    observers: tuple = ()

    @classmethod
    def resolve(cls, *, reduction="auto", skip_nonfinite=None, sparse_gradients="rows",
                accumulator_dtype="float32", observers=()):
        """Checks the public arguments (errors name them) and resolves them once."""
        return cls(
            reduction=reductions.get(checks.check_reduction(reduction)),
            skip_nonfinite=checks.check_skip_nonfinite(skip_nonfinite),
            sparse_rows=checks.check_sparse_gradients(sparse_gradients) == "rows",
            accumulator_dtype=checks.check_accumulator_dtype(accumulator_dtype),
            observers=tuple(observers))

    @property
    def sparse_gradients(self):
        """The argument's value: `"rows"` or `"dense"`."""
        return "rows" if self.sparse_rows else "dense"

    @property
    def dense_dtype(self):
        """The dense accumulators' dtype: `None` (the variable's) or `"bfloat16"`."""
        return None if self.accumulator_dtype == "float32" else "bfloat16"

    def skips_nonfinite(self, scales_loss_dynamically):
        """Whether non-finite micro-batches are left out, for an optimizer that does
        (or does not) scale its loss dynamically."""
        if self.skip_nonfinite is None:
            return scales_loss_dynamically
        return self.skip_nonfinite
