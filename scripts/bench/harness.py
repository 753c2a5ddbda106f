"""What the benchmarks share: their models and configs, the devices a process simulates,
the fresh processes some start, the timing, the hand-written baselines, and how a ratio and
the results are reported. Imports nothing that starts JAX: a benchmark chooses its devices
(`use_env`) before it imports jax."""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
os.environ.setdefault("KERAS_BACKEND", "jax")  # as `import training` sets it; keras may come first

# ---- models and configs ----------------------------------------------------------------

# A small transformer that compiles and steps quickly on CPU devices (8 heads, so that model
# parallelism can split it 8 ways).
BENCH_TRANSFORMER = [
    "model=transformer",
    "data=text",
    "model.kwargs.layers=2",
    "model.kwargs.d_model=64",
    "model.kwargs.heads=8",
    "model.kwargs.d_ff=256",
    "model.seq_len=32",
]
# The system's runs against plain processes: the small transformer, hybrid 2 × 4 on 2 hosts.
SYSTEM = [
    "strategy=hybrid",
    "mesh.data=2",
    "mesh.model=4",
    *BENCH_TRANSFORMER,
    "trainer.global_batch=32",
    "trainer.eval_batches=0",
    "trainer.log_interval=10",
]
SYSTEM_STEPS = 60
READ_EVERY = 10  # the hand-written loops read the loss (and so wait) every this many steps
# Data-parallel speedups commonly quoted for 2, 4 and 8 GPUs.
REFERENCE_SPEEDUP = {1: 1.0, 2: 2.0, 4: 3.8, 8: 7.3}

# One accelerator's workloads (accelerator_loops, plan_memory --accelerator).
ACCELERATOR_COMMON = [
    "cluster=inprocess",
    "trainer.precision=bfloat16",
    "optimizer=adamw",
    "optimizer.learning_rate=1e-4",
    "trainer.eval_batches=0",
    "trainer.compile_cache_dir=off",
    "export.enabled=false",
]
TINYLLAMA_LORA = [
    "model=hub",
    "model.backbone=LlamaBackbone",
    "model.lora_rank=8",
    "model.kwargs.vocabulary_size=32000",
    "model.kwargs.num_layers=22",
    "model.kwargs.num_query_heads=32",
    "model.kwargs.num_key_value_heads=4",
    "model.kwargs.hidden_dim=2048",
    "model.kwargs.intermediate_dim=5632",
]
ACCELERATOR_TRANSFORMER = ["model=transformer", "model.seq_len=1024", "trainer.global_batch=16"]
WORKLOADS = {
    "transformer-86M": [
        *ACCELERATOR_TRANSFORMER,
        "model.kwargs.layers=12",
        "model.kwargs.d_model=768",  # 6 heads of 128 (the default head size)
        "model.kwargs.d_ff=3072",
    ],
    "transformer-86M-4096": [
        "model=transformer",
        "model.seq_len=4096",
        "trainer.global_batch=4",
        "model.kwargs.layers=12",
        "model.kwargs.d_model=768",
        "model.kwargs.d_ff=3072",
    ],
    "transformer-302M": [
        *ACCELERATOR_TRANSFORMER,
        "model.kwargs.layers=24",
        "model.kwargs.d_model=1024",  # 8 heads of 128
        "model.kwargs.d_ff=4096",
    ],
    # A check of the accelerator benchmarks on CPU, in seconds.
    "transformer-tiny": [
        "model=transformer",
        "model.seq_len=64",
        "trainer.global_batch=8",
        "model.kwargs.layers=2",
    ],
    # A keras-hub Llama of TinyLlama-1.1B's shape, LoRA of rank 8, at three context lengths.
    "llama-lora": [*TINYLLAMA_LORA, "model.seq_len=512", "trainer.global_batch=4"],
    "llama-lora-2048": [*TINYLLAMA_LORA, "model.seq_len=2048", "trainer.global_batch=2"],
    "llama-lora-4096": [*TINYLLAMA_LORA, "model.seq_len=4096", "trainer.global_batch=1"],
}
VOCABULARY = {name: 32000 for name in WORKLOADS if name.startswith("llama")}  # others: 256
# Instruction tuning (data=jsonl, a prompt and a response) on the same examples, packed into
# rows (data.pack) against one example a row: TinyLlama-shape LoRA with examples of 20-500
# tokens, packed into 2048 against unpacked at 512; and a tiny Llama, examples of 6-120
# tokens, 256 against 128, to check the pair on CPU in seconds. The same tokens per step.
TINY_LLAMA = [
    "model=hub",
    "model.backbone=LlamaBackbone",
    "model.kwargs.vocabulary_size=256",
    "model.kwargs.num_layers=2",
    "model.kwargs.num_query_heads=4",
    "model.kwargs.num_key_value_heads=2",
    "model.kwargs.hidden_dim=64",
    "model.kwargs.intermediate_dim=128",
]
INSTRUCTION_WORKLOADS = {
    "llama-lora-packed": [*TINYLLAMA_LORA, "model.seq_len=2048", "trainer.global_batch=2"],
    "llama-lora-unpacked": [*TINYLLAMA_LORA, "model.seq_len=512", "trainer.global_batch=8"],
    "llama-tiny-packed": [*TINY_LLAMA, "model.seq_len=256", "trainer.global_batch=2"],
    "llama-tiny-unpacked": [*TINY_LLAMA, "model.seq_len=128", "trainer.global_batch=4"],
}
INSTRUCTION_LENGTHS = {"llama-lora": (20, 500), "llama-tiny": (6, 120)}  # tokens, with start/end
PACKED_PAIRS = {
    "llama-lora-packed": "llama-lora-unpacked",
    "llama-tiny-packed": "llama-tiny-unpacked",
}
INSTRUCTIONS = 4000  # examples in the file
# On the synthetic arrays instead of tokens (plan_memory --accelerator): a wide MLP of 135 M
# parameters.
ARRAY_WORKLOADS = {
    "mlp-wide": [
        "model=wide_mlp",
        "model.kwargs.d_model=1024",
        "model.kwargs.hidden=8192",
        "model.kwargs.depth=8",
        "trainer.global_batch=4096",
    ],
}


