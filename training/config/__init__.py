"""Typed configuration: one dataclass per config group option, registered with Hydra.

A module here per group of `conf/` (`strategy.py` holds `mesh` too; `fault`, `plan` and `sweep`
have no options to pick, only their one schema). Each YAML file under `conf/<group>/` extends
the schema stored for its option, so a wrong type or an unknown key is rejected by Hydra when
the config is composed. Cross-field rules (mesh against cluster, batch against mesh) live in
`training.driver.preflight`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, MissingMandatoryValue, OmegaConf

from training.accelerators import peak_tflops
from training.config.checkpoint import CheckpointConfig, url_scheme
from training.config.cluster import (
    CPU_HOSTS,
    IN_PROCESS,
    ClusterConfig,
    InProcessClusterConfig,
    LocalClusterConfig,
    RayClusterConfig,
    host_gpus,
    resolve_in_process,
    resolve_local,
)
from training.config.common import AUTO, ConfigError, require
from training.config.data import (
    ArrayDataConfig,
    DataConfig,
    JsonlDataConfig,
    ParquetDataConfig,
    SyntheticDataConfig,
    TextDataConfig,
    TokenDataConfig,
    packed_row_tile,
)
from training.config.export import (
    EXPORT_FILE,
    HF_ADAPTER_EXPORT,
    HF_EXPORT,
    PRESET_EXPORT,
    ExportConfig,
)
from training.config.fault import FaultConfig
from training.config.model import HubModelConfig, ModelConfig
from training.config.optimizer import (
    OPTIMIZERS,
    SCHEDULES,
    AdamConfig,
    AdamWConfig,
    OptimizerConfig,
    SGDConfig,
)
from training.config.plan import PlanConfig
from training.config.strategy import (
    AUTO_LAYOUT,
    AUTO_STRATEGY,
    LAYOUTS,
    MeshConfig,
    StrategyConfig,
)
from training.config.sweep import SweepConfig
from training.config.tracking import (
    TRACKERS,
    MlflowTrackingConfig,
    TrackingConfig,
    WandbTrackingConfig,
)
from training.config.trainer import TrainerConfig
from training.gpus import MEM_FRACTION, Gpu, discover_gpus
from training.tpus import (
    SLICE_ICI_GB_PER_S,
    count_tpu_chips,
    slice_chip_kind,
    slice_device_memory,
    tpu_kind,
)

# plan.device_memory_gb where the device's own is not known here: an 80 GB GPU's.
DEFAULT_DEVICE_MEMORY_GB = 80.0
# plan's links and throughput where no TPU slice gives them: GPU hosts' (NVLink inside a host,
# a 200 Gb/s port per GPU between hosts), a sustained 100 TFLOP/s per device.
DEFAULT_HARDWARE = {
    "intra_host_gb_per_s": 300.0,
    "inter_host_gb_per_s": 25.0,
    "device_tflops": 100.0,
}
# The models that take packed rows' segment ids (data.pack): keras-hub's causal LMs
# (training/models/hub_packing.py) and the transformer (training/models/transformer.py).
PACKED_MODELS = ("hub", "transformer")

__all__ = [
    "AUTO",
    "AUTO_LAYOUT",
    "AUTO_STRATEGY",
    "CPU_HOSTS",
    "LAYOUTS",
    "AdamConfig",
    "AdamWConfig",
    "ArrayDataConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "ConfigError",
    "DataConfig",
    "EXPORT_FILE",
    "HF_ADAPTER_EXPORT",
    "HF_EXPORT",
    "ExportConfig",
    "FaultConfig",
    "HubModelConfig",
    "IN_PROCESS",
    "InProcessClusterConfig",
    "JsonlDataConfig",
    "ParquetDataConfig",
    "LocalClusterConfig",
    "MeshConfig",
    "MlflowTrackingConfig",
    "ModelConfig",
    "OPTIMIZERS",
    "OptimizerConfig",
    "PRESET_EXPORT",
    "PlanConfig",
    "RayClusterConfig",
    "RunConfig",
    "SCHEDULES",
    "SGDConfig",
    "StrategyConfig",
    "SweepConfig",
    "SyntheticDataConfig",
    "TextDataConfig",
    "TokenDataConfig",
    "WandbTrackingConfig",
    "TrackingConfig",
    "TrainerConfig",
    "compose_run_config",
    "config_record",
    "host_gpus",
    "register_configs",
    "resolve_local",
    "run_config_from_record",
    "settled_outputs",
    "to_run_config",
    "url_scheme",
    "with_open_dicts",
]

CONF_DIR = Path(__file__).resolve().parent.parent.parent / "conf"


@dataclass
class RunConfig:
    # Group options have their own schemas, so the root types them as Any; `to_run_config`
    # turns every node into its option's dataclass.
    strategy: StrategyConfig = MISSING
    mesh: MeshConfig = field(default_factory=MeshConfig)
    model: Any = MISSING
    data: Any = MISSING
    optimizer: Any = MISSING
    cluster: Any = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    tracking: Any = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        require(
            self.fault.max_restarts == 0 or self.checkpoint.enabled,
            f"fault.max_restarts={self.fault.max_restarts} needs checkpoint.dir: a fresh host "
            "group resumes from the newest checkpoint",
        )
        self.optimizer.check_against_steps(self.trainer.steps)
        require(
            not self.export.lora_only or getattr(self.model, "lora_rank", 0),
            "export.lora_only writes a model's LoRA weights: it needs model=hub with "
            "model.lora_rank",
        )
        require(
            self.strategy.name != AUTO_STRATEGY
            or (self.mesh.data, self.mesh.model) == (AUTO, AUTO),
            "strategy=auto picks the mesh as well: drop mesh.data and mesh.model",
        )
        require(
            not getattr(self.data, "pack", False) or self.model.name in PACKED_MODELS,
            "data.pack=true needs a model that keeps packed examples apart by their segment "
            f"ids: model=hub or model=transformer; model={self.model.name} does not",
        )
        require(
            not self.checkpoint.keep_best or self.trainer.eval_batches != 0,
            "checkpoint.keep_best ranks checkpoints by a held-out figure: trainer.eval_batches "
            "is 0",
        )


SCHEMAS = {
    "strategy": {"strategy": StrategyConfig},
    "mesh": {"mesh": MeshConfig},
    "model": {"keras": ModelConfig, "hub": HubModelConfig},
    "data": {
        "synthetic": SyntheticDataConfig,
        "text": TextDataConfig,
        "arrays": ArrayDataConfig,
        "tokens": TokenDataConfig,
        "jsonl": JsonlDataConfig,
        "parquet": ParquetDataConfig,
    },
    "optimizer": OPTIMIZERS,
    "cluster": {
        "local": LocalClusterConfig,
        "ray": RayClusterConfig,
        IN_PROCESS: InProcessClusterConfig,
    },
    "trainer": {"trainer": TrainerConfig},
    "checkpoint": {"checkpoint": CheckpointConfig},
    "tracking": TRACKERS,
}


def register_configs() -> None:
    """Store every schema as `schema/<group>/<name>`, for the YAML options to extend."""
    store = ConfigStore.instance()
    store.store(name="run_schema", node=RunConfig)
    for group, options in SCHEMAS.items():
        for name, schema in options.items():
            store.store(group=f"schema/{group}", name=name, node=schema)


def to_run_config(cfg: DictConfig | RunConfig) -> RunConfig:
    """Resolve the composed config into plain dataclasses (the only form passed to actors)."""
    if isinstance(cfg, RunConfig):
        return settled_for_this_machine(cfg)
    try:
        run = OmegaConf.to_object(cfg)
    except ConfigError:
        raise
    except MissingMandatoryValue as error:
        raise ConfigError(
            f"{error.full_key} has no default: give it on the command line ({error.full_key}=...)"
        ) from None
    except Exception as error:  # omegaconf reports type errors with its own exception types
        raise ConfigError(str(error)) from None
    require(isinstance(run, RunConfig), "the root config must extend run_schema")
    return settled_for_this_machine(run)


def settled_for_this_machine(run: RunConfig) -> RunConfig:
    """A local or in-process cluster's platform, hosts and devices settled for this
    machine's TPU chips or GPUs, and plan.device_memory_gb for its devices."""
    cluster = run.cluster
    resolve = {LocalClusterConfig: resolve_local, InProcessClusterConfig: resolve_in_process}
    run = settled_hardware(run)
    if type(cluster) not in resolve:
        return _with_device_memory(_with_pack_tile(run), _slice_device_memory_gb(cluster))
    gpus = discover_gpus() if cluster.platform in ("auto", "gpu") else []
    chips = count_tpu_chips() if cluster.platform in ("auto", "tpu") else 0
    settled = resolve[type(cluster)](cluster, gpus, chips)
    require(
        run.fault.max_restarts == 0 or not isinstance(settled, InProcessClusterConfig),
        f"fault.max_restarts={run.fault.max_restarts}: with cluster=inprocess the host is the "
        "driver's own process, and a lost host is the driver lost; restarts need cluster=local "
        "or cluster=ray",
    )
    settled_run = _with_pack_tile(replace(run, cluster=settled))
    return _with_device_memory(settled_run, _device_memory_gb(settled, gpus))


