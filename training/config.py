"""Typed configuration: one dataclass per config group option, registered with Hydra.

Each YAML file under `conf/<group>/` extends the schema stored here for its option, so a
wrong type or an unknown key is rejected by Hydra when the config is composed. Cross-field
rules (mesh against cluster, batch against mesh) live in `training.driver.preflight`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, MissingMandatoryValue, OmegaConf

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
STRATEGIES = ("data_parallel", "model_parallel", "hybrid")
PRECISIONS = ("float32", "bfloat16")
NAN_POLICIES = ("stop",)
LOCAL_PLATFORMS = ("auto", "cpu", "gpu")
AUTO = -1  # a mesh axis of this size takes all remaining devices
# strategy.layout: the model's own rules, or rules derived from its structure
# (training.parallel.auto_layout).
MODEL_LAYOUT = "model"
AUTO_LAYOUT = "auto"
LAYOUTS = (MODEL_LAYOUT, AUTO_LAYOUT)


class ConfigError(ValueError):
    """Bad user input, reported as one clear message before anything expensive starts."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _require_positive(node: object, group: str, keys: tuple[str, ...]) -> None:
    for key in keys:
        _require(getattr(node, key) >= 1, f"{group}.{key} must be >= 1")


@dataclass
class StrategyConfig:
    name: str = MISSING
    # Extra layout rules, merged over the model's own (the same pattern replaces one), e.g.
    # strategy.layout_rules={head/kernel:[null,model]}. None (not {}) by default so that a
    # command-line dict replaces it rather than adding keys to a struct (and `Any`, since
    # omegaconf cannot merge a dict into a None typed as a dict); checked in __post_init__.
    layout_rules: Any = None
    # Where the rules come from: `model` (model.layout and model.layout_rules) or `auto`
    # (derived on the driver from the model's structure, printed, and sent to the hosts as
    # model.layout_rules). strategy.layout_rules override either.
    layout: str = MODEL_LAYOUT

    def __post_init__(self) -> None:
        _require(
            self.name in STRATEGIES,
            f"strategy.name={self.name!r} is not one of {', '.join(STRATEGIES)}",
        )
        _require(
            self.layout in LAYOUTS,
            f"strategy.layout={self.layout!r} is not one of {', '.join(LAYOUTS)} (the model's "
            "own rules, or rules derived from its structure)",
        )
        self.layout_rules = checked_layout_rules("strategy.layout_rules", self.layout_rules)


@dataclass
class MeshConfig:
    data: int = AUTO
    model: int = AUTO

    def __post_init__(self) -> None:
        for axis in ("data", "model"):
            size = getattr(self, axis)
            _require(
                size == AUTO or size >= 1,
                f"mesh.{axis}={size}: use a positive size, or -1 for all remaining devices",
            )


@dataclass
class ModelConfig:
    """A model is a builder function, a loss and a layout; the built-in models and a user's
    own are defined the same way (see `training.models`).

    `build`, `loss` and `layout` name Python objects as `module:function`; the module is
    looked for in the run's working directory first, then in installed packages."""

    name: str = "keras"
    build: str = MISSING  # called with `kwargs`; returns an uncompiled keras.Model
    kwargs: Dict[str, Any] = field(default_factory=dict)
    # A Keras loss identifier (`mse`, `sparse_categorical_crossentropy`, ...) or
    # `module:function` returning a loss.
    loss: str = MISSING
    # Regex (full-matched against variable paths, or `<layer>/output` for an activation) ->
    # one of data, model, null per dimension. None: none (see StrategyConfig.layout_rules).
    layout_rules: Any = None
    # Or `module:function`, called with the keras DeviceMesh (axes data, model), returning
    # such a dict or a keras.distribution.LayoutMap. Its rules come first; layout_rules
    # override the same patterns.
    layout: str = ""
    # Token data (data=text, data=tokens) is cut into windows of seq_len + 1 tokens.
    seq_len: int = 128

    def __post_init__(self) -> None:
        named = {"build": self.build, "layout": self.layout}
        if ":" in self.loss:  # else a Keras identifier
            named["loss"] = self.loss
        for key, value in named.items():
            _require(
                not value or _is_object_path(value),
                f"model.{key}={value!r} must name a Python object as module:function",
            )
        _require(self.seq_len >= 1, "model.seq_len must be >= 1")
        self.layout_rules = checked_layout_rules("model.layout_rules", self.layout_rules)

    def build_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of the `build` function."""
        return dict(self.kwargs)

    def layout_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the `layout` function besides the device mesh."""
        return {}


