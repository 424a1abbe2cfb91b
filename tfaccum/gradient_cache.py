"""Gradient caching: a window-wide loss trained exactly, at a micro-batch's activation memory.

The train step of a model compiled with a `WindowLoss` (Gao et al. 2021,
"Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup"):

1. each micro-step runs the forward pass without a tape and keeps what the
   window needs of it: the inputs, targets, sample weights, the outputs
   (embeddings) and the states of the seed generators the forward pass drew
   its dropout masks from (`WindowBuffers`);
2. when the window ends, the compiled loss is computed over the window's
   outputs, as the large batch's step computes it, and its gradient with
   respect to those outputs is taken;
3. each micro-batch's forward pass runs again, with the same masks (its seed
   states set back), and back-propagates its slice of that gradient into the
   accumulators; the optimizer applies their sum once.

The update is the large batch's; activations are held for one micro-batch
at a time. Cost: one more forward pass per sample. One device only.
"""

import tensorflow as tf

from tfaccum import _keras
from tfaccum.observers import Update
from tfaccum.replication import OneDevice
from tfaccum.step import StepError
from tfaccum.step import count_samples


class _Buffer:
    """One variable of a window's rows, held along its first axis.

    Rows are written in place (a scatter into the rows the window reached),
    into a variable that grows, doubling, to the largest window seen: a
    window's rows are not copied at each micro-step. `WindowBuffers` says
    how many rows are the window's. A buffer never shrinks: TensorFlow's
    graph optimizer (2.16-2.21) answers the size of a read made before a
    variable's shape changes, in the same function, with the size after it.
    """

    def __init__(self, spec, name):
        self.element_shape = spec.shape[1:]
        self.dtype = spec.dtype
        self._fixed = self.element_shape.is_fully_defined()
        dims = [0] + [d if d is not None else 0 for d in self.element_shape.as_list()]
        with tf.init_scope():
            self.variable = tf.Variable(
                tf.zeros(dims, self.dtype), trainable=False, name=name,
                shape=tf.TensorShape([None]).concatenate(self.element_shape))
            self.capacity = tf.Variable(tf.zeros((), tf.int64), trainable=False,
                                        name=name + "_capacity")

    def append(self, held, rows):
        """Keeps `rows` after the first `held` rows."""
        rows = tf.cast(rows, self.dtype)
        if not self._fixed:
            # Unknown dimensions: a window's first rows set them (padded
            # inputs of one length); the window is concatenated.
            kept = self.variable.read_value()[:held]
            self.variable.assign(tf.cond(held > 0, lambda: tf.concat([kept, rows], 0),
                                         lambda: rows))
            return
        need = held + tf.shape(rows, out_type=tf.int64)[0]
        capacity = self.capacity.read_value()

        def grow():
            size = tf.maximum(need, 2 * capacity)
            dims = tf.constant(self.element_shape.as_list(), tf.int64)
            padding = tf.zeros(tf.concat([[size - held], dims], 0), self.dtype)
            self.variable.assign(tf.concat([self.variable.read_value()[:held], padding], 0))
            self.capacity.assign(size)
            return tf.constant(True)

        grown = tf.cond(need > capacity, grow, lambda: tf.constant(False))
        with tf.control_dependencies([grown]):
            self.variable.scatter_nd_update(tf.range(held, need)[:, None], rows)

    def read(self, held=None):
        """The window's rows, or (`held=None`) every row, read without a copy."""
        value = self.variable.read_value()
        return value if held is None else value[:held]


