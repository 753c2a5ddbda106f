"""`trainer.profile_steps=[first, last]`: a `jax.profiler` trace of those steps, one
directory per host under trainer.profile_dir, which TensorBoard's profile tab reads
(`tensorboard --logdir <run dir>`)."""

from __future__ import annotations

import os


class StepProfile:
    def __init__(self, steps: list[int], directory: str, host: int):
        self.first, self.last = steps if steps else (None, None)
        self.directory = os.path.join(directory, f"host_{host}") if steps else ""
        self.tracing = False

    def before(self, step: int) -> None:
        """Called before step `step` (1-based) is dispatched."""
        if step == self.first:
            import jax

            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory)
            self.tracing = True

    def after(self, step: int, done) -> None:
        """Called once step `step` is dispatched; `done`: an array the step made, waited
        for so that the trace holds the step's device work."""
        if self.tracing and step == self.last:
            import jax

            done.block_until_ready()
            jax.profiler.stop_trace()
            self.tracing = False

    def close(self) -> None:
        """A run that stopped inside the traced steps still writes what it traced."""
        if self.tracing:
            import jax

            jax.profiler.stop_trace()
            self.tracing = False
