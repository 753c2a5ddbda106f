"""What the driver shows: live progress (a rich bar on a terminal, plain lines elsewhere) and
the run's closing summary with the device → host map."""

from __future__ import annotations

import os
from datetime import timedelta

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from training.driver.elastic import described
from training.driver.metrics import metric_names

# Without a terminal, a phase other than training is told once it has lasted this long.
PHASE_NOTICE_SECONDS = 10.0


class ProgressDisplay:
    def __init__(self, total_steps: int, console: Console | None = None):
        self.console = console or Console()
        self.total_steps = total_steps
        if not self.console.is_terminal:
            # Ray colours the prefix of the hosts' streamed output even when it is piped.
            os.environ.setdefault("RAY_COLOR_PREFIX", "0")
        self._bar: Progress | None = None
        self._task = None
        self._told: dict[int, str] = {}  # host -> the phase last told of, without a terminal
        self._mesh = ""  # after fault.elastic changed the mesh: the one trained on now

    def __enter__(self) -> ProgressDisplay:
        if self.console.is_terminal:
            self._bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[speed]} ex/s{task.fields[device]}"),
                TextColumn("slowest host {task.fields[slowest]}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[mesh]}{task.fields[phases]}"),
                console=self.console,
            )
            self._task = self._bar.add_task(
                "train",
                total=self.total_steps,
                loss="-",
                speed="-",
                device="",
                slowest="-",
                mesh="",
                phases="",
            )
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def advance_to(self, step: int) -> None:
        """Steps all hosts have passed, between logged steps."""
        if self._bar is not None:
            self._bar.update(self._task, completed=step)

    def phases(self, not_stepping: list[tuple[int, str, float]]) -> None:
        """What hosts do while not stepping, as (host, phase, seconds in it): live on a
        terminal ("host 1 compiling, 42 s"); elsewhere one line per host and phase once the
        phase has lasted PHASE_NOTICE_SECONDS, hosts in the same phase on one line."""
        if self._bar is not None:
            shown = "; ".join(f"host {h} {phase}, {s:.0f} s" for h, phase, s in not_stepping)
            self._bar.update(self._task, phases=shown)
            return
        current = {host: phase for host, phase, _ in not_stepping}
        self._told = {h: p for h, p in self._told.items() if current.get(h) == p}
        due: dict[str, list[tuple[int, float]]] = {}
        for host, phase, seconds in not_stepping:
            if seconds >= PHASE_NOTICE_SECONDS and host not in self._told:
                due.setdefault(phase, []).append((host, seconds))
                self._told[host] = phase
        for phase, hosts in due.items():
            names = ", ".join(str(h) for h, _ in hosts)
            self.console.print(
                f"{'hosts' if len(hosts) > 1 else 'host'} {names} {phase}, "
                f"{max(s for _, s in hosts):.0f} s",
                highlight=False,
                soft_wrap=True,
            )

    def mesh_changed(self, change: dict) -> None:
        """fault.elastic trains on another mesh from a step (`elastic.mesh_change`): the
        progress line names it from then on."""
        mesh = change["mesh"]
        self._mesh = f"  mesh {mesh['data']}×{mesh['model']} on {change['hosts']} hosts"
        if self._bar is not None:
            self._bar.update(self._task, mesh=self._mesh)

    def logged(self, record: dict) -> None:
        loss = f"{record['loss']:.4f}" + "".join(
            f"  {name} {record[name]:.4f}" for name in metric_names([record])
        )
        speed = f"{record['examples_per_second']:,.0f}"
        device = _per_device(record)
        slowest = _slowest_host(record)
        if "eval_loss" in record:
            self.console.print(
                f"step {record['step']}: held-out {_held_out(record)}",
                highlight=False,
                soft_wrap=True,
            )
        if self._bar is not None:
            self._bar.update(
                self._task,
                completed=record["step"],
                loss=loss,
                speed=speed,
                device=device,
                slowest=slowest,
            )
        else:
            self.console.print(
                f"step {record['step']}/{self.total_steps}  loss {loss}  "
                f"examples/s {speed}{device}  eta {self._eta(record)}  slowest host {slowest}"
                f"{self._mesh}",
                highlight=False,
                soft_wrap=True,  # one line per logged step, however narrow the log viewer
            )

    def _eta(self, record: dict) -> timedelta:
        """The steps left at the slowest host's pace over the last logged interval."""
        step_seconds = max(record["per_host_step_seconds"])
        return timedelta(seconds=round((self.total_steps - record["step"]) * step_seconds))