class WindowBuffers:
    """What a window keeps of its micro-batches until it ends.

    A structure of tensors per micro-batch (`append`): its per-sample parts
    are concatenated along the batch axis; `seeds` (one state per seed
    generator) are kept one row per micro-batch, with the micro-batch sizes.
    Made at the first trace, from what the step gives.
    """

    def __init__(self, parts):
        self._structure = {name: value for name, value in parts.items()
                           if name != "seeds" and value is not None}
        flat = tf.nest.flatten(self._structure)
        self._buffers = [_Buffer(tf.TensorSpec.from_tensor(t), f"window_{i}")
                         for i, t in enumerate(flat)]
        self._seeds = [_Buffer(tf.TensorSpec([None] + s.shape.as_list(), s.dtype), "window_seed")
                       for s in parts["seeds"]]
        self._sizes = _Buffer(tf.TensorSpec([None], tf.int64), "window_sizes")
        is_input = tf.nest.flatten({name: tf.nest.map_structure(lambda _: name == "x", value)
                                    for name, value in self._structure.items()})
        self._input_buffers = [b for b, x in zip(self._buffers, is_input) if x]
        with tf.init_scope():
            # The window's rows (samples) and micro-batches held.
            self.held = tf.Variable(tf.zeros((2,), tf.int64), trainable=False,
                                    name="window_held")

    def append(self, parts, samples):
        held = self.held.read_value()
        flat = tf.nest.flatten({name: parts[name] for name in self._structure})
        for buffer, value in zip(self._buffers, flat):
            buffer.append(held[0], value)
        for buffer, state in zip(self._seeds, parts["seeds"]):
            buffer.append(held[1], state[None])
        samples = tf.cast(samples, tf.int64)
        self._sizes.append(held[1], tf.reshape(samples, [1]))
        self.held.assign_add(tf.stack([samples, tf.constant(1, tf.int64)]))

    def read(self):
        """`(parts, seeds, sizes)`: the window's parts as the step gave them, but its inputs.

        The inputs are read a micro-batch at a time (`inputs`).
        """
        held = self.held.read_value()
        inputs = set(id(b) for b in self._input_buffers)
        parts = dict.fromkeys(("x", "y", "sample_weight", "y_pred"))
        parts.update(tf.nest.pack_sequence_as(
            self._structure,
            [None if id(b) in inputs else b.read(held[0]) for b in self._buffers]))
        parts["x"] = None
        return parts, [b.read(held[1]) for b in self._seeds], self._sizes.read(held[1])

    def inputs(self, start, stop):
        """The inputs `x` of rows `start` to `stop`, gathered.

        Gathered rows, not a slice of a read: a variable written by rows
        (scatter) copies itself whole on every read (TensorFlow's
        copy-on-read mode), which would hold the window's inputs twice.
        """
        rows = tf.range(start, stop)
        inputs = set(id(b) for b in self._input_buffers)
        flat = [b.variable.sparse_read(rows) if id(b) in inputs else None
                for b in self._buffers]
        return tf.nest.pack_sequence_as(self._structure, flat)["x"]

    def clear(self):
        self.held.assign(tf.zeros((2,), tf.int64))