def _with_pack_tile(run: RunConfig) -> RunConfig:
    """data.pack_tile settled where it is -1: the fused kernel's tile on TPU, else 0."""
    if getattr(run.data, "pack_tile", 0) != -1:
        return run
    tile = packed_row_tile(run.data.seq_len) if run.cluster.platform == "tpu" else 0
    return replace(run, data=replace(run.data, pack_tile=tile))


def settled_hardware(run: RunConfig) -> RunConfig:
    """plan's links and throughput where they are -1: a TPU slice's chips' interconnect,
    inside its VMs and between them, and their dense bf16 peak; else DEFAULT_HARDWARE."""
    version = getattr(run.cluster, "tpu_version", "")
    ici = SLICE_ICI_GB_PER_S.get(version)
    kind = slice_chip_kind(version)
    found = {
        "intra_host_gb_per_s": ici,
        "inter_host_gb_per_s": ici,
        "device_tflops": peak_tflops(kind) if kind else None,
    }
    settled = {
        key: found[key] or DEFAULT_HARDWARE[key] for key in found if getattr(run.plan, key) == AUTO
    }
    return replace(run, plan=replace(run.plan, **settled))


def _device_memory_gb(cluster: LocalClusterConfig | InProcessClusterConfig, gpus: list[Gpu]):
    """What one device of this machine's run may hold, in GB; None where not known."""
    if cluster.platform == "gpu" and gpus:
        chosen = getattr(cluster, "gpus", None)
        taking_part = [g for g in gpus if chosen is None or g.index in chosen]
        return min(g.memory_mib for g in taking_part) * 2**20 * float(MEM_FRACTION) / 1e9
    if cluster.platform == "tpu" and (kind := tpu_kind()):
        return kind[1] / 1e9
    return None


