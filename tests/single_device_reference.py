"""The correctness reference: plain Keras, one process, one device, the same global batches.

Usage: python single_device_reference.py '<json list of overrides>' ...  -> prints the logged
losses as JSON (at each logged step, the mean loss of the steps since the last one logged),
one line per list of overrides.
Shares only the model, data and optimizer definitions with the system under test, not its
strategy, host or supervisor code. A user's model module is found from the working
directory, as in a run.

`trainer.precision=bfloat16` computes under Keras' own mixed policy (bfloat16 compute,
float32 variables). `trainer.accumulate` is ignored on purpose: each step trains on the
whole global batch at once, which is what accumulating its micro-batches must equal.
"""

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["KERAS_BACKEND"] = "jax"

import jax  # noqa: E402
import keras  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from training import models  # noqa: E402
from training.config import register_configs, to_run_config  # noqa: E402
from training.data import build_dataset  # noqa: E402
from training.recipe import compile_model  # noqa: E402

# Keras' documented dtype policies, spelled out here rather than taken from the trainer.
POLICIES = {"float32": "float32", "bfloat16": "mixed_bfloat16"}


def reference_losses(overrides: list[str]) -> list[float]:
    register_configs()
    conf = Path(__file__).resolve().parent.parent / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = to_run_config(compose("config", overrides=overrides))
    assert len(jax.devices()) == 1
    keras.utils.set_random_seed(cfg.trainer.seed)
    keras.config.set_dtype_policy(POLICIES[cfg.trainer.precision])
    dataset = build_dataset(cfg.data)
    model = models.build_model(cfg.model, dataset.spec)
    compile_model(model, replace(cfg, trainer=replace(cfg.trainer, accumulate=1)))
    batch = cfg.trainer.global_batch
    losses, interval = [], []
    for step in range(cfg.trainer.steps):
        data = dataset.batch("train", step, batch, slice(0, batch))
        interval.append(float(model.train_on_batch(*data, return_dict=True)["loss"]))
        if (step + 1) % cfg.trainer.log_interval == 0 or step + 1 == cfg.trainer.steps:
            losses.append(sum(interval) / len(interval))
            interval = []
    return losses


if __name__ == "__main__":
    for overrides in sys.argv[1:]:
        print(json.dumps(reference_losses(json.loads(overrides))))
