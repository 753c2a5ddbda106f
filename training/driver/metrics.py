"""Hosts' logged steps -> one record per logged step (metrics.jsonl); the throughput figures
summary.json gives."""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from training.events import StepLogged

# exp() of a larger loss overflows a float: such a perplexity is shown as exp(700).
MAX_LOG_PERPLEXITY = 700.0


@dataclass
class Throughput:
    """What turns rows (a batch's examples) per second into the figures compared across runs
    and hardware: examples per second where a row holds several (packed), tokens per second
    per device (tokens that are not padding, where the data knows them), model TFLOP/s per
    device (`training.models.flops`, of every position of a row) and model FLOPs utilisation
    against the devices' peak (unknown until the hosts name their devices, or given as
    plan.peak_tflops)."""

    devices: int
    positions_per_example: int = 1
    flops_per_example: float = 0.0
    peak_tflops: float | None = None
    examples_per_row: float = 1.0
    tokens_per_row: float | None = None

    def figures(self, rows_per_second: float) -> dict:
        per_device = rows_per_second / self.devices
        tflops = per_device * self.flops_per_example / 1e12
        found = {"model_tflops_per_device": tflops}
        if self.examples_per_row != 1.0:
            found["examples_per_second"] = rows_per_second * self.examples_per_row
        if self.positions_per_example > 1:
            tokens = self.tokens_per_row or self.positions_per_example
            found["tokens_per_second_per_device"] = per_device * tokens
        if self.peak_tflops:
            found["mfu"] = tflops / self.peak_tflops
        return found


class MetricsLog:
    """Joins the hosts' StepLogged events of each step and appends the joined record to a file."""

    def __init__(
        self,
        hosts: int,
        path: Path,
        perplexity: bool = True,
        throughput: Throughput | None = None,
    ):
        self.hosts = hosts
        self.perplexity = perplexity  # exp(loss) means something for token prediction only
        self.throughput = throughput
        self.records: list[dict] = []
        self._pending: dict[int, dict[int, StepLogged]] = defaultdict(dict)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a")

    def add(self, host: int, logged: StepLogged) -> dict | None:
        """Take one host's logged step; return the joined record once all hosts sent it."""
        step = logged.step
        self._pending[step][host] = logged
        if len(self._pending[step]) < self.hosts:
            return None
        by_host = self._pending.pop(step)
        record = join_logged_steps(
            [by_host[h] for h in range(self.hosts)], self.perplexity, self.throughput
        )
        self.records.append(record)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        return record

    def rewind(self, step: int) -> None:
        """Forget records after `step` and half-joined steps: a fresh host group redoes
        them from the checkpoint at `step`. The file keeps every row as it was logged."""
        self.records = [r for r in self.records if r["step"] <= step]
        self._pending.clear()

    def close(self) -> None:
        self._file.close()


def join_logged_steps(
    logged: list[StepLogged], perplexity: bool = True, throughput: Throughput | None = None
) -> dict:
    """One record of a logged step from every host's. The loss and the metrics are of
    global arrays, the same on every host: host 0's are the step's."""
    step_seconds = [r.seconds / r.steps for r in logged]
    interval_seconds = max(r.seconds for r in logged)
    examples = sum(r.examples for r in logged)
    peaks = [r.device_peak_bytes for r in logged if r.device_peak_bytes is not None]
    return {
        "step": logged[0].step,
        "loss": logged[0].loss,
        **logged[0].metrics,
        "examples_per_second": examples / interval_seconds,
        **(throughput.figures(examples / interval_seconds) if throughput else {}),
        **({"device_peak_memory_bytes": max(peaks)} if peaks else {}),
        "per_host_step_seconds": step_seconds,
        "slowest_host": max(range(len(logged)), key=step_seconds.__getitem__),
        "interval_examples": examples,
        "interval_seconds": interval_seconds,
        "learning_rate": logged[0].learning_rate,
        # Each host's example ids of this step: which rows of the data it really read.
        "rows_fed": [r.rows_fed for r in logged],
        **_held_out(logged[0].held_out, perplexity),
    }


def _held_out(held_out: dict[str, float] | None, perplexity: bool) -> dict:
    """`eval_<name>` for the held-out loss and each metric, where the hosts evaluated at
    this step; perplexity for token prediction."""
    if held_out is None:
        return {}
    record = {f"eval_{name}": value for name, value in held_out.items()}
    if perplexity:
        record["eval_perplexity"] = math.exp(min(held_out["loss"], MAX_LOG_PERPLEXITY))
    return record


# A record's fields besides the compiled metrics and the held-out `eval_*` figures.
RECORD_FIELDS = (
    "step",
    "loss",
    "examples_per_second",
    "tokens_per_second_per_device",
    "model_tflops_per_device",
    "mfu",
    "device_peak_memory_bytes",
    "per_host_step_seconds",
    "slowest_host",
    "interval_examples",
    "interval_seconds",
    "learning_rate",
    "rows_fed",
)


def metric_names(records: list[dict]) -> list[str]:
    """The compiled metrics the records hold, by name (`accuracy`), in their order."""
    if not records:
        return []
    last = records[-1]
    return [k for k in last if k not in RECORD_FIELDS and not k.startswith("eval_")]


def _steady(records: list[dict]) -> list[dict]:
    """The records after the first logged interval, which also pays for compilation."""
    return records[1:] or records


def steady_examples_per_second(records: list[dict]) -> float | None:
    seconds = sum(r["interval_seconds"] for r in _steady(records))
    return sum(r["interval_examples"] for r in _steady(records)) / seconds if seconds else None


def steady_throughput(records: list[dict], throughput: Throughput | None) -> dict:
    """The throughput figures over the steady records, and the devices' peak memory."""
    found = {}
    rate = steady_examples_per_second(records) if records else None
    if throughput and rate:
        found.update(throughput.figures(rate))
    peaks = [r["device_peak_memory_bytes"] for r in records if "device_peak_memory_bytes" in r]
    if peaks:
        found["device_peak_memory_bytes"] = max(peaks)
    return found


def per_host_step_seconds(records: list[dict]) -> list[float]:
    """Each host's median step time over the steady records of the hosts the run ends with
    (fault.elastic may have trained on more before)."""
    hosts = len(records[-1]["per_host_step_seconds"])
    last_hosts = [r for r in records if len(r["per_host_step_seconds"]) == hosts]
    per_host = zip(*(r["per_host_step_seconds"] for r in _steady(last_hosts)), strict=True)
    return [statistics.median(times) for times in per_host]


def write_json(path: Path, payload: dict) -> None:
    """Write through a temporary file so a reader never sees half a summary."""
    partial = path.with_suffix(path.suffix + ".partial")
    partial.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    partial.replace(path)
