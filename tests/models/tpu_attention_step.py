"""Run by test_attention.py in a process of its own, where JAX may open the TPU: the
transformer's training step compiled on one device (seq 1024, bfloat16, the attention left to
choose its kernel), and what its HLO holds. Prints one JSON line: the platform, the number of
Pallas TPU custom calls, and the HLO arrays shaped as the (batch, heads, seq, seq) scores.
(Not conftest.py's config helper: importing it keeps JAX to the CPU.)"""

import json
import os
import re

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402

from training.build import build_on_grid  # noqa: E402
from training.config import compose_run_config  # noqa: E402
from training.parallel.mesh import MeshShape, device_grid  # noqa: E402
from training.planning.compiled import compiled_train_step  # noqa: E402

BATCH, HEADS, SEQ = 4, 4, 1024
OVERRIDES = [
    "strategy=data_parallel",
    "model=transformer",
    "data=text",
    "model.kwargs.layers=2",
    "model.kwargs.d_model=256",
    f"model.kwargs.heads={HEADS}",
    "model.kwargs.d_ff=1024",
    f"model.seq_len={SEQ}",
    f"trainer.global_batch={BATCH}",
    "trainer.precision=bfloat16",
    "hydra/launcher=basic",  # the project's launcher imports Ray, which a TPU machine lacks
]


def main() -> None:
    platform = jax.devices()[0].platform
    found = {"platform": platform, "tpu_custom_calls": 0, "scores": []}
    if platform == "tpu":
        model, dataset = build_on_grid(
            compose_run_config(OVERRIDES), device_grid(jax.devices()[:1], MeshShape(1, 1))
        )
        x, y = dataset.batch("train", 0, BATCH, slice(0, BATCH))
        model.train_on_batch(x, y)
        hlo = compiled_train_step(model, x, y).as_text()
        found["tpu_custom_calls"] = hlo.count('custom_call_target="tpu_custom_call"')
        found["scores"] = sorted(set(re.findall(rf"\w+\[{BATCH},{HEADS},{SEQ},{SEQ}\]", hlo)))
    print(json.dumps(found))


if __name__ == "__main__":
    main()
