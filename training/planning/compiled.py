"""What the hosts' training step (`training.step`) really does on this process's devices, as
the compiler makes it: the bytes each device holds (XLA's `memory_analysis()`) and the
collectives in its HLO. `training.plan` and `strategy=auto` compile it ahead of time from
abstract state (`compile_ahead_of_time`); the benchmarks and tests also read what a live
build's variables hold (`measure_step`)."""

from __future__ import annotations

from dataclasses import dataclass

from training import step
from training.config import ConfigError, RunConfig
from training.device_memory import out_of_memory_explained
from training.parallel.mesh import MeshShape, device_grid, settled
from training.parallel.strategy import Strategy
from training.planning import collectives
from training.planning.target import target_devices
from training.step import CompiledMemory


@dataclass(frozen=True)
class Compiled:
    """The hosts' step as the compiler makes it: what a device holds and the collectives in
    its HLO."""

    memory: CompiledMemory
    collectives: list[collectives.Collective]
    device_kind: str  # of the devices it was compiled for ("TPU v5 lite", "cpu")

    @property
    def sent_bytes(self) -> float:
        return collectives.sent_bytes(self.collectives)


@dataclass(frozen=True)
class Measured(Compiled):
    """... and what the live arrays of a model built on the devices hold per device."""

    parameter_bytes_per_device: int = 0
    optimizer_bytes_per_device: int = 0


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

    return build_on_grid(as_hosts_get_it(cfg, mesh), _grid(jax.devices(), mesh))


def compile_ahead_of_time(cfg: RunConfig, mesh: MeshShape) -> Compiled:
    """The hosts' step for `mesh` compiled from abstract state for the devices of the run's
    compile target (`training.planning.target`: a TPU slice's, this machine's): the model
    built as the hosts build it but without weights, so that a model whose weights do not
    fit this machine compiles as quickly as a small one. Keras' distribution and dtype policy
    are left as they were."""
    import keras

    from training import keras_compat, models
    from training.build import build_on_grid

    settled = as_hosts_get_it(cfg, mesh)
    distribution, policy = keras.distribution.distribution(), keras.config.dtype_policy()
    # Fresh layer names, so that the variables' paths are a host's (the rules match them).
    keras_compat.reset_layer_names()
    try:
        with models.without_weights():
            grid = _grid(target_devices(cfg), mesh)
            model, dataset = build_on_grid(settled, grid)
        return _compiled(model, dataset, cfg, mesh)
    finally:
        keras.distribution.set_distribution(distribution)
        keras.config.set_dtype_policy(policy)


def measure_step(cfg: RunConfig, mesh: MeshShape) -> Measured:
    """Build the model on this process's devices, as the hosts do, and compile the hosts'
    step for it: what its live arrays and the compiled step hold per device, and the step's
    collectives."""
    model, dataset = built_as_hosts_build(cfg, mesh)
    compiled = _compiled(model, dataset, cfg, mesh)
    return Measured(
        compiled.memory,
        compiled.collectives,
        compiled.device_kind,
        _shard_bytes(model.variables),
        _shard_bytes(model.optimizer.variables),
    )


def _compiled(model, dataset, cfg: RunConfig, mesh: MeshShape) -> Compiled:
    rows = cfg.trainer.micro_batch
    batch = step.abstract_batch(dataset.batch("train", 0, rows, slice(0, rows)))

    def held() -> int:  # what a refusal naming the temporaries alone leaves out
        return step.shard_bytes(step.abstract_arguments(model, batch))

    # An accelerator's compiler refuses a step over its memory: OutOfDeviceMemory.
    device = _device_kind()
    with out_of_memory_explained("by the compiler", held, device):
        compiled = step.compile_ahead(model, cfg.trainer.accumulate, batch)
    return Compiled(
        step.compiled_memory(compiled, step.shard_bytes(batch)),
        collectives.from_hlo(compiled.as_text(), mesh.devices),
        device,
    )


def _device_kind() -> str:
    """The kind of the devices of the distribution the model was built under."""
    from keras import distribution

    return distribution.distribution().device_mesh.devices.flat[0].device_kind


def _grid(devices: list, mesh: MeshShape):
    if len(devices) < mesh.devices:
        raise ConfigError(
            f"compiling the step for mesh {mesh.data}×{mesh.model} needs {mesh.devices} devices; "
            f"this process's JAX holds {len(devices)} {devices[0].platform} device(s) (started "
            "before the plan with other settings: run it in a fresh process)"
        )
    return device_grid(devices[: mesh.devices], mesh)


def train_step_hlo(model, x, y) -> str:
    """The optimized HLO of the hosts' step for the model."""
    return compiled_train_step(model, x, y).as_text()


def compiled_train_step(model, x, y):
    """The hosts' step for a compiled model, compiled for batches like (x, y) (its state
    sharded as its variables are, and donated)."""
    return step.compile_ahead(model, 1, step.abstract_batch((x, y)))


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