def _per_device(record: dict, between: str = "  ") -> str:
    """Tokens/s, model TFLOP/s and MFU per device, and the most a device has held, where
    known (a record's or the summary's figures)."""
    shown = []
    if "tokens_per_second_per_device" in record:
        shown.append(f"tokens/s/device {record['tokens_per_second_per_device']:,.0f}")
    if record.get("model_tflops_per_device"):
        shown.append(f"TFLOP/s/device {record['model_tflops_per_device']:.3g}")
    if "mfu" in record:
        shown.append(f"MFU {record['mfu']:.2f}")
    if "device_peak_memory_bytes" in record:
        shown.append(f"peak memory {record['device_peak_memory_bytes'] / 1e9:.2f} GB")
    return "".join(f"{between}{item}" for item in shown)


def _slowest_host(record: dict) -> str:
    host = record["slowest_host"]
    seconds = record["per_host_step_seconds"][host]
    pace = f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"
    return f"{host} ({pace}/step)"


def print_summary(summary: dict, console: Console) -> None:
    mesh = summary["mesh"]
    within = "yes" if summary["model_groups_within_hosts"] else "no: model groups span hosts"
    lines = [
        f"{summary['strategy']} on mesh data × model = {mesh['data']} × {mesh['model']} "
        f"({_count(summary['hosts'], 'host')} × {summary['devices_per_host']} devices; "
        f"model axis inside hosts: {within})",
    ]
    for host, (rows, devices) in sorted(_devices_by_host(summary).items()):
        lines.append(f"  host {host}: data rows {rows}, devices {devices}")
    lines.append(
        f"final loss {summary['final_loss']:.4f} · {summary['examples_per_second']:,.0f} "
        f"examples/s{_per_device(summary, ' · ')} · {summary['wall_seconds']:.1f}s · parameters "
        f"{summary['parameter_bytes_per_device']:,} bytes per device of "
        f"{summary['parameter_bytes_total']:,} ({summary['parameter_bytes_replicated']:,} "
        "replicated on every device)"
    )
    if summary["eval_loss"] is not None:
        held_out = f"held-out {_held_out(summary)}"
        if summary["baseline_eval_loss"] is not None:
            held_out += f" · baseline (label frequencies only) {summary['baseline_eval_loss']:.4f}"
        lines.append(held_out)
    if (early := summary.get("early_stopping")) and early["stopped_at_step"] is not None:
        lines.append(
            f"stopped early at step {early['stopped_at_step']}: {early['metric']} did not "
            f"improve on {early['best']:.4f} (step {early['best_step']})"
        )
    if summary.get("best_checkpoint"):
        step, figure = summary["best_checkpoint"]
        by = summary["config"]["checkpoint"]["keep_best"]
        lines.append(f"best checkpoint: step {step} ({by} {figure:.4f})")
    for change in summary.get("mesh_changes", [])[1:]:
        lines.append(f"mesh changed ({change['why']}) {described(change)}")
    if "checkpoint_step" in summary:
        lines.append(
            f"checkpoint: step {summary['checkpoint_step']} in {summary['checkpoint_dir']} "
            f"({_stored_bytes(summary['checkpoint_bytes'])}) · resumed from step "
            f"{summary['resumed_from_step']} · {_count(summary['restarts'], 'restart')}"
        )
    console.print("\n".join(lines), highlight=False, soft_wrap=True)