def _slice_device_memory_gb(cluster: RayClusterConfig) -> float | None:
    """What one chip of the TPU slice `cluster.tpu_version` names may hold, in GB; None
    where the cluster names none (or one of unknown chips)."""
    found = slice_device_memory(cluster.tpu_version) if cluster.tpu_version else None
    return None if found is None else found / 1e9


def _with_device_memory(run: RunConfig, found_gb: float | None) -> RunConfig:
    if run.plan.device_memory_gb != AUTO:
        return run
    settled = DEFAULT_DEVICE_MEMORY_GB if found_gb is None else round(found_gb, 3)
    return replace(run, plan=replace(run.plan, device_memory_gb=settled))


def settled_outputs(run: RunConfig, output_dir: str) -> RunConfig:
    """Where the hosts write what the run hands back, where the config leaves it empty: the
    run's directory `output_dir` on a local or in-process cluster (the hosts run on this
    machine), checkpoint.dir where it is a path on a Ray cluster. `export.dir` there, and
    trainer.profile_dir in its `profile/`."""
    if isinstance(run.cluster, LocalClusterConfig | InProcessClusterConfig):
        directory = str(output_dir)
    elif run.checkpoint.enabled and url_scheme(run.checkpoint.dir) is None:
        directory = run.checkpoint.dir
    else:
        directory = ""
    export, trainer = run.export, run.trainer
    if export.enabled and not export.dir and directory:
        run = replace(run, export=replace(export, dir=directory))
    if trainer.profile_steps and not trainer.profile_dir:
        require(
            bool(directory),
            "trainer.profile_steps: give trainer.profile_dir, a directory every host can write "
            "(on a Ray cluster without a checkpoint.dir path there is no run directory)",
        )
        profiles = str(Path(directory) / "profile")
        run = replace(run, trainer=replace(trainer, profile_dir=profiles))
    return run


def config_record(run: RunConfig) -> dict:
    """The config as JSON-able data, each group with its schema's name, from which
    `run_config_from_record` rebuilds it (in a checkpoint's record, say)."""
    return {
        "values": asdict(run),
        "schemas": {f.name: type(getattr(run, f.name)).__name__ for f in fields(run)},
    }


def run_config_from_record(record: dict) -> RunConfig:
    """The RunConfig `config_record` described, each group checked by its schema again."""
    schemas = {
        schema.__name__: schema
        for schema in [
            *(s for options in SCHEMAS.values() for s in options.values()),
            *(f.default_factory for f in fields(RunConfig) if callable(f.default_factory)),
        ]
    }
    groups = {
        key: OmegaConf.to_object(
            OmegaConf.merge(OmegaConf.structured(schemas[record["schemas"][key]]), values)
        )
        for key, values in record["values"].items()
    }
    return RunConfig(**groups)


# Dicts whose keys are the user's own (a build function's arguments): any key may be set.
OPEN_DICTS = ("model.kwargs",)


def with_open_dicts(overrides: list[str]) -> list[str]:
    """`model.kwargs.hidden=512` and `model.kwargs={hidden: 512}` as Hydra's `++` overrides
    (add or replace): Hydra refuses a key the composed config does not have yet without a
    `+`, and refuses `+` for a key it has, while which keys a model's kwargs have depends on
    the model chosen."""
    return [
        f"++{override}" if override.split("=", 1)[0].startswith(OPEN_DICTS) else override
        for override in overrides
    ]


def compose_run_config(overrides: list[str]) -> RunConfig:
    """The run config `python -m training.run <overrides>` would get, outside a Hydra app."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_run_config(compose("config", overrides=with_open_dicts(overrides)))
