"""What preflight settles (`Checked`) and the checks that need no model: light to import,
so that the driver requests its hosts before it imports Keras (`training.run`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from training.checkpoint.storage import check_bucket_destinations
from training.config import ConfigError, RunConfig, TrainerConfig
from training.config.common import names_object
from training.contracts import Dataset, DataSpec, LayoutRules, VariableInfo
from training.data import check_data_files
from training.models.locate import check_found
from training.parallel.mesh import MeshShape, resolve_mesh, settled
from training.parallel.strategy import Strategy
from training.planning import auto_layout


@dataclass(frozen=True)
class Checked:
    """What preflight settled: the mesh to build and the variables the model will have."""

    mesh: MeshShape
    hosts: int
    devices_per_host: int
    variables: tuple[VariableInfo, ...]
    # The driver's copy of the data, whose order says which examples each host must feed.
    dataset: Dataset = field(repr=False, compare=False)
    resume_step: int | None = None  # the newest checkpoint's, when checkpoint.dir has one
    layout: auto_layout.AutoLayout | None = None  # the rules derived for strategy.layout=auto
    # The rules the hosts get: the model's with their sources' precedence settled per
    # variable (or strategy.layout=auto's), and fsdp's split over `data`; None: data parallel.
    rules: LayoutRules | None = None
    parameters: dict[str, int] = field(default_factory=dict)  # build.count_parameters
    # A training example's model FLOPs (training.models.flops), for MFU
    flops_per_example: float = 0.0
    # What the plan could not do exactly (`costs.untraced_warning`), shown before training.
    warnings: tuple[str, ...] = ()

    @property
    def data_spec(self) -> DataSpec:
        return self.dataset.spec


def check_sizes(cfg: RunConfig) -> MeshShape:
    """The instant checks: the modules the config names exist, the data's bucket objects
    are there, the buckets checkpoints and the export go to are writable, the mesh against
    the cluster, the batch against the mesh."""
    for key, path in named_objects(cfg):
        check_found(key, path)
    check_data_files(cfg.data)
    check_bucket_destinations(cfg.checkpoint, cfg.export)
    hosts, per_host = cfg.cluster.hosts, cfg.cluster.devices_per_host
    mesh = resolve_mesh(Strategy.of(cfg.strategy), cfg.mesh, hosts, per_host)
    check_global_batch(cfg.trainer, mesh, hosts)
    return mesh


def named_objects(cfg: RunConfig) -> list[tuple[str, str]]:
    """(config key, `module:function`) for each Python object the config names."""
    model = cfg.model
    named = [
        ("model.build", model.build),
        ("model.layout", model.layout),
        ("model.loss", model.loss),
        ("optimizer.schedule", cfg.optimizer.schedule),
        *model.metric_names(),
    ]
    return [(key, path) for key, path in named if path and names_object(path)]


def check_global_batch(trainer: TrainerConfig, mesh: MeshShape, hosts: int) -> None:
    """Each micro-batch (the global batch / trainer.accumulate) splits evenly over the data
    axis and over the hosts."""
    batch, accumulate = trainer.micro_batch, trainer.accumulate
    what_batch = (
        f"trainer.global_batch={trainer.global_batch}"
        if accumulate == 1
        else f"the micro-batch trainer.global_batch / trainer.accumulate = {batch}"
    )
    for divisor, what in ((mesh.data, "the data axis size mesh.data"), (hosts, "the host count")):
        if batch % divisor:
            raise ConfigError(f"{what_batch} is not divisible by {what} ({divisor})")


def with_layout(cfg: RunConfig, checked: Checked) -> RunConfig:
    """The config the hosts get: the rules settled here as the model's own, so no host
    derives them (strategy.layout=auto) or weighs one rule against another."""
    if checked.rules is None:
        return cfg
    return settled(cfg, checked.rules)
