"""summary.json: what a run did, in one place. Built from the config, the driver's checks,
the joined metrics, what the driver saw of the hosts (`Observed`), the restarts and the
hosts' results; written when the run ends, also when it fails."""

from __future__ import annotations

import signal
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

from training.accelerators import peak_tflops
from training.checkpoint.inspection import newest_step
from training.checkpoint.storage import directory_bytes
from training.config import RunConfig
from training.driver.checked import Checked
from training.driver.metrics import (
    Throughput,
    metric_names,
    per_host_step_seconds,
    steady_examples_per_second,
    steady_throughput,
    write_json,
)
from training.driver.restarts import Restarts
from training.models import SPLIT_THRESHOLD_BYTES


@dataclass
class Observed:
    """What the driver saw of the run while it went, for the summary."""

    started: float = field(default_factory=time.perf_counter)
    started_at: float = field(default_factory=time.time)
    timings: dict[str, float] = field(default_factory=dict)  # phase -> seconds in when reached
    identities: list[dict] = field(default_factory=list)
    compiles: dict[int, dict] = field(default_factory=dict)  # host -> step's compile, cache
    # Where the run's first host group resumed, as the hosts saw checkpoint.dir (on a
    # cluster the driver may not see it at all).
    resumed_from_step: int | None = None
    coordinator: str | None = None  # the jax.distributed coordinator's address (host 0)
    throughput: Throughput | None = None
    device_kind: str | None = None  # JAX's name of the hosts' devices
    device_memory_limit: int | None = None  # bytes a device may hold (None: not said)
    # Each mesh the run trained on from a step (training.driver.elastic.mesh_change): the
    # first from the start, then one for each time fault.elastic shrank the run ("host
    # lost") or grew it back ("capacity returned").
    mesh_changes: list[dict] = field(default_factory=list)

    def saw_devices(self, kind: str, memory_limit: int | None) -> None:
        """A host's devices: their kind gives the peak MFU is measured against, unless
        plan.peak_tflops gave it."""
        self.device_kind, self.device_memory_limit = kind, memory_limit
        if self.throughput is not None and self.throughput.peak_tflops is None:
            self.throughput.peak_tflops = peak_tflops(kind)

    def mark(self, phase: str, latest: bool = False) -> None:
        """The run reached `phase`: the first time counts, or with `latest` the last."""
        seconds = time.perf_counter() - self.started
        if latest:
            self.timings[phase] = seconds
        self.timings.setdefault(phase, seconds)


def run_status(results: list[dict], steps: int) -> str:
    """`completed` (trained to trainer.steps, or stopped early by trainer.early_stopping),
    or `preempted` (stopped by a signal or a notice, checkpointed)."""
    reached = min(r["reached_step"] for r in results)
    stopped_early = (results[0]["early_stopping"] or {}).get("stopped_at_step")
    return "completed" if reached >= steps or stopped_early == reached else "preempted"