def workload_overrides(workload: str, tokens: Path, steps: int) -> list[str]:
    """`tokens`: the file `write_tokens` wrote; the folder `write_instructions` wrote for an
    instruction workload."""
    if workload in ARRAY_WORKLOADS:
        model_and_data = ARRAY_WORKLOADS[workload]
    elif workload in INSTRUCTION_WORKLOADS:
        model_and_data = [
            *INSTRUCTION_WORKLOADS[workload],
            "data=jsonl",
            f"data.path={tokens / 'instructions.jsonl'}",
            f"data.tokenizer={tokens / 'tokenizer'}",
            "data.prompt_field=prompt",
            "data.response_field=response",
            f"data.pack={workload.endswith('-packed')}",
        ]
    else:
        vocabulary = VOCABULARY.get(workload, 256)
        model_and_data = [
            *WORKLOADS[workload],
            "data=tokens",
            f"data.path={tokens}",
            f"data.vocab_size={vocabulary}",
        ]
    return [
        *ACCELERATOR_COMMON,
        *model_and_data,
        f"trainer.steps={steps}",
        f"trainer.log_interval={READ_EVERY}",
    ]


def write_tokens(directory: Path, workload: str) -> Path:
    """Random token ids of the workload's vocabulary, enough for every loop's steps without
    wrapping much."""
    import numpy as np

    vocabulary = VOCABULARY.get(workload, 256)
    path = directory / f"tokens-{vocabulary}.bin"
    if not path.exists():
        rng = np.random.default_rng(0)
        rng.integers(0, vocabulary, size=4_000_000, dtype=np.uint16).tofile(path)
    return path


