"""The training step the hosts run, as one function: the hosts' loop (`host/loop.py`) jits
it on their live state, and the planner compiles the same jit ahead of time from abstract
state (`jax.ShapeDtypeStruct`s with the layout's shardings, as MaxText's train_compile
does), so that what the plan measures is what the hosts run.

One call is a micro-step: Keras' own `train_step` on one micro-batch, the loss summed into a
small carry (with the first non-finite step), the metrics accumulated. The state (trainable,
non-trainable and optimizer values) is donated and updated in place; the metrics and the
carry are not (see `CompiledStep`).
"""

from __future__ import annotations

from dataclasses import dataclass

from training import keras_compat


@dataclass(frozen=True)
class CompiledMemory:
    """What XLA's `memory_analysis()` of the compiled step says one device holds: its
    arguments (weights, optimizer and metric state, the batch; the state is donated and
    updated in place) and the temporaries it allocates while it runs; `needed`: what the
    step needs of a device, with the next batch the hosts' prefetcher places meanwhile."""

    arguments: int
    temporaries: int
    needed: int

    @property
    def peak(self) -> int:
        return self.arguments + self.temporaries


def state_variables(model) -> tuple[list, list, list]:
    """The variables the step takes as its state, in its order."""
    return (
        list(model.trainable_variables),
        list(model.non_trainable_variables),
        list(model.optimizer.variables),
    )


def jitted_micro_step(model, accumulate: int, state_shardings, replicated):
    """The jitted micro-step of `model`: (state, metrics, carry, batch) -> (state, metrics,
    carry), the state donated and kept in `state_shardings`."""
    import jax

    tracked = {id(v) for v in keras_compat.loss_tracker(model).variables}
    # Keras' loss tracker (a mean since its last reset) starts each micro-step afresh, so
    # the step's logged "loss" is that micro-batch's; the carry sums them.
    loss_slots = [i for i, v in enumerate(model.metrics_variables) if id(v) in tracked]

    def micro_step(state, metrics, carry, data):
        import jax.numpy as jnp

        metrics = [
            jnp.zeros_like(value) if i in loss_slots else value for i, value in enumerate(metrics)
        ]
        logs, (trainable, non_trainable, optimizer, metrics) = model.train_step(
            (*state, metrics), data
        )
        carry = add_loss(carry, logs["loss"], accumulate)
        return (trainable, non_trainable, optimizer), metrics, carry

    # The carry (two small arrays) is not donated, so that the hosts' loop can wait on an
    # older one; nor are the metrics (their fresh states serve every interval).
    return jax.jit(
        micro_step, donate_argnums=0, out_shardings=(state_shardings, replicated, replicated)
    )


def compile_ahead(model, accumulate: int, batch):
    """The model's micro-step compiled from abstract arguments: each variable as its shape,
    dtype and the sharding its layout gives it under the distribution set, and `batch` (a
    pytree of `jax.ShapeDtypeStruct`s). The model's variables may hold no values."""
    import jax

    state, metrics, carry, batch = abstract_arguments(model, batch)
    shardings = jax.tree.map(lambda a: a.sharding, state)
    step = jitted_micro_step(model, accumulate, shardings, replicated_sharding())
    return step.lower(state, metrics, carry, batch).compile()


def abstract_arguments(model, batch) -> tuple:
    """The micro-step's arguments as `jax.ShapeDtypeStruct`s: the state, the metrics, the
    carry and `batch` (already abstract)."""
    import jax

    replicated = replicated_sharding()
    state = jax.tree.map(abstract, state_variables(model))
    metrics = [abstract(v) for v in model.metrics_variables]
    carry = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated),
        jax.eval_shape(lambda: initial_carry(0)),
    )
    return state, metrics, carry, batch


def abstract(variable):
    """A variable as the step's argument: its shape and dtype, with its layout's sharding."""
    import jax

    return jax.ShapeDtypeStruct(
        tuple(variable.shape), variable.dtype, sharding=keras_compat.variable_sharding(variable)
    )


def abstract_batch(batch):
    """A batch of host arrays (the global micro-batch) as the step's argument, laid out as
    the hosts place their batches."""
    import jax

    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(
            a.shape, jax.dtypes.canonicalize_dtype(a.dtype), sharding=data_sharding(a.shape)
        ),
        batch,
    )


def data_sharding(shape: tuple[int, ...]):
    """The sharding Keras gives an input batch of this shape (its `_distribute_data`)."""
    import jax
    from keras import distribution

    current = distribution.distribution()
    if current is None:
        return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return current.get_data_layout(shape).backend_layout


def replicated_sharding():
    """Whole on every device of the distribution's mesh; None without a distribution."""
    from jax.sharding import NamedSharding, PartitionSpec
    from keras import distribution

    current = distribution.distribution()
    if current is None:
        return None
    return NamedSharding(current.device_mesh.backend_mesh, PartitionSpec())


def compiled_memory(compiled, batch_bytes: int) -> CompiledMemory:
    """What `memory_analysis()` of the compiled step says a device holds and needs: its own
    peak as XLA reports it (or its arguments, temporaries and the outputs not updated in
    place), and the next batch (`batch_bytes` per device)."""
    analysis = compiled.memory_analysis()
    laid_out = (
        analysis.argument_size_in_bytes
        + analysis.temp_size_in_bytes
        + analysis.output_size_in_bytes
        - analysis.alias_size_in_bytes
        + analysis.generated_code_size_in_bytes
    )
    peak = int(getattr(analysis, "peak_memory_in_bytes", 0) or 0)
    return CompiledMemory(
        analysis.argument_size_in_bytes,
        analysis.temp_size_in_bytes,
        max(peak, laid_out) + batch_bytes,
    )


def shard_bytes(arrays) -> int:
    """What one device holds of these arrays or `jax.ShapeDtypeStruct`s (the largest
    share, where shares differ)."""
    import math

    import jax
    import numpy as np

    def largest_share(a) -> int:
        shape = a.sharding.shard_shape(a.shape) if a.sharding is not None else a.shape
        return math.prod(shape) * np.dtype(a.dtype).itemsize

    return sum(largest_share(a) for a in jax.tree.leaves(arrays))


FLOATS, COUNTS = 0, 1  # the carry's two arrays


def initial_carry(micro_done: int):
    import jax.numpy as jnp

    return (
        jnp.asarray([0.0, jnp.nan], jnp.float32),  # loss sum, first bad step's loss
        jnp.asarray([micro_done, -1], jnp.int32),  # micro-batches done, first bad step
    )


def add_loss(carry, loss, accumulate: int):
    """The carry after one micro-batch of loss `loss`: summed, counted, checked."""
    import jax.numpy as jnp

    (loss_sum, bad_loss), (micro, bad_step) = carry
    loss = loss.astype(jnp.float32)
    step = micro // accumulate + 1  # the optimizer step (1-based) this micro-batch is in
    first = (bad_step < 0) & ~jnp.isfinite(loss)
    return (
        jnp.stack([loss_sum + loss, jnp.where(first, loss, bad_loss)]),
        jnp.stack([micro + 1, jnp.where(first, step, bad_step)]),
    )
