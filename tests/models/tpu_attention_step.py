"""Run by test_attention.py and test_hub_attention.py in a process of its own, where JAX may
open the TPU: a model's training step compiled on one device (seq 1024, bfloat16, the
attention left to choose its kernel), and what its HLO holds. The model: `transformer` (the
built-in) or `hub` (a keras-hub Llama with grouped-query attention and LoRA), the first
argument; further arguments are overrides. Prints one JSON line: the platform, the number
of Pallas TPU custom calls, and the HLO's floating-point arrays shaped as attention scores
(batch, heads..., seq, seq). (Not conftest.py's config helper: importing it keeps JAX to the
CPU.)"""

import json
import os
import re
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402

from training.build import build_on_grid  # noqa: E402
from training.config import compose_run_config  # noqa: E402
from training.parallel.mesh import MeshShape, device_grid  # noqa: E402
from training.planning.compiled import compiled_train_step  # noqa: E402

BATCH, SEQ = 4, 1024
COMMON = [
    "strategy=data_parallel",
    "data=text",
    f"model.seq_len={SEQ}",
    f"trainer.global_batch={BATCH}",
    "trainer.precision=bfloat16",
    "hydra/launcher=basic",  # the project's launcher imports Ray, which a TPU machine lacks
]
MODELS = {
    "transformer": [
        "model=transformer",
        "model.kwargs.layers=2",
        "model.kwargs.d_model=256",
        "model.kwargs.heads=4",
        "model.kwargs.d_ff=1024",
    ],
    "hub": [
        "model=hub",
        "model.backbone=LlamaBackbone",
        "model.lora_rank=4",
        "model.kwargs.vocabulary_size=256",
        "model.kwargs.num_layers=2",
        "model.kwargs.num_query_heads=8",
        "model.kwargs.num_key_value_heads=2",
        "model.kwargs.hidden_dim=1024",
        "model.kwargs.intermediate_dim=2048",
    ],
}


def main(model: str = "transformer", *overrides: str) -> None:
    platform = jax.devices()[0].platform
    found = {"platform": platform, "tpu_custom_calls": 0, "scores": []}
    if platform == "tpu":
        cfg = compose_run_config([*COMMON, *MODELS[model], *overrides])
        built, dataset = build_on_grid(cfg, device_grid(jax.devices()[:1], MeshShape(1, 1)))
        x, y = dataset.batch("train", 0, BATCH, slice(0, BATCH))
        built.train_on_batch(x, y)
        hlo = compiled_train_step(built, x, y).as_text()
        found["tpu_custom_calls"] = hlo.count('custom_call_target="tpu_custom_call"')
        scores = re.findall(rf"(?:bf16|f32)\[{BATCH},[\d,]+,{SEQ},{SEQ}\]", hlo)
        found["scores"] = sorted(set(scores))
    print(json.dumps(found))


if __name__ == "__main__":
    main(*sys.argv[1:])