def write_instructions(directory: Path, workload: str) -> Path:
    """A folder of `instructions.jsonl`, prompts and responses of random letters whose
    lengths (start and end tokens included) are uniform in the workload's
    INSTRUCTION_LENGTHS, and `tokenizer`, a preset of a character tokenizer (one token a
    letter) trained here, no download."""
    import io

    import keras_hub
    import numpy as np
    import sentencepiece

    family = workload.rsplit("-", 1)[0]
    folder = directory / f"instructions-{family}"
    if folder.exists():
        return folder
    shortest, longest = INSTRUCTION_LENGTHS[family]
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    folder.mkdir()
    with open(folder / "instructions.jsonl", "w") as file:
        for length in rng.integers(shortest, longest + 1, INSTRUCTIONS) - 2:
            text = "".join(rng.choice(letters, length))
            cut = int(rng.integers(1, max(2, length // 4)))
            file.write(json.dumps({"prompt": text[:cut], "response": text[cut:]}) + "\n")
    proto = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(["".join(letters)] * 8),
        model_writer=proto,
        model_type="char",
        vocab_size=len(letters) + 5,
        pad_id=0,
        unk_id=1,
        bos_id=2,
        eos_id=3,
        pad_piece="<pad>",
        bos_piece="<s>",
        eos_piece="</s>",
        unk_piece="<unk>",
        hard_vocab_limit=False,
        minloglevel=2,
    )
    m = keras_hub.models
    tokenizer = m.LlamaTokenizer(proto=proto.getvalue())
    backbone = m.LlamaBackbone(
        vocabulary_size=tokenizer.vocabulary_size(),
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=2,
        hidden_dim=8,
        intermediate_dim=8,
    )
    preprocessor = m.LlamaCausalLMPreprocessor(tokenizer)
    m.LlamaCausalLM(backbone, preprocessor).save_to_preset(str(folder / "tokenizer"))
    return folder


# ---- devices and processes -------------------------------------------------------------


def cpu_env(devices: int, xla_flags: str | None = None) -> dict:
    """This environment with `devices` simulated CPU devices (`xla_flags` in full, if given)."""
    return {
        **os.environ,
        "XLA_FLAGS": xla_flags or f"--xla_force_host_platform_device_count={devices}",
        "JAX_PLATFORMS": "cpu",
        "KERAS_BACKEND": "jax",
    }


def gpu_env() -> dict:
    """This environment with GPU 0 alone."""
    env = {**os.environ, "JAX_PLATFORMS": "cuda", "KERAS_BACKEND": "jax"}
    env["CUDA_VISIBLE_DEVICES"] = "0"
    env.pop("XLA_FLAGS", None)
    return env


def use_env(env: dict) -> None:
    """This process's devices, as `env` sets them: before jax is imported."""
    os.environ.clear()
    os.environ.update(env)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start(module: str, args: list[str], env: dict | None = None) -> subprocess.Popen:
    """`python -m scripts.bench.<module> ARGS` from the repository root, its output read."""
    command = [sys.executable, "-m", f"scripts.bench.{module}", *args]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)


def result_of(process: subprocess.Popen):
    """What a started process printed last, as JSON."""
    output, _ = process.communicate()
    if process.returncode:
        raise SystemExit(f"{process.args} failed with status {process.returncode}")
    return json.loads(output.strip().splitlines()[-1])


# ---- timing and reporting --------------------------------------------------------------


def steady_step_seconds(reports: list) -> float:
    """The median step time of the logged intervals after the first (compile, warm-up)."""
    from training.events import StepLogged

    per_step = [r.seconds / r.steps for r in reports if isinstance(r, StepLogged)]
    return statistics.median(per_step[1:])


def ratio(value: float, target: str, digits: int = 2) -> str:
    return f"ratio {value:.{digits}f} (target {target})"


def write_results(name: str, results) -> None:
    """$OUT/<name>.json, where OUT is set (the device machine's results folder)."""
    if out := os.environ.get("OUT"):
        Path(out, f"{name}.json").write_text(json.dumps(results, indent=1))


# ---- the system: `training.run`'s own path ---------------------------------------------


def system_parser(doc: str) -> argparse.ArgumentParser:
    """The command line of a benchmark of the system against plain processes."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--steps", type=int, default=SYSTEM_STEPS, help="steps of each run")
    return parser


def system_overrides(steps: int, compile_cache: str = "") -> list[str]:
    """The system's run of `steps` (its compilation cache in `compile_cache`, where given)."""
    cache = [f"trainer.compile_cache_dir={compile_cache}"] if compile_cache else []
    return [*SYSTEM, f"trainer.steps={steps}", *cache]


def run_system(overrides: list[str], launched: float) -> dict:
    """A run of the system in this process (a local Ray instance, its hosts), timed from
    `launched`: its steady step, its time to first step and where that went."""
    from rich.console import Console

    from training.config import compose_run_config
    from training.run import run_training

    imported = time.time()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        summary = run_training(compose_run_config(overrides), Path(out), Console(quiet=True))
    driver_before_supervisor = time.perf_counter() - started - summary["wall_seconds"]
    phases = summary["phase_seconds"]
    return {
        "step_seconds": max(summary["per_host_step_seconds"]),
        "since_start": imported - launched,
        "first_step_seconds": driver_before_supervisor + phases["first_step"],
        "compile_and_first_step": phases["first_step"] - phases["model_built"],
        "compile_seconds": summary["compile_seconds"],
        "compile_cache": summary["compile_cache"],
        "breakdown": {
            "config, Ray, hosts requested, checks": driver_before_supervisor,
            "actors placed + started": phases["actors_started"] - phases["ray_ready"],
            "jax.distributed joined": phases["jax_cluster_joined"] - phases["actors_started"],
            "model built": phases["model_built"] - phases["jax_cluster_joined"],
            "compile + first step": phases["first_step"] - phases["model_built"],
        },
    }


def run_system_afresh(overrides: list[str]) -> dict:
    """`run_system` in a new process, as a user's `python -m training.run` starts: nothing
    imported yet. Timed from its launch."""
    return result_of(start("system_process", [str(time.time()), *overrides]))


def system_time_to_first_step(run: dict) -> float:
    return run["since_start"] + run["first_step_seconds"]


def print_breakdown(phases: dict) -> None:
    for phase, seconds in phases.items():
        print(f"     {phase:38s} {seconds:6.2f} s")


def print_system_breakdown(run: dict) -> None:
    """Where a fresh system process's time to first step went."""
    print_breakdown({"launch + imports": run["since_start"], **run["breakdown"]})


@contextmanager
def running_ray_instance():
    """A local Ray instance as a user keeps one (`ray start --head`), stopped afterwards:
    `--block` keeps `ray start` in the foreground, and stopping it stops its processes
    alone (not `ray stop`, which stops every Ray instance on the machine)."""
    port = free_port()
    command = ["ray", "start", "--head", "--block", f"--port={port}", "--num-cpus=8"]
    process = subprocess.Popen(
        [str(Path(sys.executable).parent / command[0]), *command[1:], "--include-dashboard=false"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        from ray._private.services import find_gcs_addresses

        deadline = time.time() + 120
        while find_gcs_addresses.cache_clear() or not any(
            a.endswith(f":{port}") for a in find_gcs_addresses()
        ):
            if time.time() > deadline or process.poll() is not None:
                raise RuntimeError("ray start --head did not start")
            time.sleep(0.5)
        time.sleep(2)  # its raylet registers after the GCS is up
        yield
    finally:
        process.terminate()
        process.wait(timeout=60)


# ---- an MLflow tracking server (tracking=mlflow), for benchmarks and tests -------------

MLFLOW_START_S = 180  # a cold start on a busy 2-core machine took 60 s


@contextmanager
def local_mlflow_server(root: Path):
    """`mlflow server` on loopback with a sqlite store and its artifacts under `root`, one
    worker; its URI once /health answers OK. Stopped afterwards (killed if it lingers)."""
    import signal
    import urllib.request

    port = free_port()
    command = [
        *(sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port)),
        *("--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--workers", "1"),
        *("--artifacts-destination", str(root / "artifacts")),
    ]
    log_path = root / "mlflow-server.log"
    with log_path.open("w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + MLFLOW_START_S
        while not _answers_ok(f"{uri}/health", urllib.request):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not start: {log_path.read_text()[-2000:]}")
            time.sleep(0.5)
        yield uri
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and its worker: its own group
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)


def _answers_ok(url: str, request) -> bool:
    try:
        with request.urlopen(url, timeout=2) as answer:
            return answer.read().decode().strip() == "OK"
    except OSError:
        return False


# ---- the baseline: plain processes running a hand-written jax.jit loop -----------------


def run_plain(overrides: list[str], steps: int) -> dict:
    """2 plain processes of 4 CPU devices each, joined by `jax.distributed` without Ray,
    each running `jit_loop` on the config's model and mesh (plain_process); timed from their
    launch."""
    port = free_port()
    launched = time.time()
    processes = [
        start(
            "plain_process", [str(p), str(port), str(launched), str(steps), *overrides], cpu_env(4)
        )
        for p in range(2)
    ]
    results = [result_of(p) for p in processes]
    return {
        "step_seconds": max(r["step_seconds"] for r in results),
        "first_step_seconds": max(r["first_step_done"] for r in results) - launched,
        "breakdown": {
            phase: max(r["breakdown"][phase] for r in results) for phase in results[0]["breakdown"]
        },
    }


def jit_loop(model, batches: Callable[[int], tuple], steps: int, accuracy: bool = False) -> dict:
    """A hand-written `jax.jit` step (stateless_call, the loss, its gradients,
    stateless_apply; the state donated and kept in its variables' shardings), compiled ahead
    for the first batch and dispatched without waiting; `batches(i)`: step i's (x, y) on the
    devices, with its sample weights where the data has them. The loss is read every
    READ_EVERY steps (also keeps XLA's CPU collectives from timing out, jax #25861), with
    the interval's accuracy where `accuracy` (its correct and total counts summed on the
    device). Returns the median step time over those intervals after the first, when step 1
    was done, and the compiled step."""
    import inspect

    import jax
    import jax.numpy as jnp

    loss_fn, optimizer = model.loss, model.optimizer
    # keras-hub's CausalLM.call takes no `training` (stateless_call passes it through).
    training = {"training": True} if "training" in inspect.signature(model.call).parameters else {}

    def loss_of(trainable, non_trainable, x, y, *sample_weight):
        logits, non_trainable = model.stateless_call(trainable, non_trainable, x, **training)
        return loss_fn(y, logits, *sample_weight), (logits, non_trainable)

    def step(state, counts, x, y, *sample_weight):
        trainable, non_trainable, optimizer_state = state
        (loss, (logits, non_trainable)), grads = jax.value_and_grad(loss_of, has_aux=True)(
            trainable, non_trainable, x, y, *sample_weight
        )
        trainable, optimizer_state = optimizer.stateless_apply(optimizer_state, grads, trainable)
        if accuracy:
            hits = jnp.argmax(logits, axis=-1) == y.reshape(logits.shape[:-1])
            counts = counts + jnp.stack([hits.sum(), hits.size]).astype(jnp.float32)
        return loss, counts, (trainable, non_trainable, optimizer_state)

    groups = (model.trainable_variables, model.non_trainable_variables, optimizer.variables)
    shardings = tuple([v.value.sharding for v in variables] for variables in groups)
    state = tuple([v.value for v in variables] for variables in groups)
    fresh = counts = jnp.zeros(2, jnp.float32)
    jitted = jax.jit(step, donate_argnums=0, out_shardings=(None, None, shardings))
    compiled = jitted.lower(state, counts, *batches(0)).compile()
    loss, counts, state = compiled(state, counts, *batches(0))
    float(loss)
    first_done = time.time()
    intervals, started = [], time.perf_counter()
    for i in range(1, steps):
        loss, counts, state = compiled(state, counts, *batches(i))
        if i % READ_EVERY == 0:
            jax.device_get((loss, counts))
            counts = fresh
            now = time.perf_counter()
            intervals.append((now - started) / READ_EVERY)
            started = now
    return {
        "step_seconds": statistics.median(intervals[1:] or intervals) if intervals else None,
        "first_step_done": first_done,
        "compiled": compiled,
    }


def placed_batches(dataset, batch: int, rows: slice) -> Callable[[int], tuple]:
    """Step i's rows of the training batch, placed as Keras' distribution lays out data."""
    import jax
    import keras

    layout = keras.distribution.distribution()

    def place(array):
        sharding = layout.get_data_layout(array.shape).backend_layout
        return jax.make_array_from_process_local_data(sharding, array)

    def batches(i: int) -> tuple:
        x, y = dataset.batch("train", i, batch, rows)
        return place(x), place(y)

    return batches


# ---- the memory benchmarks: one process, 8 simulated CPU devices of one host -----------

ONE_HOST = ["cluster.hosts=1", "cluster.devices_per_host=8"]
TEXT_TRANSFORMER = ["model=transformer", "data=text", "trainer.global_batch=16"]
REMATS = ("none", "full", "dots")
MODELS = {
    "mlp": ["model=mlp", "trainer.global_batch=16"],
    "wide_mlp": ["model=wide_mlp", "trainer.global_batch=16"],
    "transformer": TEXT_TRANSFORMER,
    "llama": ["model=hub", "data=text", "model.seq_len=32", "trainer.global_batch=16"],
}
# name: (strategy, (mesh.data, mesh.model), further overrides)
STRATEGIES = {
    "data_parallel": ("data_parallel", (8, 1), []),
    "fsdp": ("fsdp", (8, 1), []),
    "hybrid": ("hybrid", (2, 4), []),
    "hybrid+fsdp": ("hybrid", (2, 4), ["strategy.fsdp=true"]),
    "model_parallel": ("model_parallel", (1, 8), []),
}


def use_eight_cpu_devices() -> None:
    """8 simulated CPU devices that rematerialise as the hosts' do: before jax is imported."""
    from training.models.remat import cpu_xla_flags

    use_env(cpu_env(8, cpu_xla_flags(8)))


def memory_config(model: str, strategy: str, *extra: str):
    """The config of `model` under `strategy` on 8 devices of one host, and its mesh."""
    from training.config import compose_run_config
    from training.parallel.mesh import MeshShape

    name, (data, model_axis), overrides = STRATEGIES[strategy]
    cfg = compose_run_config(
        [*ONE_HOST, *MODELS[model], f"strategy={name}", f"mesh.data={data}"]
        + [f"mesh.model={model_axis}", *overrides, *extra]
    )
    return cfg, MeshShape(data, model_axis)


def measured(cfg, mesh):
    """What the compiled step of `cfg` on `mesh` holds and sends, the distribution reset."""
    import keras

    from training.planning.compiled import measure_step

    try:
        return measure_step(cfg, mesh)
    finally:
        keras.distribution.set_distribution(None)
