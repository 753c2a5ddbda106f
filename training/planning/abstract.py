"""A run's model built abstractly (paths, shapes and dtypes; no weights), once per model:
preflight's checks, the layouts and the plan's costs read the same build.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, field

from training import models
from training.config import ModelConfig, RunConfig
from training.contracts import DataSpec
from training.models.remat import rematerialised


@dataclass(frozen=True)
class ModelKey:
    """What identifies a run's abstract model: the model config, the data it reads (its
    inputs' shapes, its classes), the dtype policy its layers take and the layers
    trainer.remat marks. Hashable, unlike the configs it is made from."""

    model: str  # the model config, as JSON
    data: str
    dtype_policy: str
    remat: str
    model_config: ModelConfig = field(compare=False, repr=False)
    data_spec: DataSpec = field(compare=False, repr=False)

    @classmethod
    def of(cls, cfg: RunConfig, data_spec: DataSpec) -> ModelKey:
        config = json.dumps(asdict(cfg.model), sort_keys=True, default=str)
        return cls(
            f"{type(cfg.model).__name__} {config}",
            repr(data_spec),
            cfg.trainer.dtype_policy,
            cfg.trainer.remat,
            cfg.model,
            data_spec,
        )


# A few models: a plan asks for one model many times, a test session for many models.
@functools.lru_cache(maxsize=8)
def abstract_keras_model(key: ModelKey):
    """The keras.Model of `key`, built without allocating its weights, in the run's dtype
    policy, with trainer.remat applied."""
    with models.dtype_policy(key.dtype_policy):
        return rematerialised(
            lambda: models.abstract_model(key.model_config, key.data_spec),
            key.remat,
            key.data_spec,
        )