class GradientCache(OneDevice):
    """The train step and window end of a model compiled with a `WindowLoss`.

    Takes the place of the hook's step tracer (the model's `train_step` is
    Keras' own, run here in two halves) and of its replication: one device.

    Args:
        model: The compiled model (its loss a `WindowLoss`).
        state: The hook's `WindowState` (accumulators and counts).
        applier: Applies gradients through the optimizer's own method.
        observers: The hook's `WindowObserver`s (told of each update).
    """

    def __init__(self, model, state, applier, observers):
        super().__init__(model, state, applier, observers, skip_nonfinite=False)
        self.buffers = None
        self._seed_states = None

    @property
    def traced(self):
        return self.buffers is not None

    @property
    def traced(self):
        return self.buffers is not None

    # -- a micro-step -------------------------------------------------------------

    @tf.autograph.experimental.do_not_convert
    def train_step(self, data):
        """Runs the micro-batch's forward pass and keeps it; ends a full window."""
        model = self.model
        x, y, sample_weight = _keras.unpack_x_y_sample_weight(data)
        if self._seed_states is None:
            self._seed_states = _keras.seed_states(model)
        seeds = [tf.convert_to_tensor(state) for state in self._seed_states]  # before it draws
        y_pred = self._forward(x)
        if model.losses:
            raise StepError(
                f"Model {model.name!r} adds losses of its own (`model.losses`: "
                "weight or activity regularizers, `add_loss`), which a window-wide "
                "loss does not take yet: the window's loss would miss them. Remove "
                "the regularizers, or compile with an ordinary loss.")
        samples = count_samples(data)
        parts = dict(x=x, y=y, sample_weight=sample_weight, y_pred=y_pred, seeds=seeds)
        if self.buffers is None:
            self.buffers = WindowBuffers(parts)
        self.buffers.append(parts, samples)
        counts = self.state.counts
        counts.add(counts.delta(micro_steps=1, window_micro_batches=1, window_samples=samples,
                                window_items=samples, samples=samples, items=samples))
        applied = tf.cond(self.state.is_full(), self.end_window, lambda: tf.constant(False))
        _keras.keep_as_function_call(applied)
        with tf.control_dependencies([applied]):
            return tf.nest.map_structure(tf.identity, _keras.metrics_result(model))

    def _forward(self, x):
        if getattr(self.model, "_call_has_training_arg", True):
            return self.model(x, training=True)
        return self.model(x)

    # -- the window's end ----------------------------------------------------------

    def end_window(self, window=None, **extra_counts):
        """Applies the window (never empty here: `flush()` reads it first), then resets."""
        return self.apply_window(self.state.local(), **extra_counts)

    def apply_window(self, window, **extra_counts):
        model, optimizer = self.model, self._optimizer
        counts = dict(self.state.counts.read())
        parts, seeds, sizes = self.buffers.read()
        outputs = parts["y_pred"]
        with tf.GradientTape() as tape:
            tape.watch(tf.nest.flatten(outputs))
            loss = _keras.window_loss(model, parts["y"], outputs, parts["sample_weight"])
            scaled = _keras.scaled_loss(optimizer, loss)
        output_grads = tape.gradient(scaled, outputs)
        variables = list(model.trainable_variables)
        self._replay(output_grads, seeds, sizes, variables)
        grads = self.state.accumulators.gradients()
        gradient_scale = self._api.loss_scale(optimizer)  # before the update
        self.applier(grads, self.state.variables, False)
        update = Update(
            grads=grads, variables=self.state.variables, gradient_scale=gradient_scale,
            window=window, counts=counts, iterations=_keras.iterations(optimizer),
            loss=tf.cast(loss, tf.float64), name_prefix=model.name + "/")
        for observer in self.observers:
            observer.on_apply(update)
        self._reset(window, window, optimizer_steps=1, **extra_counts)
        return tf.constant(True)

    def _replay(self, output_grads, seeds, sizes, variables):
        """Runs each micro-batch's forward pass again, back-propagating its cached slice."""
        window = self.state.accumulators
        states = self._seed_states
        now = [tf.convert_to_tensor(state) for state in states]
        starts = tf.cumsum(sizes, exclusive=True)

        def body(i):
            for state, held in zip(states, seeds):
                state.assign(held[i])
            rows = slice(starts[i], starts[i] + sizes[i])
            x = self.buffers.inputs(starts[i], starts[i] + sizes[i])
            cached = tf.nest.flatten(tf.nest.map_structure(
                lambda g: None if g is None else g[rows], output_grads))
            with tf.GradientTape() as tape:
                outputs = tf.nest.flatten(self._forward(x))
                surrogate = tf.add_n([
                    tf.reduce_sum(tf.cast(output * tf.cast(grad, output.dtype), tf.float32))
                    for output, grad in zip(outputs, cached) if grad is not None])
            grads = tape.gradient(surrogate, variables)
            window.track(grads, variables)
            window.add(grads, variables)
            return (i + 1,)

        n = tf.size(sizes)
        tf.while_loop(lambda i: i < n, body, (tf.constant(0),))
        for state, value in zip(states, now):  # the draws go on from where they were
            state.assign(value)

    def _reset(self, local, window, **extra_counts):
        super()._reset(local, window, **extra_counts)
        self.buffers.clear()