def checked_layout_rules(key: str, rules: Any) -> dict[str, list[str | None]]:
    """Layout rules as given on the command line: pattern -> list of axis names or None."""
    if rules is None:
        return {}
    _require(isinstance(rules, dict), f"{key} must be a dict of pattern: [axis, ...]")
    for pattern, axes in rules.items():
        _require(
            isinstance(axes, list) and all(a is None or isinstance(a, str) for a in axes),
            f"{key}: {pattern!r} must map to a list of mesh axis names or null, got {axes!r}",
        )
    return {str(pattern): list(axes) for pattern, axes in rules.items()}


def _is_object_path(value: str) -> bool:
    module, _, attribute = value.partition(":")
    return (
        bool(module)
        and bool(attribute)
        and all(part.isidentifier() for part in [*module.split("."), *attribute.split(".")])
    )


@dataclass
class HubModelConfig(ModelConfig):
    """A keras-hub backbone built from constructor sizes (random weights, no download) with a
    causal-LM head; its layout is the backbone's own `get_layout_map`."""

    name: str = "hub"
    backbone: str = MISSING  # a class of keras_hub.models, e.g. LlamaBackbone
    build: str = "training.models.hub:causal_lm"
    loss: str = "training.models.hub:loss"
    layout: str = "training.models.hub:layout_map"

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self.backbone.isidentifier(), f"model.backbone={self.backbone!r} is not a name")

    def build_kwargs(self) -> dict[str, Any]:
        return {"backbone": self.backbone, "seq_len": self.seq_len, **self.kwargs}

    def layout_kwargs(self) -> dict[str, Any]:
        return {"backbone": self.backbone}


@dataclass
class SyntheticDataConfig:
    name: str = "synthetic"
    features: int = 32
    classes: int = 8
    examples: int = 16384
    held_out_examples: int = 2048
    seed: int = 1234  # seeds the task itself, so it stays fixed when trainer.seed changes

    def __post_init__(self) -> None:
        _require_positive(self, "data", ("features", "classes", "examples", "held_out_examples"))


@dataclass
class TextDataConfig:
    """Byte-level text from files already on every host (Python's standard library by default)."""

    name: str = "text"
    root: str = ""  # a directory of text files; empty means the standard library's sources
    glob: str = "*.py"
    seq_len: int = 128  # the yaml takes model.seq_len
    held_out_percent: float = 10.0  # of the files, chosen by a hash of their names
    seed: int = 1234  # shuffles the training windows

    def __post_init__(self) -> None:
        _require(self.seq_len >= 1, "data.seq_len must be >= 1")
        _require(0 < self.held_out_percent < 100, "data.held_out_percent must be between 0 and 100")


@dataclass
class FileDataConfig:
    """What every dataset read from files on the hosts has."""

    what_path_names: ClassVar[str] = "a data file"
    path: str = MISSING
    held_out_path: str = ""  # empty: the last held_out_percent of the data is held out
    held_out_percent: float = 10.0
    seed: int = 0  # shuffles each epoch; the yaml takes trainer.seed

    def __post_init__(self) -> None:
        _require(bool(self.path), f"data.path must name {self.what_path_names}")
        _require(0 < self.held_out_percent < 100, "data.held_out_percent must be between 0 and 100")


@dataclass
class ArrayDataConfig(FileDataConfig):
    """Arrays on disk: a .npz file, or a directory of .npy files opened memory-mapped."""

    what_path_names: ClassVar[str] = "a .npz file or a directory of .npy files"
    name: str = "arrays"
    # Integer labels are class ids. 0: the largest label + 1, found by a scan of the labels,
    # which is refused for more than LABEL_SCAN_LIMIT labels (training/data/arrays.py).
    num_classes: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self.num_classes >= 0, "data.num_classes must be >= 0 (0: from the labels)")


TOKEN_DTYPES = ("uint8", "uint16", "int16", "uint32", "int32", "int64")


