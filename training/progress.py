"""Live progress on the driver: a rich progress bar on a terminal, plain lines elsewhere."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class ProgressDisplay:
    def __init__(self, total_steps: int, console: Console | None = None):
        self.console = console or Console()
        self.total_steps = total_steps
        self._bar: Progress | None = None
        self._task = None

    def __enter__(self) -> ProgressDisplay:
        if self.console.is_terminal:
            self._bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[speed]} ex/s"),
                TextColumn("slowest host {task.fields[slowest]}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._bar.add_task(
                "train", total=self.total_steps, loss="-", speed="-", slowest="-"
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

    def logged(self, record: dict) -> None:
        loss, speed = f"{record['loss']:.4f}", f"{record['examples_per_second']:,.0f}"
        slowest = record["slowest_host"]
        if not record["hosts_agree"]:
            self.console.print(
                f"warning: hosts disagree on the loss at step {record['step']}: "
                f"{record['per_host_loss']}",
                highlight=False,
            )
        if self._bar is not None:
            self._bar.update(
                self._task, completed=record["step"], loss=loss, speed=speed, slowest=slowest
            )
        else:
            self.console.print(
                f"step {record['step']}/{self.total_steps}  loss {loss}  "
                f"examples/s {speed}  slowest host {slowest}",
                highlight=False,
            )
