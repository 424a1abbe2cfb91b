"""Where the JAX step's arrays live: one device, or `keras.distribution.DataParallel`'s.

Under `DataParallel` each device takes its share of every micro-batch (Keras
splits the batch along its batch axis) and keeps its own partial sums: the
accumulators and the counted items carry a leading axis of one entry per
device. A micro-step reduces no gradient, only the metrics' sums and what
the forward pass changed besides (a frozen layer's weights stay put); a window's
end sums the devices' partial sums once (`total()`), then every device
applies the same update to its copy of the variables, as
`jax.shard_map` runs one program per device.

A step's function is written once, for one device's share of the arrays
(`each_share`): each argument and result is `SHARED` (the same on every
device: the variables, the observers' states), `SPLIT` (one entry per
device: the accumulators, the counts, a share's scalars) or `BATCH` (split
along the batch: the data, the predictions).
"""

import jax
import jax.numpy as jnp
import numpy as np

SHARED, SPLIT, BATCH = "shared", "split", "batch"


def for_distribution(distribution):
    """The devices a step runs on under `distribution` (`None`: one device)."""
    return OneDevice() if distribution is None else SeveralDevices(distribution)


class OneDevice:
    """One device: a share is the whole micro-batch; nothing to reduce."""

    shares = 1

    def __repr__(self):
        return "OneDevice()"

    def zeros(self, shape, dtype):
        """Zeros kept apart per device (`SPLIT`): here, one array."""
        return jnp.zeros(shape, dtype)

    def total(self, value):
        """Inside a share: `value` summed over the devices."""
        return value

    def index(self):
        """Inside a share: which device holds it (0-based)."""
        return 0

    def each_share(self, function, in_kinds, out_kinds):
        return function

    def first(self, value):
        """A `SPLIT` result's first device's entry."""
        return value

    def read(self, split):
        """A `SPLIT` array summed over devices, on the host."""
        return np.asarray(split)

    def entries(self, split):
        """A `SPLIT` array's entries, one per device, on the host."""
        return np.asarray(split)


class SeveralDevices(OneDevice):
    """The devices of `keras.distribution.DataParallel`'s mesh, along its batch axis.

    Args:
        distribution: The `keras.distribution.DataParallel` that is set.
    """

    def __init__(self, distribution):
        self.mesh = distribution.device_mesh.backend_mesh
        self.axis = distribution.batch_dim_name
        self.shares = int(self.mesh.shape[self.axis])
        # Reads of a `SPLIT` array into one every process holds (another
        # process's entries cannot be fetched), compiled once.
        everywhere = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        self._summed = jax.jit(lambda a: a.sum(axis=0), out_shardings=everywhere)
        self._gathered = jax.jit(lambda a: a, out_shardings=everywhere)

    def __repr__(self):
        return f"SeveralDevices(devices={self.shares}, axis={self.axis!r})"

    def batch_sharding(self):
        return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(self.axis))

    def zeros(self, shape, dtype):
        make = jax.jit(lambda: jnp.zeros((self.shares, *shape), dtype),
                       out_shardings=self.batch_sharding())
        return make()  # made where each entry lives: no device holds them all

    def total(self, value):
        return jax.lax.psum(value, self.axis)

    def index(self):
        return jax.lax.axis_index(self.axis)

    def first(self, value):
        return value[0]

    def read(self, split):
        return np.asarray(self._summed(split))  # summed where the entries live

    def entries(self, split):
        return np.asarray(self._gathered(split))

    def each_share(self, function, in_kinds, out_kinds):
        P = jax.sharding.PartitionSpec
        spec = {SHARED: P(), SPLIT: P(self.axis), BATCH: P(self.axis)}

        def one_share(*args):
            args = [jax.tree.map(lambda a: a[0], arg) if kind == SPLIT else arg
                    for arg, kind in zip(args, in_kinds)]
            results = function(*args)
            return tuple(jax.tree.map(lambda r: jnp.expand_dims(r, 0), result)
                         if kind == SPLIT else result
                         for result, kind in zip(results, out_kinds))

        return shard_map(one_share, self.mesh, tuple(spec[k] for k in in_kinds),
                         tuple(spec[k] for k in out_kinds))


def shard_map(function, mesh, in_specs, out_specs):
    """`jax.shard_map` (JAX 0.6 and later), or its experimental form before.

    Results said to be `SHARED` are made alike on every device (reduced, or
    computed from what is), which the replication check cannot always see.
    """
    if hasattr(jax, "shard_map"):
        return jax.shard_map(function, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)
    from jax.experimental.shard_map import shard_map as experimental

    return experimental(function, mesh, in_specs, out_specs, check_rep=False)