@dataclass
class TokenDataConfig(FileDataConfig):
    """A flat binary file of token ids (nanoGPT's train.bin), read as windows."""

    what_path_names: ClassVar[str] = "a binary file of token ids"
    name: str = "tokens"
    dtype: str = "uint16"
    seq_len: int = 128  # the yaml takes model.seq_len
    # The vocabulary (nanoGPT's meta.pkl has it); 0: unknown, as finding the largest token id
    # would read the whole file. Where set, every batch is checked against it.
    vocab_size: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(
            self.dtype in TOKEN_DTYPES,
            f"data.dtype={self.dtype!r} is not a token id type: one of {', '.join(TOKEN_DTYPES)}",
        )
        _require(self.seq_len >= 1, "data.seq_len must be >= 1")
        _require(self.vocab_size >= 0, "data.vocab_size must be >= 0 (0: unknown)")


@dataclass
class AdamConfig:
    name: str = "adam"
    learning_rate: float = 1e-3
    beta_1: float = 0.9
    beta_2: float = 0.999

    def __post_init__(self) -> None:
        _require(self.learning_rate > 0, "optimizer.learning_rate must be > 0")


@dataclass
class SGDConfig:
    name: str = "sgd"
    learning_rate: float = 1e-2
    momentum: float = 0.9

    def __post_init__(self) -> None:
        _require(self.learning_rate > 0, "optimizer.learning_rate must be > 0")


@dataclass
class LocalClusterConfig:
    """A Ray instance started for this run on this machine: its GPUs, or simulated CPU hosts.

    Settled for the machine by `training.gpus.resolve_local` when the config is converted
    (`to_run_config`): `platform` auto becomes gpu where nvidia-smi lists GPUs, else cpu;
    hosts and devices_per_host of -1 become 1 host holding every GPU taking part, or on CPU
    2 hosts × 4 simulated devices."""

    name: str = "local"
    hosts: int = AUTO
    devices_per_host: int = AUTO
    platform: str = "auto"
    # GPUs taking part, by nvidia-smi index (None: all); split evenly over the hosts in order.
    gpus: Optional[List[int]] = None
    placement_timeout_s: float = 60.0
    # CPUs the local Ray instance offers, one per host: room for this many hosts at once (a
    # sweep's trials and a restart's spare group share them). None: this machine's cores,
    # plus room for a spare group (training.driver.cluster.local_cpus).
    num_cpus: Optional[int] = None
    # Not settable: every host shares this machine's one node.
    host_resource: ClassVar[Optional[str]] = None

    def __post_init__(self) -> None:
        for key in ("hosts", "devices_per_host"):
            size = getattr(self, key)
            _require(
                size == AUTO or size >= 1,
                f"cluster.{key}={size}: use a positive number, or -1 to derive it",
            )
        _require(
            self.platform in LOCAL_PLATFORMS,
            f"cluster.platform={self.platform!r} is not one of {', '.join(LOCAL_PLATFORMS)}",
        )
        _require(self.num_cpus is None or self.num_cpus >= 1, "cluster.num_cpus must be >= 1")
        if self.gpus is not None:
            self.gpus = [int(g) for g in self.gpus]
            _require(
                bool(self.gpus) and all(g >= 0 for g in self.gpus),
                f"cluster.gpus={self.gpus} must list GPU indices (nvidia-smi's), or be null",
            )
            _require(
                len(set(self.gpus)) == len(self.gpus),
                f"cluster.gpus={self.gpus} names a GPU twice",
            )
            _require(
                self.platform != "cpu",
                f"cluster.gpus={self.gpus} chooses GPUs, but cluster.platform=cpu simulates "
                "CPU hosts",
            )


@dataclass
class RayClusterConfig:
    """An existing Ray cluster, reached by address; one host actor per node.

    `hosts` and `devices_per_host` of -1 are read from the cluster when the run starts: the
    nodes that are hosts (with GPUs, or carrying `host_resource`) and their devices each."""

    name: str = "ray"
    address: str = "auto"
    hosts: int = AUTO
    devices_per_host: int = AUTO
    platform: str = "gpu"
    # A custom resource marking the nodes that are hosts (`ray start --resources=
    # '{"training_host": 1}'`); unset, every node with GPUs (platform=gpu) is a host.
    host_resource: Optional[str] = None
    placement_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for key in ("hosts", "devices_per_host"):
            size = getattr(self, key)
            _require(
                size == AUTO or size >= 1,
                f"cluster.{key}={size}: use a positive number, or -1 to read it from the cluster",
            )
        _require(self.platform in ("cpu", "gpu"), "cluster.platform must be 'cpu' or 'gpu'")
        _require(self.host_resource != "", "cluster.host_resource must be a resource name or null")