def _held_out(figures: dict) -> str:
    """`loss 0.4321 · accuracy 0.8750 · perplexity 1.54` from a record's or the summary's
    `eval_*` figures."""
    shown = {
        key.removeprefix("eval_"): value
        for key, value in sorted(figures.items(), key=lambda item: item[0] != "eval_loss")
        if key.startswith("eval_") and isinstance(value, float)
    }
    return " · ".join(f"{name} {value:.4f}" for name, value in shown.items())


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _devices_by_host(summary: dict) -> dict[int, tuple[list[int], list[int]]]:
    """host -> (the mesh's data rows it holds devices in, its devices in mesh order)."""
    by_host: dict[int, tuple[list[int], list[int]]] = {}
    for row_index, row in enumerate(summary["mesh_devices"]):
        for device in row:
            rows, devices = by_host.setdefault(summary["device_hosts"][device], ([], []))
            if row_index not in rows:
                rows.append(row_index)
            devices.append(device)
    return by_host


def print_parameters(parameters: dict[str, int], console: Console) -> None:
    """How many parameters the model has, and how many of them train
    (`training.build.count_parameters`)."""
    total, trained = parameters["parameters"], parameters["parameters_trained"]
    share = "all trained" if trained == total else f"{trained:,} trained ({trained / total:.2%})"
    console.print(f"parameters: {total:,}, {share}", highlight=False)


def print_warnings(warnings, console: Console) -> None:
    for warning in warnings:
        console.print(f"warning: {warning}", style="yellow", markup=False)


def print_layout(layout, console: Console) -> None:
    """The rules `strategy.layout=auto` chose, with why and as one override to copy: soft
    wrapped, since a hard wrap would put newlines into the override."""
    console.print(layout.describe(), markup=False, highlight=False, soft_wrap=True)


def print_choice(choice, configured, console: Console) -> None:
    """What `strategy=auto` chose from (`training.planning.auto.Choice`): each candidate's
    compiled memory per device (or `-` where it was not compiled), its estimated step time,
    whether it fits; then the choice and the overrides that reproduce it."""
    from rich.table import Table

    from training.parallel.dtypes import readable_bytes

    table = Table(
        title=f"strategy=auto: the fastest that fits {choice.budget_bytes / 1e9:g} GB per device "
        "by the compiled step",
        title_justify="left",
        box=None,
        pad_edge=False,
    )
    table.add_column("strategy", no_wrap=True)
    for column in ("mesh", "remat", "compiled", "estimated", "step (est.)", "fits"):
        table.add_column(column, justify="right", no_wrap=True)
    for candidate in choice.candidates:
        fits = candidate.fits(choice.budget_bytes)
        compiled = candidate.compiled
        table.add_row(
            f"{candidate.strategy}{' *' if candidate is choice.chosen else ''}",
            f"{candidate.mesh.data}×{candidate.mesh.model}",
            candidate.remat,
            readable_bytes(compiled.memory.needed) if compiled else "-",
            readable_bytes(candidate.estimate.memory_bytes),
            f"{candidate.estimate.step_seconds(configured.plan) * 1e3:.3g}ms",
            {True: "yes", False: "no", None: "-"}[fits],
        )
    console.print(table)
    console.print(
        "compiled: what the hosts' step needs of a device by XLA's memory_analysis() (- not "
        "compiled); estimated: the analytic plan's memory, which ranks the candidates with "
        "its step time; * chosen",
        markup=False,
    )
    for candidate in choice.candidates:
        if candidate.estimated_only:
            console.print(
                f"{candidate.override(configured)}: by its estimate ({candidate.estimated_only})",
                markup=False,
                soft_wrap=True,
            )
        if candidate.refused:
            console.print(
                f"{candidate.override(configured)}: the compiler refused it ({candidate.refused})",
                markup=False,
                soft_wrap=True,
            )
    if choice.chosen is not None:
        console.print(
            f"strategy=auto chose: {choice.chosen.override(configured)}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )


def _stored_bytes(count: int | None) -> str:
    """A checkpoint's bytes in storage; None where the driver could not list them."""
    return "size unknown" if count is None else f"{count:,} bytes"
