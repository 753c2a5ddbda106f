"""What a compiled training step really does on this process's devices: the collectives in
its HLO and the bytes its live variables hold per device. The benchmarks and the tests that
check `training.plan` against reality read these."""

from __future__ import annotations

from dataclasses import dataclass

from training.config import RunConfig
from training.parallel.mesh import MeshShape, device_grid, settled
from training.parallel.strategy import Strategy
from training.planning import collectives


@dataclass(frozen=True)
class CompiledMemory:
    """What XLA's `memory_analysis()` of the compiled step says one device holds: its
    arguments (weights, optimizer and metric state, the batch; the state is donated and
    updated in place) and the temporaries it allocates while it runs."""

    arguments: int
    temporaries: int

    @property
    def peak(self) -> int:
        return self.arguments + self.temporaries


@dataclass(frozen=True)
class Measured:
    collectives: list[collectives.Collective]
    parameter_bytes_per_device: int
    optimizer_bytes_per_device: int
    memory: CompiledMemory

    @property
    def sent_bytes(self) -> float:
        return collectives.sent_bytes(self.collectives)


def as_hosts_get_it(cfg: RunConfig, mesh: MeshShape) -> RunConfig:
    """The config with the layout rules the driver settles for `mesh`, as the hosts get it."""
    strategy = Strategy.of(cfg.strategy)
    if strategy.replicates:
        return cfg
    # Imported here: keras, which CompiledMemory's reader (host/loop.py) need not import.
    from training.data import build_dataset
    from training.planning.abstract import ModelKey
    from training.planning.layout import resolve_layout

    model = ModelKey.of(cfg, build_dataset(cfg.data).spec)
    return settled(cfg, resolve_layout(strategy, mesh, model).rules)


def built_as_hosts_build(cfg: RunConfig, mesh: MeshShape):
    """The model and dataset as the hosts build them for `mesh`, on this process's first
    devices."""
    import jax

    from training.build import build_on_grid

    return build_on_grid(
        as_hosts_get_it(cfg, mesh), device_grid(jax.devices()[: mesh.devices], mesh)
    )


def measure_step(cfg: RunConfig, mesh: MeshShape) -> Measured:
    """Build the model on this process's devices, take one training step (which creates the
    optimizer's variables), then compile the step as Keras does and read its collectives."""
    model, dataset = built_as_hosts_build(cfg, mesh)
    batch = cfg.trainer.micro_batch
    x, y = dataset.batch("train", 0, batch, slice(0, batch))
    step = compiled_train_step(model, x, y)
    analysis = step.memory_analysis()
    return Measured(
        collectives.from_hlo(step.as_text(), mesh.devices),
        _shard_bytes(model.variables),
        _shard_bytes(model.optimizer.variables),
        CompiledMemory(analysis.argument_size_in_bytes, analysis.temp_size_in_bytes),
    )


def train_step_hlo(model, x, y) -> str:
    """The optimized HLO of the model's train step."""
    return compiled_train_step(model, x, y).as_text()


def compiled_train_step(model, x, y):
    """The model's train step compiled as Keras's own `make_train_function` compiles it: the
    state sharded as the live variables are, and donated."""
    import jax

    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables],
        [v.value for v in model.metrics_variables],
    )
    shardings = jax.tree.map(lambda value: value.sharding, state)
    step = jax.jit(model.train_step, out_shardings=(None, shardings), donate_argnums=0)
    return step.lower(state, _as_keras_places((x, y))).compile()


def _as_keras_places(batch):
    """The batch's arrays laid out as Keras lays out an input batch: its distribution's data
    layout."""
    import jax
    import keras

    distribution = keras.distribution.distribution()
    if distribution is None:
        return jax.device_put(batch)
    return jax.tree.map(
        lambda a: jax.device_put(a, distribution.get_data_layout(a.shape).backend_layout), batch
    )


def _shard_bytes(variables) -> int:
    from training.build import describe_variables

    return sum(v["shard_bytes"] for v in describe_variables(variables).values())


def held_bytes(arrays) -> int:
    """Bytes of this process's device buffers that `arrays` hold, each buffer once (arrays
    made from per-device arrays share their buffers)."""
    buffers = {
        (shard.device.id, shard.data.unsafe_buffer_pointer()): shard.data.nbytes
        for array in arrays
        for shard in array.addressable_shards
    }
    return sum(buffers.values())