@dataclass
class TrainerConfig:
    steps: int = 100
    global_batch: int = 64
    seed: int = 0
    log_interval: int = 10
    eval_interval: int = 50  # held-out loss every this many steps, and after the last
    eval_batches: int = 4
    precision: str = "float32"  # or bfloat16: bf16 compute, float32 variables
    accumulate: int = 1  # micro-batches per optimizer step: global_batch / accumulate each
    # JAX's persistent compilation cache: "" for ~/.cache/training/jax ($XDG_CACHE_HOME),
    # "off" for none, else a directory every host can write (its own or shared)
    compile_cache_dir: str = ""

    def __post_init__(self) -> None:
        _require_positive(
            self,
            "trainer",
            ("steps", "global_batch", "log_interval", "eval_interval", "accumulate"),
        )
        _require(self.eval_batches >= 0, "trainer.eval_batches must be >= 0 (0: no evaluation)")
        _require(
            self.precision in PRECISIONS,
            f"trainer.precision={self.precision!r} is not one of {', '.join(PRECISIONS)}",
        )
        _require(
            self.global_batch % self.accumulate == 0,
            f"trainer.global_batch={self.global_batch} is not divisible by "
            f"trainer.accumulate={self.accumulate}",
        )

    @property
    def micro_batch(self) -> int:
        return self.global_batch // self.accumulate


@dataclass
class CheckpointConfig:
    """Sharded checkpoints of the whole training state; an empty `dir` turns them off."""

    # A directory every host reaches: a shared filesystem path, or a bucket URL (gs://,
    # s3://). A run whose dir already holds a checkpoint resumes from the newest one. A
    # relative path is made absolute here, on the driver, before the config goes to hosts.
    dir: str = ""
    interval: int = 50  # steps between checkpoints; the last step and a preemption save too
    keep: int = 3  # the newest this many are kept, older ones deleted
    # Keys of the checkpoint's record (what a resume must match) that may differ from this
    # run's, e.g. [optimizer.learning_rate]; a key allows every key under it (`optimizer`).
    allow_changes: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        _require(self.interval >= 1, "checkpoint.interval must be >= 1")
        _require(self.keep >= 1, "checkpoint.keep must be >= 1")
        scheme = url_scheme(self.dir)
        _require(
            scheme in (None, *CHECKPOINT_URL_SCHEMES),
            f"checkpoint.dir={self.dir!r}: {scheme}:// is not a storage orbax writes to; give "
            f"a shared path or a {' or '.join(s + '://' for s in CHECKPOINT_URL_SCHEMES)} URL",
        )
        if self.dir and scheme is None:
            self.dir = os.path.abspath(os.path.expanduser(self.dir))
        for key in self.allow_changes:
            _require(
                isinstance(key, str)
                and any(key == root or key.startswith(root + ".") for root in RECORD_ROOTS),
                f"checkpoint.allow_changes: {key!r} is not a key of a checkpoint's record; "
                f"keys start with one of {', '.join(RECORD_ROOTS)}",
            )

    @property
    def enabled(self) -> bool:
        return bool(self.dir)


# Bucket URLs orbax (tensorstore for the arrays, etils.epath for the rest) writes to.
CHECKPOINT_URL_SCHEMES = ("gs", "s3")
# What a checkpoint's record says a resume must match (training.checkpoint.record.resume_record).
RECORD_ROOTS = (
    "model",
    "optimizer",
    "trainer.global_batch",
    "trainer.accumulate",
    "trainer.seed",
    "data.fingerprint",
)


def url_scheme(path: str) -> str | None:
    """`gs` for gs://bucket/run, None for a filesystem path."""
    match = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", path)
    return match.group(1).lower() if match else None


@dataclass
class FaultConfig:
    # Hosts beat every second with what they are doing (training.host.phases); a host is declared
    # stuck when a phase outlasts its bound (JAX's own heartbeat only catches dead processes,
    # and Ray's timeouts are tens of minutes). From a host's start to its first step
    # (joining, building, restoring, compiling), and the jax.distributed initialisation:
    startup_timeout_s: float = 1800.0
    # Once training runs: time without a finished step (a host sees a step's result at least
    # every 10 steps: this must exceed 10 steps' time), and each evaluation or save; also how
    # long a host may say nothing at all.
    step_timeout_s: float = 300.0
    # Fresh host groups started after a host dies or stalls, each resuming from the newest
    # checkpoint (needs checkpoint.dir); 0 fails the run at the first lost host.
    max_restarts: int = 0
    # A NaN or infinite loss stops the run, naming the step; the checkpoints so far (all
    # saved from finite losses) are kept.
    on_nan: str = "stop"

    def __post_init__(self) -> None:
        _require(self.startup_timeout_s > 0, "fault.startup_timeout_s must be > 0")
        _require(self.step_timeout_s > 0, "fault.step_timeout_s must be > 0")
        _require(self.max_restarts >= 0, "fault.max_restarts must be >= 0")
        _require(
            self.on_nan in NAN_POLICIES,
            f"fault.on_nan={self.on_nan!r} is not one of {', '.join(NAN_POLICIES)}",
        )


