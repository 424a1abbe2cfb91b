"""The dashboard's summaries on JAX: the core's `WindowSummaries`, across processes."""

import jax
import jax.numpy as jnp

from tfaccum.window_summaries import WindowSummaries


class AccumulationSummaries(WindowSummaries):
    """`tfaccum.window_summaries.WindowSummaries` on JAX: every process records
    (the same compiled step, whose collectives must match); the first writes."""

    def writes_here(self):
        return jax.process_index() == 0

    def host_values(self, arrays):
        # Each row's copy on this process (across processes an array spans
        # devices this one cannot compute on alone).
        return jnp.stack([array.addressable_data(0) for array in arrays])
