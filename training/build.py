"""What a run builds from its config: the dtype policy, the model on a device grid.

Both the hosts' trainer and the analysis that checks the plan against a compiled step build
from here, so that what is analysed is what trains.
"""

from __future__ import annotations

import numpy as np

from training import keras_compat, models
from training.config import RunConfig
from training.contracts import DataSpec
from training.data import build_dataset
from training.models.remat import rematerialised
from training.parallel.fsdp import gather_for_use, gathers_left_to_the_compiler
from training.parallel.mesh import build_distribution
from training.parallel.strategy import Strategy
from training.recipe import compile_model


def build_on_grid(cfg: RunConfig, grid: np.ndarray):
    """The compiled model, its variables laid out over `grid`, and the dataset it reads."""
    import keras

    strategy = Strategy.of(cfg.strategy)
    rules = strategy.given_rules(cfg.model, grid.shape, grid)
    if rules is None:
        raise ValueError(
            "strategy.layout=auto: the driver derives the rules and settles them into the "
            "hosts' config (training.parallel.mesh.settled); build from that config"
        )
    keras.distribution.set_distribution(build_distribution(strategy, grid, rules))
    dataset = build_dataset(cfg.data)
    model = build_compiled(cfg, dataset.spec)
    if not gathers_left_to_the_compiler(grid.flat[0].platform, grid.shape[1]):
        # On TPU without a model axis libtpu reduce-scatters each gradient as it is made,
        # where weights gathered for the backward pass keep every whole gradient alive; with
        # one, XLA may re-split activations over `data` instead; XLA:CPU keeps whole
        # gradients either way, and more without (`training.parallel.fsdp`).
        gather_for_use(model)  # fsdp's weights, and those a model's own rules split over `data`
    return model, dataset


def build_compiled(cfg: RunConfig, data_spec: DataSpec):
    """The model compiled with its recipe, under the distribution set (if any), for data of
    `data_spec`: its optimizer and metrics built too."""
    import keras

    # Same seed on every host, or the replicated initial weights differ between processes.
    keras.utils.set_random_seed(cfg.trainer.seed)
    keras.config.set_dtype_policy(cfg.trainer.dtype_policy)
    model = rematerialised(
        lambda: models.build_model(cfg.model, data_spec), cfg.trainer.remat, data_spec
    )
    compile_model(model, cfg)
    # The optimizer and the compiled metrics built now rather than at the first step, so
    # that a checkpoint can be restored into them and the step carries every metric.
    keras_compat.build_training_state(model, models.symbolic_batch(data_spec))
    return model


def count_parameters(model) -> dict[str, int]:
    """Its weights' elements (not the state of random seeds), and those that train."""
    import math

    def count(weights) -> int:
        return sum(math.prod(w.shape) for w in weights)

    return {
        "parameters": count(model.weights),
        "parameters_trained": count(model.trainable_weights),
    }


def describe_variables(variables) -> dict[str, dict]:
    """Sharding of every variable, read from the live arrays rather than from the config."""
    from jax.sharding import PartitionSpec

    described = {}
    for variable in variables:
        array = variable.value
        shard = array.addressable_shards[0].data
        described[variable.path] = {
            # A one-device run's arrays have a SingleDeviceSharding, which has no spec.
            "spec": str(getattr(array.sharding, "spec", PartitionSpec())),
            "shape": list(array.shape),
            "bytes": int(array.nbytes),
            "shard_shape": list(shard.shape),
            "shard_bytes": int(shard.nbytes),
            "trainable": bool(variable.trainable),
        }
    return described
