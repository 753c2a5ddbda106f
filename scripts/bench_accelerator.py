"""The project's host loop on one accelerator against the two ways a user would otherwise
train: a hand-written `jax.jit` loop (`stateless_call` + `stateless_apply`, the state
donated, the batches already on the device) and Keras' own `fit`, on the same model, data,
optimizer and precision, in one process. Prints ms/step, tokens/s, model TFLOP/s and MFU
(training/models/flops.py, against the device's peak) per workload, and the ratios.

    python scripts/bench_accelerator.py                       # every workload
    python scripts/bench_accelerator.py --workloads transformer-86M --first-step

Workloads: the built-in transformer at 86 M and 302 M parameters (seq 1024, batch 16,
mixed bfloat16, AdamW), and a keras-hub Llama of TinyLlama-1.1B's shape (random weights)
fine-tuned with LoRA of rank 8 (seq 512, batch 4). The data: random token ids written to a
temporary file (`data=tokens`), read by all three loops. `--first-step` also times, from
its launch, a fresh `python -m training.run cluster=inprocess` of the first workload to the
end of its first step, against a fresh process running the hand-written loop
(`--jit-first-step`); neither uses a compilation cache. With OUT set the results are also
written to $OUT/bench_accelerator.json, after each workload.

Targets (issue 35): host loop <= 1.02 x the jit loop and <= 1.00 x Keras fit; MFU >= 0.45
(86 M), >= 0.50 (302 M), >= 0.55 (LoRA, 4NT + attention); first step <= 1.05 x.
"""

from __future__ import annotations

import time

PROCESS_STARTED = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

os.environ.setdefault("KERAS_BACKEND", "jax")

COMMON = [
    "cluster=inprocess",
    "trainer.precision=bfloat16",
    "optimizer=adamw",
    "optimizer.learning_rate=1e-4",
    "trainer.eval_batches=0",
    "trainer.compile_cache_dir=off",
    "export.enabled=false",
    "data=tokens",
]
TRANSFORMER = ["model=transformer", "model.seq_len=1024", "trainer.global_batch=16"]
WORKLOADS = {
    "transformer-86M": [
        *TRANSFORMER,
        "model.kwargs.layers=12",
        "model.kwargs.d_model=768",
        "model.kwargs.heads=12",
        "model.kwargs.d_ff=3072",
    ],
    "transformer-302M": [
        *TRANSFORMER,
        "model.kwargs.layers=24",
        "model.kwargs.d_model=1024",
        "model.kwargs.heads=16",
        "model.kwargs.d_ff=4096",
    ],
    # A check of this script on CPU, in seconds: python scripts/bench_accelerator.py
    # --workloads transformer-tiny
    "transformer-tiny": [
        "model=transformer",
        "model.seq_len=64",
        "trainer.global_batch=8",
        "model.kwargs.layers=2",
    ],
    "llama-lora": [
        "model=hub",
        "model.backbone=LlamaBackbone",
        "model.seq_len=512",
        "trainer.global_batch=4",
        "model.lora_rank=8",
        # TinyLlama-1.1B's shape
        "model.kwargs.vocabulary_size=32000",
        "model.kwargs.num_layers=22",
        "model.kwargs.num_query_heads=32",
        "model.kwargs.num_key_value_heads=4",
        "model.kwargs.hidden_dim=2048",
        "model.kwargs.intermediate_dim=5632",
    ],
}
VOCABULARY = {"llama-lora": 32000}  # the others: 256, bytes
TARGETS = {"transformer-86M": 0.45, "transformer-302M": 0.50, "llama-lora": 0.55}
LOG_EVERY = 10


def overrides(workload: str, tokens: Path, steps: int) -> list[str]:
    return [
        *COMMON,
        *WORKLOADS[workload],
        f"data.path={tokens}",
        f"data.vocab_size={VOCABULARY.get(workload, 256)}",
        f"trainer.steps={steps}",
        f"trainer.log_interval={LOG_EVERY}",
    ]


def write_tokens(directory: Path, vocabulary: int) -> Path:
    """Random token ids, enough for every loop's steps without wrapping much."""
    import numpy as np

    path = directory / f"tokens-{vocabulary}.bin"
    if not path.exists():
        rng = np.random.default_rng(0)
        rng.integers(0, vocabulary, size=4_000_000, dtype=np.uint16).tofile(path)
    return path


# ---- the three loops -------------------------------------------------------------------