def build_summary(
    status: str,
    cfg: RunConfig,
    checked: Checked,
    seen: Observed,
    records: list[dict],
    rows_checked_steps: int,
    restarts: Restarts,
    results: list[dict],
    stop_signal: int | None,
    error: BaseException | None = None,
) -> dict:
    """summary.json's dict; `records`: the joined logged steps; `results`: each host's
    return (none after a failure)."""
    built = {
        "status": status,
        "strategy": cfg.strategy.name,
        "mesh": checked.mesh.as_dict(),
        "hosts": checked.hosts,
        "devices_per_host": checked.devices_per_host,
        "devices_total": checked.mesh.devices,
        "steps": cfg.trainer.steps,
        "global_batch": cfg.trainer.global_batch,
        "loss_history": [r["loss"] for r in records],
        "logged_steps": [r["step"] for r in records],
        "final_loss": records[-1]["loss"] if records else None,
        "per_host_final_loss": [r["final_loss"] for r in results],
        # Logged steps at which every host fed exactly its rows of the global batch.
        "rows_fed_checked_steps": rows_checked_steps,
        **_metrics_summary(records),
        **_held_out_summary(records, checked.data_spec.baseline_loss),
        "examples_per_second": steady_examples_per_second(records) if records else None,
        **steady_throughput(records, seen.throughput),
        "device_kind": seen.device_kind,
        "device_peak_tflops": seen.throughput.peak_tflops if seen.throughput else None,
        "device_memory_limit_bytes": seen.device_memory_limit,
        "model_flops_per_example": checked.flops_per_example,
        "per_host_step_seconds": per_host_step_seconds(records) if records else None,
        "wall_seconds": time.perf_counter() - seen.started,
        # Wall-clock times, comparable across the trials of a sweep.
        "started_at": seen.started_at,
        "finished_at": time.time(),
        "phase_seconds": seen.timings,
        **_compile_summary(seen.compiles),
        "host_identities": seen.identities,
        "coordinator": seen.coordinator,
        # Each GPU taking part (nvidia-smi index, kind, memory) with the host holding it.
        "gpus": [
            {"host": identity["host"], **gpu}
            for identity in seen.identities
            for gpu in identity.get("gpus") or []
        ],
        "resumed_from_step": (
            seen.resumed_from_step
            if seen.resumed_from_step is not None
            else checked.resume_step or 0
        ),
        "restarts": len(restarts),
        "failures": restarts.failures(),
        "mesh_changes": seen.mesh_changes,
        **_checkpoint_summary(cfg, results, stop_signal),
        "config": asdict(cfg),
    }
    if results:
        built.update(_layout_summary(results[0]))
        # The trained model in Keras' format (training.checkpoint.export), where written.
        built["exported_model"] = results[0]["exported"]
        # A keras-hub model in the transformers format and its LoRA as a PEFT adapter
        # (training.checkpoint.hf_export): their paths, and why either was not written;
        # None for another model.
        built["hf_export"] = results[0]["hf_export"]
        built["early_stopping"] = results[0]["early_stopping"]
        # This run's best checkpoint by checkpoint.keep_best, [step, figure], kept by orbax.
        built["best_checkpoint"] = results[0]["best_checkpoint"]
    if error is not None:
        built["error"] = f"{type(error).__name__}: {error}"
        built["traceback"] = traceback.format_exception(error)
    return built


def nothing_left_summary(cfg: RunConfig, checked: Checked, figures: dict) -> dict:
    """summary.json of a run whose newest checkpoint already reaches trainer.steps: it is
    complete, with the figures its record kept, and trained nothing now."""
    return {
        "status": "completed",
        "nothing_left_to_train": True,
        "strategy": cfg.strategy.name,
        "mesh": checked.mesh.as_dict(),
        "steps": cfg.trainer.steps,
        "checkpoint_dir": cfg.checkpoint.dir,
        "checkpoint_step": checked.resume_step,
        "resumed_from_step": checked.resume_step,
        "final_loss": None,
        "eval_loss": None,
        **figures,
        "metric_names": [
            k.removeprefix("final_")
            for k in figures
            if k.startswith("final_") and k != "final_loss"
        ],
        "logged_steps": [],
        "loss_history": [],
        "wall_seconds": 0.0,
        "config": asdict(cfg),
    }


def write_summary(output_dir: Path, summary: dict) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    write_json(output_dir / "summary.json", summary)


def _compile_summary(compiles: dict[int, dict]) -> dict:
    """How long the (latest host group's) train step took to compile, and whether the
    persistent compilation cache served it: `miss` if any host compiled afresh, `hit` if
    every host loaded it, `off` if no host used a cache."""
    hosts = [compiles[h] for h in sorted(compiles)]
    if not hosts:
        return {}
    outcomes = {h["compile_cache"] for h in hosts}
    overall = "miss" if "miss" in outcomes else "hit" if outcomes == {"hit"} else "off"
    needs = [h["step_memory_bytes"] for h in hosts if h.get("step_memory_bytes") is not None]
    return {
        "compile_seconds": max(h["compile_seconds"] for h in hosts),
        "compile_cache": overall,
        # What the compiled step needs of a device, the state and the next batch included.
        "step_memory_bytes": max(needs) if needs else None,
        "per_host_compile": hosts,
    }