@dataclass
class PlanConfig:
    """The hardware `python -m training.plan` predicts for (defaults: GPU hosts of 8 with
    NVLink inside a host and a 200 Gb/s network port per GPU between hosts).

    Each collective is costed on the link its group uses: devices of one host talk over
    `intra_host_gb_per_s`, a group that spans hosts is held to `inter_host_gb_per_s`."""

    # Bytes per second each device moves, one direction: NVLink ~300-450, PCIe ~20
    intra_host_gb_per_s: float = 300.0
    # ... and to other hosts: 100 GbE ~12, 400 Gb/s InfiniBand per GPU ~50
    inter_host_gb_per_s: float = 25.0
    # Devices that share the fast link; -1: cluster.devices_per_host
    devices_per_host: int = AUTO
    latency_us: float = 10.0  # fixed cost of one collective
    device_tflops: float = 100.0  # sustained training throughput of one device
    device_memory_gb: float = 80.0
    # Fewer examples than this per device leave a device mostly waiting on launches.
    min_examples_per_device: int = 8

    def __post_init__(self) -> None:
        positive = (
            "intra_host_gb_per_s",
            "inter_host_gb_per_s",
            "device_tflops",
            "device_memory_gb",
        )
        for key in positive:
            _require(getattr(self, key) > 0, f"plan.{key} must be > 0")
        _require(self.latency_us >= 0, "plan.latency_us must be >= 0")
        _require(self.min_examples_per_device >= 1, "plan.min_examples_per_device must be >= 1")
        _require(
            self.devices_per_host == AUTO or self.devices_per_host >= 1,
            f"plan.devices_per_host={self.devices_per_host}: use a positive number, or -1 for "
            "cluster.devices_per_host",
        )

    def link_gb_per_s(self, across_hosts: bool) -> float:
        return self.inter_host_gb_per_s if across_hosts else self.intra_host_gb_per_s


@dataclass
class SweepConfig:
    # Trials of a multirun (`-m`) that may hold host groups at once; more wait in a queue
    # until the Ray cluster has room for all of a trial's hosts.
    max_concurrent: int = 4

    def __post_init__(self) -> None:
        _require_positive(self, "sweep", ("max_concurrent",))


DataConfig = SyntheticDataConfig | TextDataConfig | ArrayDataConfig | TokenDataConfig
OptimizerConfig = AdamConfig | SGDConfig
ClusterConfig = LocalClusterConfig | RayClusterConfig


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
    plan: PlanConfig = field(default_factory=PlanConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)

    def __post_init__(self) -> None:
        _require(
            self.fault.max_restarts == 0 or self.checkpoint.enabled,
            f"fault.max_restarts={self.fault.max_restarts} needs checkpoint.dir: a fresh host "
            "group resumes from the newest checkpoint",
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
    },
    "optimizer": {"adam": AdamConfig, "sgd": SGDConfig},
    "cluster": {"local": LocalClusterConfig, "ray": RayClusterConfig},
    "trainer": {"trainer": TrainerConfig},
    "checkpoint": {"checkpoint": CheckpointConfig},
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
    _require(isinstance(run, RunConfig), "the root config must extend run_schema")
    return settled_for_this_machine(run)


def settled_for_this_machine(run: RunConfig) -> RunConfig:
    """A local cluster's platform, hosts and devices settled for this machine's GPUs."""
    if not isinstance(run.cluster, LocalClusterConfig):
        return run
    from training.gpus import discover_gpus, resolve_local

    cluster = run.cluster
    found = discover_gpus() if cluster.platform != "cpu" else []
    return replace(run, cluster=resolve_local(cluster, found))


def compose_run_config(overrides: list[str]) -> RunConfig:
    """The run config `python -m training.run <overrides>` would get, outside a Hydra app."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_run_config(compose("config", overrides=overrides))
