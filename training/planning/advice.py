"""What to change when a step does not fit a device: each change of one setting that holds
less per device (more rematerialisation, fsdp, more micro-batches, half the batch), compiled
ahead of time from abstract state as the hosts would compile it, so that the advice names
only what really fits, with the compiler's figure (`training.plan`, and the driver when a
host's step did not fit)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from training.config import ConfigError, RunConfig
from training.events import OutOfDeviceMemory
from training.parallel.dtypes import readable_bytes
from training.parallel.mesh import MeshShape
from training.parallel.strategy import Strategy
from training.planning.compiled import compile_ahead_of_time


@dataclass(frozen=True)
class Alternative:
    """One change of the run's config (its override) and what its compiled step needs per
    device; None where the compiler refused it as over a device's memory."""

    override: str
    needed: int | None

    def fits(self, budget_bytes: float) -> bool:
        return self.needed is not None and self.needed <= budget_bytes

    def described(self) -> str:
        if self.needed is None:
            return f"{self.override} (refused)"
        return f"{self.override} ({readable_bytes(self.needed)})"


def ways_to_hold_less(cfg: RunConfig, mesh: MeshShape) -> Iterator[tuple[str, RunConfig]]:
    """The changes of one setting that hold less per device: remat, fsdp, more
    micro-batches, half the batch; each as its override and the config it makes."""
    trainer, strategy = cfg.trainer, cfg.strategy
    chosen = Strategy.of(strategy)
    for mode in ("dots", "full"):
        if trainer.remat not in (mode, "full"):
            yield f"trainer.remat={mode}", replace(cfg, trainer=replace(trainer, remat=mode))
    if chosen.replicates and mesh.data > 1:
        yield "strategy=fsdp", replace(cfg, strategy=replace(strategy, name="fsdp"))
    if chosen.axes == ("data", "model") and not chosen.shards_over_data:
        yield "strategy.fsdp=true", replace(cfg, strategy=replace(strategy, fsdp=True))
    batch = trainer.global_batch
    for accumulate in (2 * trainer.accumulate, 4 * trainer.accumulate):
        if batch % accumulate == 0 and (batch // accumulate) % mesh.data == 0:
            yield (
                f"trainer.accumulate={accumulate}",
                replace(cfg, trainer=replace(trainer, accumulate=accumulate)),
            )
    half = batch // 2
    if trainer.micro_batch % 2 == 0 and (trainer.micro_batch // 2) % mesh.data == 0:
        yield (
            f"trainer.global_batch={half}",
            replace(cfg, trainer=replace(trainer, global_batch=half)),
        )


def what_fits(cfg: RunConfig, mesh: MeshShape, budget_bytes: float) -> str:
    """The ways to hold less that fit `budget_bytes` by their compiled steps, each with its
    figure; or that none does, with what each needs."""
    alternatives = compiled_alternatives(cfg, mesh)
    fits = [a for a in alternatives if a.fits(budget_bytes)]
    if fits:
        return "these fit by their compiled steps: " + ", ".join(a.described() for a in fits)
    tried = ", ".join(a.described() for a in alternatives)
    return (
        f"none of the changes of one setting fits by its compiled step ({tried or 'none'}): "
        "use more devices or a smaller model"
    )


def compiled_alternatives(cfg: RunConfig, mesh: MeshShape) -> list[Alternative]:
    """Every way to hold less, each compiled for `mesh` on this process's devices. A change
    the model or mesh cannot take (a layout that does not divide) is left out."""
    found = []
    for override, variant in ways_to_hold_less(cfg, mesh):
        try:
            needed = compile_ahead_of_time(variant, mesh).memory.needed
        except OutOfDeviceMemory:
            needed = None
        except ConfigError:
            continue
        found.append(Alternative(override, needed))
    return found
