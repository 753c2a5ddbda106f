"""`strategy=auto`: the strategy and mesh a run takes, chosen on the driver before its hosts
start, by compiling the hosts' step.

The candidates are every strategy and mesh the cluster's devices allow
(`costs.candidates`), with the configured `trainer.remat`. The analytic estimate ranks
them by predicted step time without compiling; in that order, the promising ones (whose
estimated memory is not far over the devices') are compiled ahead of time
(`compiled.compile_ahead_of_time`: for the run's TPU slice or on its accelerator where this
machine has its compiler, else on simulated CPU devices) until one fits the devices' memory
by the compiler's figure: the fastest that fits. A candidate whose weights are split over
`data` is judged by its estimate where XLA:CPU stands in (`target.stand_in_wrong`). Where
none does, the same with more rematerialisation (`dots`, then `full`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from training.config import (
    AUTO_LAYOUT,
    AUTO_STRATEGY,
    ConfigError,
    MeshConfig,
    RunConfig,
)
from training.config.strategy import MODEL_LAYOUT
from training.data import build_dataset
from training.events import OutOfDeviceMemory
from training.parallel.mesh import MeshShape
from training.parallel.strategy import Strategy
from training.planning.compiled import Compiled, compile_ahead_of_time
from training.planning.costs import StrategyCost, abstract_model, candidates, strategy_cost
from training.planning.target import stand_in_wrong

# trainer.remat's settings, from the least recomputation to the most.
REMAT_LEVELS = ("none", "dots", "full")
# The estimate's memory is off by up to 1.75 × on a TPU: a candidate it puts at up to twice
# the devices' memory may still fit, and is compiled.
PROMISING = 2.0
# Compiles at most (a large model's takes a minute on a TPU).
MAX_COMPILES = 4


@dataclass(frozen=True)
class Candidate:
    config: RunConfig  # the run's config with this strategy, mesh and remat
    mesh: MeshShape
    estimate: StrategyCost
    compiled: Compiled | None = None
    # Why the compiler gave no figure: it refused the step (out of memory), or failed.
    refused: str = ""
    # Why it was not compiled: XLA:CPU, standing in for the run's compiler, is known wrong
    # for it (`target.stand_in_wrong`); its estimate decides.
    estimated_only: str = ""

    @property
    def strategy(self) -> str:
        return self.config.strategy.name

    @property
    def remat(self) -> str:
        return self.config.trainer.remat

    def fits(self, budget_bytes: float) -> bool | None:
        """By the compiled figure; None where the candidate was not compiled."""
        if self.refused:
            return False
        if self.estimated_only:
            return self.estimate.memory_bytes <= budget_bytes
        if self.compiled is None:
            return None
        return self.compiled.memory.needed <= budget_bytes

    def override(self, configured: RunConfig) -> str:
        """The command-line overrides that select this candidate."""
        found = [
            f"strategy={self.strategy}",
            f"mesh.data={self.mesh.data}",
            f"mesh.model={self.mesh.model}",
        ]
        if self.config.strategy.layout != configured.strategy.layout:
            found.append(f"strategy.layout={self.config.strategy.layout}")
        if self.remat != configured.trainer.remat:
            found.append(f"trainer.remat={self.remat}")
        return " ".join(found)


@dataclass(frozen=True)
class Choice:
    candidates: tuple[Candidate, ...]  # as ranked: by remat, then estimated step time
    chosen: Candidate | None
    budget_bytes: float

    @property
    def config(self) -> RunConfig:
        if self.chosen is None:
            raise ConfigError(
                f"strategy=auto: no strategy and mesh fits the devices' "
                f"{self.budget_bytes / 1e9:g} GB by the compiled step, even with "
                "trainer.remat=full: use more devices, a smaller micro-batch or a smaller model"
            )
        return self.chosen.config


def choose(cfg: RunConfig) -> Choice:
    """The fastest candidate that fits plan.device_memory_gb by the compiled step."""
    budget = cfg.plan.device_memory_gb * 1e9
    spec = build_dataset(cfg.data).spec
    ranked, compiles = [], 0
    for remat in remat_levels(cfg.trainer.remat):
        level = sorted(
            _estimated(cfg, remat, spec),
            key=lambda candidate: candidate.estimate.step_seconds(cfg.plan),
        )
        for i, candidate in enumerate(level):
            promising = candidate.estimate.memory_bytes <= PROMISING * budget
            if promising and compiles < MAX_COMPILES:
                compiles += 1
                candidate = _compiled(candidate)
                if candidate.fits(budget):  # the slower ones are listed, not compiled
                    return Choice(tuple([*ranked, candidate, *level[i + 1 :]]), candidate, budget)
            ranked.append(candidate)
    return Choice(tuple(ranked), None, budget)


def remat_levels(configured: str) -> list[str]:
    """The configured remat, then each that recomputes more (none after a custom one)."""
    if configured not in REMAT_LEVELS:
        return [configured]
    return list(REMAT_LEVELS[REMAT_LEVELS.index(configured) :])


def _estimated(cfg: RunConfig, remat: str, spec) -> list[Candidate]:
    """The candidates with this remat that the batch and the model's layouts allow, each with
    the analytic estimate."""
    cluster, examples = cfg.cluster, cfg.trainer.micro_batch
    devices = cluster.hosts * cluster.devices_per_host
    found, refused = [], []
    for strategy, mesh in candidates(cfg.strategy, devices, cluster.devices_per_host):
        if examples % mesh.data or examples % cluster.hosts:
            continue
        if strategy.shards_over_data and mesh.data == 1:  # nothing to shard over: replicated
            continue
        try:
            config = candidate_config(cfg, strategy, mesh, remat)
            model = abstract_model(config, spec)
            estimate = strategy_cost(config, model, Strategy.of(config.strategy), mesh, examples)
        except ConfigError as error:  # a layout this mesh cannot take (fsdp's, the model's)
            refused.append(error)
            continue
        unchecked = stand_in_wrong(config, estimate.rules, model.trainable) or ""
        found.append(Candidate(config, mesh, estimate, estimated_only=unchecked))
    if refused and not found:  # not a layout's fault: the model and data do not go together
        raise refused[0]
    return found


def candidate_config(cfg: RunConfig, strategy: Strategy, mesh: MeshShape, remat: str) -> RunConfig:
    """The run's config with `strategy` on `mesh` and `remat`: what the run gets if chosen."""
    layout = cfg.strategy.layout
    if "model" not in strategy.axes and layout == AUTO_LAYOUT:  # derived rules need one
        layout = MODEL_LAYOUT
    return replace(
        cfg,
        strategy=replace(cfg.strategy, name=strategy.name, layout=layout),
        mesh=MeshConfig(data=mesh.data, model=mesh.model),
        trainer=replace(cfg.trainer, remat=remat),
    )


def _compiled(candidate: Candidate) -> Candidate:
    """The candidate with its compiled figures, or why the compiler gave none."""
    if candidate.estimated_only:
        return candidate
    try:
        return replace(candidate, compiled=compile_ahead_of_time(candidate.config, candidate.mesh))
    except OutOfDeviceMemory as error:  # an accelerator's compiler refuses what does not fit
        return replace(candidate, refused=str(error))


def is_auto(cfg: RunConfig) -> bool:
    return cfg.strategy.name == AUTO_STRATEGY