def host_loop(cfg) -> dict:
    """The project's host runtime, as a host of `cluster=inprocess` runs it."""
    from training.events import Compiled, StepLogged
    from training.host.trainer import train
    from training.parallel.mesh import MeshShape

    events = []
    train(cfg, MeshShape(1, 1), events.append)
    logged = [e for e in events if isinstance(e, StepLogged)]
    compiled = next(e for e in events if isinstance(e, Compiled))
    return {
        "step_seconds": statistics.median(e.seconds / e.steps for e in logged[1:]),
        "step_memory_bytes": compiled.step_memory_bytes,
    }


def built(cfg):
    """The model the host loop trains, compiled with the same recipe, on the one device
    (the previous loop's model freed first)."""
    import gc

    import keras

    from training.parallel.mesh import MeshShape
    from training.planning.compiled import built_as_hosts_build

    keras.backend.clear_session()
    gc.collect()
    return built_as_hosts_build(cfg, MeshShape(1, 1))


def batches(dataset, cfg, count: int) -> list:
    batch = cfg.trainer.global_batch
    return [dataset.batch("train", i, batch, slice(0, batch)) for i in range(count)]


def jit_loop(cfg, steps: int) -> dict:
    """A hand-written jit step: stateless_call, the loss, its gradients, stateless_apply;
    the state donated, the batches placed on the device beforehand, the loss read every
    LOG_EVERY steps."""
    import jax

    model, dataset = built(cfg)
    loss_fn, optimizer = model.loss, model.optimizer

    def loss_of(trainable, non_trainable, x, y):
        predicted, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
        return loss_fn(y, predicted), non_trainable

    def step(state, x, y):
        trainable, non_trainable, optimizer_state = state
        (loss, non_trainable), grads = jax.value_and_grad(loss_of, has_aux=True)(
            trainable, non_trainable, x, y
        )
        trainable, optimizer_state = optimizer.stateless_apply(optimizer_state, grads, trainable)
        return loss, (trainable, non_trainable, optimizer_state)

    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in optimizer.variables],
    )
    on_device = [jax.device_put(b) for b in batches(dataset, cfg, LOG_EVERY)]
    compiled = jax.jit(step, donate_argnums=0).lower(state, *on_device[0]).compile()
    loss, state = compiled(state, *on_device[0])
    float(loss)
    first_done = time.time()
    intervals, started = [], time.perf_counter()
    for i in range(1, steps):
        loss, state = compiled(state, *on_device[i % LOG_EVERY])
        if i % LOG_EVERY == 0:
            float(loss)
            now = time.perf_counter()
            intervals.append((now - started) / LOG_EVERY)
            started = now
    return {
        "step_seconds": statistics.median(intervals[1:] or intervals) if intervals else None,
        "first_step_done": first_done,
        "step_memory_bytes": _peak(compiled),
        # The fused attention kernel in the step: Pallas' TPU custom call, cuDNN's on GPU.
        "fused_attention": any(
            call in compiled.as_text() for call in ("tpu_custom_call", "cudnn$fmha")
        ),
    }


def _peak(compiled) -> int:
    analysis = compiled.memory_analysis()
    return max(
        analysis.peak_memory_in_bytes,
        analysis.argument_size_in_bytes + analysis.temp_size_in_bytes,
    )


def keras_fit(cfg, steps: int) -> dict:
    """Keras' own fit on the same arrays: the third epoch timed (the first compiles, and
    on CPU the second still runs slower)."""
    import keras
    import numpy as np

    model, dataset = built(cfg)
    xs, ys = zip(*batches(dataset, cfg, steps), strict=True)
    x, y = np.concatenate(xs), np.concatenate(ys)
    times = {}
    marks = keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda epoch, logs: times.__setitem__(("begin", epoch), time.perf_counter()),
        on_epoch_end=lambda epoch, logs: times.__setitem__(("end", epoch), time.perf_counter()),
    )
    model.fit(
        x,
        y,
        batch_size=cfg.trainer.global_batch,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[marks],
    )
    return {"step_seconds": (times[("end", 2)] - times[("begin", 2)]) / steps}


# ---- a workload ------------------------------------------------------------------------


def run_workload(workload: str, tokens: Path, steps: int) -> dict:
    import jax
    import numpy as np

    from training import models
    from training.accelerators import peak_tflops
    from training.config import compose_run_config
    from training.data import build_dataset
    from training.models.flops import model_flops_per_example

    cfg = compose_run_config(overrides(workload, tokens, steps))
    device = jax.devices()[0]
    result = {"workload": workload, "device": device.device_kind, "loops": {}}
    for name, loop in (("host loop", host_loop), ("jit loop", jit_loop), ("keras fit", keras_fit)):
        try:
            result["loops"][name] = loop(cfg) if name == "host loop" else loop(cfg, steps)
        except Exception as error:  # noqa: BLE001 - one loop failing leaves the others
            result["loops"][name] = {"error": f"{type(error).__name__}: {str(error)[:400]}"}
            traceback.print_exc()
    model = models.abstract_model(cfg.model, build_dataset(cfg.data).spec)
    positions = cfg.model.seq_len
    result["parameters"] = sum(int(np.prod(w.shape)) for w in model.weights)
    result["tokens_per_step"] = cfg.trainer.global_batch * positions
    result["flops_per_step"] = cfg.trainer.global_batch * model_flops_per_example(model, positions)
    result["peak_tflops"] = peak_tflops(device.device_kind)
    return result