def _checkpoint_summary(cfg: RunConfig, results: list[dict], stop_signal: int | None) -> dict:
    if not cfg.checkpoint.enabled:
        return {}
    summary = {"checkpoint_dir": cfg.checkpoint.dir}  # absolute, or a bucket URL
    if results and (step := newest_step(cfg.checkpoint)) is not None:
        summary["checkpoint_step"] = step
        summary["checkpoint_bytes"] = directory_bytes(cfg.checkpoint, step)
    summary.update(preemption_summary(cfg, results, stop_signal))
    return summary


# What a host's stop without a notice it knew of came from: JAX's own handler took the
# SIGTERM (`training.host.preemption`).
UNNAMED_NOTICE = "SIGTERM to a host's process"


def preemption_summary(cfg: RunConfig, results: list[dict], stop_signal: int | None) -> dict:
    """Who stopped the run and when: the driver's signal (`stopped_by`: its name), or a
    notice to the hosts (`stopped_by`: what they saw), the step every host saved at, and
    the seconds from when a host knew to its checkpoint saved, against the grace."""
    stops = [r["preemption"] for r in results if r.get("preemption")]
    if not stops:
        return {"stopped_by": signal.Signals(stop_signal).name} if stop_signal else {}
    notices = sorted({n for stop in stops for n in stop["notices"]}) or [UNNAMED_NOTICE]
    saved_seconds = max(stop["saved_seconds"] for stop in stops)
    return {
        "stopped_by": signal.Signals(stop_signal).name if stop_signal else "; ".join(notices),
        "preemption": {
            "by": "driver" if stop_signal else "hosts",
            "step": min(r["reached_step"] for r in results),
            "notices": notices,
            "saved_seconds": saved_seconds,
            "grace_seconds": cfg.fault.preemption_grace_s,
            "within_grace": saved_seconds <= cfg.fault.preemption_grace_s,
        },
    }


def _metrics_summary(records: list[dict]) -> dict:
    """Each compiled metric's last logged value (`final_<name>`) and its history."""
    names = metric_names(records)
    return {
        "metric_names": names,
        **{f"final_{name}": records[-1][name] for name in names},
        "metric_history": {name: [r[name] for r in records] for name in names},
    }


def _held_out_summary(records: list[dict], baseline_loss: float) -> dict:
    evaluated = [r for r in records if "eval_loss" in r]
    last = evaluated[-1] if evaluated else {}
    held_out = {key: value for key, value in last.items() if key.startswith("eval_")}
    return {
        "eval_loss": None,
        "eval_perplexity": None,
        **held_out,
        "eval_history": [[r["step"], r["eval_loss"]] for r in evaluated],
        # What a model that knows only the training labels' frequencies scores held out.
        "baseline_eval_loss": baseline_loss,
    }


def _layout_summary(result: dict) -> dict:
    variables, optimizer = result["variables"], result["optimizer_variables"]
    replicated = {p: v for p, v in variables.items() if v["shard_bytes"] == v["bytes"]}
    return {
        "variable_shardings": {path: v["spec"] for path, v in variables.items()},
        "variables": variables,
        # Weights' elements (not random seeds' state); fewer train where some are frozen
        # (LoRA trains its own matrices only).
        "parameters": result["parameters"],
        "parameters_trained": result["parameters_trained"],
        "parameter_bytes_total": sum(v["bytes"] for v in variables.values()),
        "parameter_bytes_per_device": sum(v["shard_bytes"] for v in variables.values()),
        "parameter_bytes_replicated": sum(v["bytes"] for v in replicated.values()),
        "replicated_above_threshold": sorted(
            p for p, v in replicated.items() if v["bytes"] > SPLIT_THRESHOLD_BYTES
        ),
        # What has optimizer state (only what trains: LoRA's matrices under LoRA).
        "optimizer_variables": sorted(optimizer),
        "optimizer_bytes_total": sum(v["bytes"] for v in optimizer.values()),
        "optimizer_bytes_per_device": sum(v["shard_bytes"] for v in optimizer.values()),
        "mesh_devices": result["mesh_devices"],
        "device_hosts": result["device_hosts"],
        "model_groups_within_hosts": result["model_groups_within_hosts"],
    }
