"""What a compiled training step really does on this process's devices: the collectives in
its HLO and the bytes its live variables hold per device. The benchmarks and the tests that
check `training.plan` against reality read these."""

from __future__ import annotations

from dataclasses import dataclass

from training.config import RunConfig
from training.parallel import collectives
from training.parallel.auto_layout import derive_for_config, settled, uses_auto_layout
from training.parallel.mesh import MeshShape, device_grid

# The benchmarks' model: a small transformer that compiles and steps quickly on CPU devices
# (8 heads, so that model parallelism can split it 8 ways).
BENCH_TRANSFORMER = [
    "model=transformer",
    "data=text",
    "model.kwargs.layers=2",
    "model.kwargs.d_model=64",
    "model.kwargs.heads=8",
    "model.kwargs.d_ff=256",
    "model.seq_len=32",
]


@dataclass(frozen=True)
class Measured:
    collectives: list[collectives.Collective]
    parameter_bytes_per_device: int
    optimizer_bytes_per_device: int

    @property
    def sent_bytes(self) -> float:
        return collectives.sent_bytes(self.collectives)


def measure_step(cfg: RunConfig, mesh: MeshShape) -> Measured:
    """Build the model on this process's devices, take one training step (which creates the
    optimizer's variables), then compile the step as Keras does and read its collectives."""
    import jax

    # Imported here: keras, which the benchmarks' constants above need not import.
    from training.build import build_on_grid

    if uses_auto_layout(cfg):  # as the driver settles it before the hosts start
        cfg = settled(cfg, derive_for_config(cfg, mesh.model))
    grid = device_grid(jax.devices(), mesh)
    model, dataset = build_on_grid(cfg, grid)
    batch = cfg.trainer.micro_batch
    x, y = dataset.batch("train", 0, batch, slice(0, batch))
    model.train_on_batch(x, y)
    hlo = train_step_hlo(model, x, y)
    return Measured(
        collectives.from_hlo(hlo, grid.size),
        _shard_bytes(model.variables),
        _shard_bytes(model.optimizer.variables),
    )


def train_step_hlo(model, x, y) -> str:
    """The optimized HLO of the model's train step, jitted with the arguments Keras's own
    `make_train_function` gives it (state sharded as the live variables are)."""
    import jax
    from keras.src.backend.jax.trainer import _distribute_data

    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables],
        [v.value for v in model.metrics_variables],
    )
    step = jax.jit(model.train_step, out_shardings=(None, model._get_state_sharding_spec()))
    return step.lower(state, _distribute_data((x, y, None))).compile().as_text()


def _shard_bytes(variables) -> int:
    from training.build import describe_variables

    return sum(v["shard_bytes"] for v in describe_variables(variables).values())
