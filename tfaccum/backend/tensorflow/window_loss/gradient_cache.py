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
at a time, with the window's inputs and outputs. Cost: one more forward pass
per sample. With several replicas of one machine the window's outputs are
gathered across them once per window. `CachingStep` is the micro-step,
`CachedGradients` the source the window's end asks for its gradients.
"""

import re

import tensorflow as tf

from tfaccum.backend.tensorflow import _keras_on_tf
from tfaccum.backend.tensorflow.devices import for_model
from tfaccum.backend.tensorflow.devices import variable_options
from tfaccum.backend.tensorflow.step import count_samples
from tfaccum.backend.tensorflow.step import StepError


class _Buffer:
    """One variable of a window's rows, held along its first axis.

    Rows are written in place (a scatter into the rows the window reached),
    into a variable that grows, doubling, to the largest window seen: a
    window's rows are not copied at each micro-step. `WindowBuffers` says
    how many rows are the window's. A buffer never shrinks: TensorFlow's
    graph optimizer (2.16-2.21) answers the size of a read made before a
    variable's shape changes, in the same function, with the size after it.
    """

    def __init__(self, spec, name, strategy):
        self.element_shape = spec.shape[1:]
        self.dtype = spec.dtype
        dims = [0] + self.element_shape.as_list()  # fully defined (the step checks)
        # With several replicas each keeps its own rows (written by handle).
        synchronization, aggregation = variable_options(strategy)
        options = dict(trainable=False, synchronization=synchronization, aggregation=aggregation)
        with tf.init_scope(), strategy.scope():
            self.variable = tf.Variable(
                tf.zeros(dims, self.dtype), name=name,
                shape=tf.TensorShape([None]).concatenate(self.element_shape), **options)
            self.capacity = tf.Variable(tf.zeros((), tf.int64), name=name + "_capacity",
                                        **options)

    def append(self, held, rows):
        """Keeps `rows` after the first `held` rows."""
        rows = tf.cast(rows, self.dtype)
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
            tf.raw_ops.ResourceScatterNdUpdate(
                ref=self.variable.handle, indices=tf.range(held, need)[:, None], updates=rows)

    def read(self, held, variable=None):
        """The first `held` rows (of `variable`: one replica's, cross-replica)."""
        return (self.variable if variable is None else variable).read_value()[:held]

    def gather(self, start, stop):
        """Rows `start` to `stop`, gathered (this replica's)."""
        rows = tf.raw_ops.ResourceGather(resource=self.variable.handle,
                                         indices=tf.range(start, stop), dtype=self.dtype)
        return tf.ensure_shape(rows, tf.TensorShape([None]).concatenate(self.element_shape))


class WindowBuffers:
    """What a window keeps of its micro-batches until it ends.

    A structure of tensors per micro-batch (`append`): its per-sample parts
    are concatenated along the batch axis; `seeds` (one state per seed
    generator) are kept one row per micro-batch, with the micro-batch sizes.
    Made at the first trace, from what the step gives.
    """

    def __init__(self, parts, strategy):
        self._structure = _kept(parts)
        flat = tf.nest.flatten(self._structure)
        self._buffers = [_Buffer(tf.TensorSpec.from_tensor(t), f"window_{i}", strategy)
                         for i, t in enumerate(flat)]
        self._seeds = [_Buffer(tf.TensorSpec([None] + s.shape.as_list(), s.dtype),
                               "window_seed", strategy) for s in parts["seeds"]]
        self._sizes = _Buffer(tf.TensorSpec([None], tf.int64), "window_sizes", strategy)
        self._strategy = strategy
        # Which buffers hold the inputs `x` (read a micro-batch at a time).
        self._is_input = tf.nest.flatten({
            name: tf.nest.map_structure(lambda _: name == "x", value)
            for name, value in self._structure.items()})
        synchronization, aggregation = variable_options(strategy)
        with tf.init_scope(), strategy.scope():
            # The window's rows (samples) and micro-batches held (this replica's).
            self.held = tf.Variable(tf.zeros((2,), tf.int64), trainable=False,
                                    name="window_held", synchronization=synchronization,
                                    aggregation=aggregation)

    def check(self, parts, model_name):
        """Raises `StepError` if a step's parts are not laid out as the buffers'."""
        structure = _kept(parts)
        try:
            tf.nest.assert_same_structure(structure, self._structure)
        except (ValueError, TypeError):
            raise StepError(
                f"Model {model_name!r} was traced again with micro-batches laid out "
                "differently (e.g. sample weights or class weights in one `fit` and not "
                "in another) while its window-wide loss kept the first layout. Received: "
                f"{sorted(structure)}, kept: {sorted(self._structure)}. Fit it with one "
                "layout, or install a new hook.") from None
        for buffer, value in zip(self._buffers, tf.nest.flatten(structure)):
            if not buffer.element_shape.is_compatible_with(value.shape[1:]):
                raise StepError(
                    f"Model {model_name!r} was traced again with a per-sample shape "
                    f"{value.shape[1:]} where its window-wide loss kept "
                    f"{buffer.element_shape}. Fit it with one shape per sample.")

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

    def _parts(self, flat):
        """`{x, y, sample_weight, y_pred}` from one value per buffer (`x` left out)."""
        parts = dict.fromkeys(("x", "y", "sample_weight", "y_pred"))
        parts.update(tf.nest.pack_sequence_as(self._structure, flat))
        parts["x"] = None
        return parts

    def read(self):
        """`(parts, rows)`: the window's parts as the step gave them, but its inputs,
        and its rows (one device's: `read_replicas`' layout).

        The inputs are read a micro-batch at a time (`inputs`).
        """
        held = self.held.read_value()
        parts = self._parts([None if is_input else b.read(held[0])
                             for b, is_input in zip(self._buffers, self._is_input)])
        return parts, held[:1]

    def micro_batches(self):
        """`(seeds, sizes)`: each kept micro-batch's seed states and samples (this replica's)."""
        held = self.held.read_value()
        return [b.read(held[1]) for b in self._seeds], self._sizes.read(held[1])

    def read_replicas(self):
        """Cross-replica: the parts of `read()` over every replica's rows, replica after
        replica, and each replica's rows (one machine's replicas)."""
        strategy = self._strategy
        helds = [h.read_value() for h in strategy.experimental_local_results(self.held)]

        def gathered(buffer):
            components = strategy.experimental_local_results(buffer.variable)
            return tf.concat([buffer.read(held[0], component)
                              for held, component in zip(helds, components)], 0)

        parts = self._parts([None if is_input else gathered(b)
                             for b, is_input in zip(self._buffers, self._is_input)])
        return parts, tf.stack([held[0] for held in helds])

    def inputs(self, start, stop):
        """The inputs `x` of rows `start` to `stop`, gathered.

        Gathered rows, not a slice of a read: a variable written by rows
        (scatter) copies itself whole on every read (TensorFlow's
        copy-on-read mode), which would hold the window's inputs twice.
        """
        flat = [b.gather(start, stop) if is_input else None
                for b, is_input in zip(self._buffers, self._is_input)]
        return tf.nest.pack_sequence_as(self._structure, flat)["x"]

    def clear(self):
        self.held.assign(tf.zeros((2,), tf.int64))


def _kept(parts):
    """What a window keeps per sample: the step's parts but seeds, and none that is `None`."""
    return {name: value for name, value in parts.items()
            if name != "seeds" and value is not None}


# TensorFlow's stateful random ops: a second forward pass draws other numbers.
_STATEFUL_RANDOM = frozenset((
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal", "TruncatedNormal",
    "ParameterizedTruncatedNormal", "RandomShuffle", "RandomGamma", "RandomPoisson",
    "RandomPoissonV2", "Multinomial", "RandomCrop", "StatefulUniform", "StatefulUniformInt",
    "StatefulUniformFullInt", "StatefulStandardNormal", "StatefulStandardNormalV2",
    "StatefulTruncatedNormal", "StatefulRandomBinomial",
    # `tf.random.Generator` moves its state by these, then draws statelessly.
    "RngReadAndSkip", "RngSkip"))


def unreplayable_random_ops(operations):
    """`(type, name)` of each stateful random op among `operations`, at any depth.

    Looks into the functions they call (`tf.cond` and `tf.while_loop`
    branches, nested `tf.function`s) through the graph's function library.
    """
    operations = list(operations)
    if not operations:
        return []
    library = {f.signature.name: f for f in
               operations[0].graph.as_graph_def().library.function}
    found, seen = [], set()

    def visit(node, path):
        if node.op in _STATEFUL_RANDOM:
            found.append((node.op, path))
        for value in node.attr.values():
            names = [value.func.name] + [f.name for f in value.list.func]
            for name in names:
                if name in library and name not in seen:
                    seen.add(name)
                    for inner in library[name].node_def:
                        visit(inner, f"{path}/{inner.name}")

    for operation in operations:
        visit(operation.node_def, operation.name)
    return found


def _layer_of(op_name, model):
    """The innermost of `model`'s layers named in `op_name`'s scopes (or the model)."""
    names = {layer.name for layer in _keras_on_tf.flatten_layers(model)}
    # A scope entered again while tracing gets a suffix (`noise_1`).
    scopes = [scope if scope in names else re.sub(r"_\d+$", "", scope)
              for scope in op_name.split("/")]
    scopes = [scope for scope in scopes if scope in names]
    return scopes[-1] if scopes else model.name


class CachingStep:
    """The train step of a model compiled with a `WindowLoss`: keep the forward pass.

    Takes the place of the hook's step tracer (the model's `train_step` is
    Keras' own, run here in two halves): each micro-step runs the forward pass
    and keeps it in the window's `WindowBuffers`; a full window ends through
    the devices' window end, whose source is a `CachedGradients`.

    Args:
        model: The compiled model (its loss a `WindowLoss`).
        state: The hook's `WindowState` (accumulators and counts).
        observers: The hook's `WindowObserver`s.
    """

    def __init__(self, model, state, observers):
        self.model = model
        self.state = state
        self.cache = CachedGradients(model, state)
        api, optimizer = _keras_on_tf.api_for(model), model.optimizer

        def apply_gradients(grads, variables, reduced=False):  # no patch is active here
            api.apply(getattr(optimizer, api.apply_method), grads, variables, reduced)

        # Nothing is left out: under a LossScaleOptimizer the optimizer skips a
        # non-finite window, as the large batch's step.
        self.devices = for_model(
            model, state, apply_gradients, observers, skip_nonfinite=False, source=self.cache)

    @tf.autograph.experimental.do_not_convert
    def train_step(self, data):
        """Runs the micro-batch's forward pass and keeps it; ends a full window."""
        model, cache = self.model, self.cache
        x, y, sample_weight = _keras_on_tf.unpack_x_y_sample_weight(data)
        cache.find_seed_states()
        seeds = [tf.convert_to_tensor(state) for state in cache.seed_states]  # before it draws
        graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        first = 0 if graph is None else len(graph.get_operations())
        y_pred = cache.forward(x)
        forward = None if graph is None else graph.get_operations()[first:]
        self._check_traced(x, y_pred, forward)
        samples = count_samples(data)
        parts = dict(x=x, y=y, sample_weight=sample_weight, y_pred=y_pred, seeds=seeds)
        if cache.buffers is None:
            self.devices.create(lambda *_: cache.make_buffers(parts))
        cache.buffers.check(parts, model.name)
        cache.buffers.append(parts, samples)
        counts = self.state.counts
        totals = (dict(samples=samples, items=samples)
                  if self.devices.totals_per_micro_batch else {})
        counts.add(counts.delta(micro_steps=1, window_micro_batches=1, window_samples=samples,
                                window_items=samples, **totals))
        self.devices.after_micro_step()  # ends a full window
        return _keras_on_tf.metrics_result(model)

    def _check_traced(self, x, y_pred, forward):
        """Raises `StepError` for what the step shows it cannot replay or keep.

        `forward`: the operations the forward pass made while it traced
        (`None` when run eagerly).
        """
        model, cache = self.model, self.cache
        if model.losses:
            raise StepError(
                f"Model {model.name!r} adds losses of its own (`model.losses`: "
                "weight or activity regularizers, `add_loss`), which a window-wide "
                "loss does not take yet: the window's loss would miss them. Remove "
                "the regularizers, or compile with an ordinary loss.")
        if len(_keras_on_tf.api_for(model).seed_states(model)) != cache.layer_seeds:
            raise StepError(
                f"Model {model.name!r} made seed generators in its first step (it was "
                "built by it): their dropout masks could not be drawn again. Build the "
                "model before `fit` (call it once on a batch, or give it an `Input`).")
        if forward is None:  # run eagerly: the first step's forward pass, traced apart
            forward = self._traced_forward(x) if cache.buffers is None else []
        drawn = unreplayable_random_ops(forward)
        if drawn:
            op_type, op_name = drawn[0]
            layer = _layer_of(op_name, model)
            raise StepError(
                f"Model {model.name!r} draws random numbers that the second forward pass "
                "of its window-wide loss cannot draw again: a stateful TensorFlow random "
                f"op ({op_type}, {op_name!r}) in layer {layer!r}"
                f"{f' and {len(drawn) - 1} more' if len(drawn) > 1 else ''}. The window's "
                "gradients would flow through other draws than the ones its loss saw. Draw "
                "them from a Keras seed generator, which tfaccum replays: a seeded layer "
                "(`keras.layers.GaussianNoise(stddev, seed=...)`, `Dropout(rate, "
                "seed=...)`) or `keras.random.normal(shape, seed=self.seed_generator)` "
                "with a `keras.random.SeedGenerator` made in the layer's `__init__`.")
        masked = [_keras_on_tf.keras_mask(output) is not None for output in tf.nest.flatten(y_pred)]
        if any(masked):
            raise StepError(
                f"Model {model.name!r} has an output with a Keras mask, which a window-wide "
                "loss does not keep for the window's loss yet: the loss would be computed "
                "unmasked. Compile the masked output with an ordinary loss.")
        for leaf in tf.nest.flatten(x):
            if leaf is not None and not leaf.shape[1:].is_fully_defined():
                raise StepError(
                    f"A window-wide loss keeps the window's inputs, which must have a fixed "
                    f"shape per sample. Received: an input of shape {leaf.shape} for model "
                    f"{model.name!r}. Pad them to one length (e.g. `padded_batch` with "
                    "`padded_shapes`, or `keras.utils.pad_sequences(maxlen=...)`).")

    def _traced_forward(self, x):
        """The operations of the forward pass, traced apart (a step run eagerly)."""
        specs = tf.nest.map_structure(tf.TensorSpec.from_tensor, x)
        function = tf.function(self.cache.forward, autograph=False)
        return function.get_concrete_function(specs).graph.get_operations()


class CachedGradients:
    """A window's gradients from its window-wide loss: the source its end asks.

    Once per window (`prepare`; with several replicas of one machine, in the
    cross-replica context) every replica's kept outputs are read, the loss is
    computed over the global window (replica after replica, as CLIP gathers
    its negatives: a window-wide loss must not depend on the order of its
    samples) and its gradient with respect to the outputs is taken. Then
    each replica replays its own micro-batches with its rows of that
    gradient (`gradients`); the replicas' sums are all-reduced once and
    applied.

    Args:
        model: The compiled model (its loss a `WindowLoss`).
        state: The hook's `WindowState`.
    """

    divides = False  # the window's loss is already the large batch's mean
    may_skip = True  # a LossScaleOptimizer skips a non-finite window

    def __init__(self, model, state):
        self.model = model
        self.state = state
        self.strategy = model.distribute_strategy
        self.buffers = None
        self.seed_states = None
        self.layer_seeds = None

    @property
    def traced(self):
        return self.buffers is not None

    def find_seed_states(self):
        """The seed states the forward pass draws from (found at the first step)."""
        if self.seed_states is not None:
            return
        model, api = self.model, _keras_on_tf.api_for(self.model)
        self.seed_states = api.seed_states(model)
        self.layer_seeds = len(self.seed_states)
        with tf.init_scope():  # made eagerly, not by the step that traces
            self.seed_states += api.global_seed_states()

    def make_buffers(self, parts):
        if self.buffers is None:  # (another replica's thread may have made them)
            self.buffers = WindowBuffers(parts, self.strategy)

    def forward(self, x):
        return _keras_on_tf.training_forward(self.model, x)

    def prepare(self, window):
        """The window's loss, its gradient w.r.t. every replica's outputs, and where
        each replica's rows start."""
        if self.strategy.num_replicas_in_sync > 1:
            parts, rows = self.buffers.read_replicas()
        else:
            parts, rows = self.buffers.read()
        loss, output_grads = self._window_gradient(parts)
        return loss, output_grads, tf.cumsum(rows, exclusive=True)

    def gradients(self, prepared, window, denominator):
        """Replays this replica's micro-batches; the accumulators' sum (not divided)."""
        loss, output_grads, starts = prepared
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        seeds, sizes = self.buffers.micro_batches()
        start = starts[replica]
        stop = start + tf.reduce_sum(sizes)
        mine = tf.nest.map_structure(lambda g: None if g is None else g[start:stop],
                                     output_grads)
        self._replay(mine, seeds, sizes, list(self.model.trainable_variables))
        samples = self.state.local()["window_samples"]
        _keras_on_tf.api_for(self.model).track_loss(self.model, loss, samples)
        return self.state.accumulators.gradients()

    def loss(self, prepared, window):
        return tf.cast(prepared[0], tf.float64)

    def reset(self):
        if self.buffers is not None:
            self.buffers.clear()

    def _window_gradient(self, parts):
        """The window's loss (as the large batch's step reports it) and its
        gradient with respect to the window's outputs, loss-scaled."""
        model = self.model
        outputs = parts["y_pred"]
        with tf.GradientTape() as tape:
            tape.watch(tf.nest.flatten(outputs))
            # Keras divides a loss by the replicas (each replica's share of a
            # batch): this one is the whole window's.
            loss = _keras_on_tf.api_for(model).compiled_loss(model, parts["y"], outputs,
                                                             parts["sample_weight"])
            loss = loss / tf.cast(self.state.loss_share, loss.dtype)
            scaled = _keras_on_tf.scaled_loss(model.optimizer, loss)
        return loss, tape.gradient(scaled, outputs)

    def _replay(self, output_grads, seeds, sizes, variables):
        """Runs each micro-batch's forward pass again, back-propagating its cached slice."""
        window = self.state.accumulators
        states = self.seed_states
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
                outputs = tf.nest.flatten(self.forward(x))
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