def figures(result: dict, loop: dict) -> dict:
    seconds = loop["step_seconds"]
    tflops = result["flops_per_step"] / seconds / 1e12
    return {
        "ms": seconds * 1e3,
        "tokens_per_s": result["tokens_per_step"] / seconds,
        "tflops": tflops,
        "mfu": tflops / result["peak_tflops"] if result["peak_tflops"] else None,
    }


def report(result: dict) -> None:
    print(
        f"\n{result['workload']} ({result['parameters'] / 1e6:.0f} M parameters, "
        f"{result['device']}, peak {result['peak_tflops']} TFLOP/s):"
    )
    loops = result["loops"]
    for name, loop in loops.items():
        if "error" in loop:
            print(f"  {name:10s} failed: {loop['error']}")
            continue
        f = figures(result, loop)
        mfu = f"{f['mfu']:.3f}" if f["mfu"] is not None else "-"
        memory = loop.get("step_memory_bytes")
        held = f"  step memory {memory / 1e9:.2f} GB" if memory else ""
        if "fused_attention" in loop:
            held += f"  fused attention kernel: {'yes' if loop['fused_attention'] else 'no'}"
        print(
            f"  {name:10s} {f['ms']:8.1f} ms/step  {f['tokens_per_s']:10,.0f} tokens/s  "
            f"{f['tflops']:6.1f} TFLOP/s  MFU {mfu}{held}"
        )
    host = loops.get("host loop", {})
    for other in ("jit loop", "keras fit"):
        if "step_seconds" in host and "step_seconds" in loops.get(other, {}):
            ratio = host["step_seconds"] / loops[other]["step_seconds"]
            print(f"  host loop / {other}: {ratio:.3f}")
    if result["workload"] in TARGETS:
        print(f"  target MFU >= {TARGETS[result['workload']]}")


# ---- time to first step ----------------------------------------------------------------


def first_step(workload: str, tokens: Path, directory: Path) -> dict:
    """From launch to the end of the first step: `training.run cluster=inprocess` against
    a process running the hand-written loop, each fresh, neither with a compilation cache."""
    command = [sys.executable, "-m", "training.run", *overrides(workload, tokens, 3)]
    launched = time.time()
    subprocess.run(command, cwd=directory, check=True, capture_output=True)
    summary = json.loads(next(directory.glob("outputs/*/*/summary.json")).read_text())
    system = summary["started_at"] + summary["phase_seconds"]["first_step"] - launched
    launched = time.time()
    done = subprocess.run(
        [sys.executable, __file__, "--jit-first-step", workload, "--tokens", str(tokens)],
        check=True,
        capture_output=True,
        text=True,
    )
    plain = float(done.stdout.strip().splitlines()[-1]) - launched
    return {"system_seconds": system, "jit_seconds": plain, "ratio": system / plain}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--first-step", action="store_true")
    parser.add_argument("--jit-first-step", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.jit_first_step:  # the child of `first_step`: its first step's end, as a time
        from training.config import compose_run_config

        cfg = compose_run_config(overrides(args.jit_first_step, Path(args.tokens), 3))
        print(jit_loop(cfg, 1)["first_step_done"])
        return
    out = os.environ.get("OUT")
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        chosen = args.workloads.split(",")
        if args.first_step:
            tokens = write_tokens(scratch, VOCABULARY.get(chosen[0], 256))
            timed = first_step(chosen[0], tokens, scratch)
            print(
                f"time to first step, {chosen[0]}: training.run cluster=inprocess "
                f"{timed['system_seconds']:.1f} s, hand-written jit loop "
                f"{timed['jit_seconds']:.1f} s: ratio {timed['ratio']:.3f} (target <= 1.05)",
                flush=True,
            )
            results.append({"first_step": chosen[0], **timed})
        for workload in chosen:
            tokens = write_tokens(scratch, VOCABULARY.get(workload, 256))
            result = run_workload(workload, tokens, args.steps)
            report(result)
            results.append(result)
            if out:
                Path(out, "bench_accelerator.json").write_text(json.dumps(results, indent=1))
            sys.stdout.flush()


if __name__ == "__main__":
    main()
