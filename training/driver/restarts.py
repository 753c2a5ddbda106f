"""The restart policy: a host lost or silent may be recovered by a fresh host group that
resumes from the newest checkpoint, at most `fault.max_restarts` times; each restart is
recorded (summary.json's `failures`) with how long noticing and recovering took."""

from __future__ import annotations

import time

from training.config import FaultConfig
from training.driver.failures import HostFailure


class Restarts:
    """The restarts so far, each a record of the failure that caused it; a record's keys
    that start with `_` are the driver's own and stay out of the summary."""

    def __init__(self, fault: FaultConfig):
        self.fault = fault
        self.records: list[dict] = []

    def __len__(self) -> int:
        return len(self.records)

    def left(self) -> bool:
        return len(self.records) < self.fault.max_restarts

    def allow(self, failure: HostFailure) -> None:
        """Re-raise `failure` unless a fresh host group may recover from it."""
        allowed = self.fault.max_restarts
        if not failure.restartable or allowed == 0:
            raise failure
        if len(self.records) >= allowed:
            raise HostFailure(
                f"{failure}; no restart left (fault.max_restarts={allowed})"
            ) from failure

    def record(self, failure: HostFailure, reached: int, resume: int, spare: bool) -> None:
        self.records.append(
            {
                "error": str(failure),
                "failed_at_step": reached,
                "resumed_from_step": resume,
                "steps_redone": max(reached - resume, 0),
                # From the failed host's last report to the supervisor noticing.
                "detection_seconds": failure.silent_s,
                # From noticing (before the failed group is stopped) to the fresh group's
                # first step, set when it reports; and when it reached each phase before.
                "recovery_seconds": None,
                # Whether a spare group, requested while the failed one trained, takes over.
                "spare_group": spare,
                # fault.elastic: the fresh group's hosts whose processes were started before
                # the failure (their libraries imported), holding no resources.
                "spare_processes": 0,
                "recovery_phases": {"failed_group_stopped": time.monotonic() - failure.noticed},
                "_detected": failure.noticed,
            }
        )

    def took_spare_processes(self, count: int) -> None:
        """The latest restart's fresh group took `count` spare processes."""
        self.records[-1]["spare_processes"] = count

    def reached(self, phase: str) -> None:
        """The fresh host group of the latest restart reached `phase`, if still recovering."""
        if self.records and "_detected" in (last := self.records[-1]):
            last["recovery_phases"].setdefault(phase, time.monotonic() - last["_detected"])

    def recovered(self) -> None:
        """The fresh host group finished its first step."""
        if self.records and self.records[-1]["recovery_seconds"] is None:
            last = self.records[-1]
            last["recovery_seconds"] = time.monotonic() - last.pop("_detected")

    def failures(self) -> list[dict]:
        return [{k: v for k, v in r.items() if not k.startswith("_")} for r in self.records]
