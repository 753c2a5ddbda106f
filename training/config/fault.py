"""`fault`: how stuck or lost hosts and bad losses are caught, and what follows."""

from __future__ import annotations

from dataclasses import dataclass

from training.config.common import require

NAN_POLICIES = ("stop",)


@dataclass
class FaultConfig:
    # Hosts beat every second with what they are doing (training.host.phases); a host is declared
    # stuck when a phase outlasts its bound (JAX's own heartbeat only catches dead processes,
    # and Ray's timeouts are tens of minutes). From a host's start to its first step
    # (joining the jax.distributed cluster, building, restoring, compiling):
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
    # The seconds a preempted machine's processes have between the notice (SIGTERM, GCE's
    # metadata, Ray draining the node) and their end (about 30 on GCE and GKE): the hosts
    # checkpoint at the next step all reach, and the summary says whether that save
    # finished within it.
    preemption_grace_s: float = 25.0
    # After a lost host, a replacement group that cannot be placed within replace_timeout_s
    # makes the run go on with fewer hosts (training.driver.elastic): the data axis shrinks,
    # trainer.accumulate grows so the global batch and the order of examples stay, and the
    # state is resharded from the newest checkpoint. Each such restart counts against
    # fault.max_restarts. Meanwhile the driver asks Ray for the hosts it lacks; once they
    # are placed, the hosts checkpoint at the next step all reach and the run grows back
    # to the configured hosts and trainer.accumulate from that checkpoint (no restart).
    elastic: bool = False
    replace_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        require(self.startup_timeout_s > 0, "fault.startup_timeout_s must be > 0")
        require(self.step_timeout_s > 0, "fault.step_timeout_s must be > 0")
        require(self.max_restarts >= 0, "fault.max_restarts must be >= 0")
        require(self.preemption_grace_s > 0, "fault.preemption_grace_s must be > 0")
        require(self.replace_timeout_s > 0, "fault.replace_timeout_s must be > 0")
        require(
            not self.elastic or self.max_restarts > 0,
            "fault.elastic=true needs fault.max_restarts > 0: going on with fewer hosts is a "
            "restart",
        )
        require(
            self.on_nan in NAN_POLICIES,
            f"fault.on_nan={self.on_nan!r} is not one of {', '.join(NAN_POLICIES)}",
        )
