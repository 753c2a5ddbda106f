#!/usr/bin/env bash
# GPU check, on a machine with an NVIDIA GPU: installs the `cuda` extra into .venv, runs
# `python -m training.run` on the local GPU (detected: 1 host × 1 GPU, GPU 0) with a
# transformer big enough that a bfloat16 step takes >= 5 ms, prints its examples/s and model
# FLOPs utilisation, then benchmark 1 (scripts/bench_overhead.py) on the GPU, then a LoRA
# fine-tune of a Gemma preset (~150M parameters, random weights, made offline by
# scripts/make_preset.py) in bfloat16: tokens/s and the GPU's peak memory; then the transformer
# under data parallel and fsdp on every GPU of the machine: examples/s and memory per GPU.
# Every figure is printed; nothing is compared against a threshold except the 5 ms step check.
#
#   scripts/gpu_check.sh            # PEAK_TFLOPS=989 to give the GPU's bf16 peak yourself
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== GPUs (nvidia-smi)"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader \
    || { echo "error: no NVIDIA GPU here (nvidia-smi failed)"; exit 2; }

echo "== install (.venv, with the cuda extra)"
[ -x .venv/bin/python ] || "${PYTHON:-python3.11}" -m venv .venv
. .venv/bin/activate
pip install -q -e '.[dev,cuda]'
python -c "import jax; print('jax', jax.__version__, 'devices:', jax.devices())"

OUT=$(mktemp -d)
# ~100M parameters, 512-byte windows of the standard library's sources, batch 32.
RUN=(
    model=transformer data=text trainer.precision=bfloat16
    model.kwargs.layers=8 model.kwargs.d_model=1024 model.kwargs.heads=16
    model.kwargs.d_ff=4096 model.seq_len=512 trainer.global_batch=32
    trainer.steps=60 trainer.log_interval=10 trainer.eval_batches=0
    'cluster.gpus=[0]'
)

echo "== training.run on GPU 0 (cluster=local, platform auto)"
python -m training.run "${RUN[@]}" "hydra.run.dir=$OUT/run" 2>&1 | tee "$OUT/run.log"

echo "== figures"
JAX_PLATFORMS=cpu python - "$OUT/run/summary.json" "${RUN[@]}" <<'PY'
import json, os, sys

from training.config import compose_run_config
from training.planning.costs import abstract_model
from training.data import build_dataset

# Dense bf16 peak TFLOP/s by GPU name (NVIDIA data sheets, SXM parts); PEAK_TFLOPS overrides.
PEAKS = {"H200": 989, "H100": 989, "A100": 312, "L40S": 362, "L4": 121, "A10": 125, "V100": 125}
summary = json.load(open(sys.argv[1]))
cfg = compose_run_config(sys.argv[2:])
flops_per_example = abstract_model(cfg, build_dataset(cfg.data).spec).flops_per_example()
gpus = summary["gpus"]
cluster = summary["config"]["cluster"]
print(f"status {summary['status']}; platform {cluster['platform']}; hosts {summary['hosts']} "
      f"x {summary['devices_per_host']} GPU(s)")
for gpu in gpus:
    print(f"host {gpu['host']}: GPU {gpu['index']} {gpu['name']} ({gpu['memory_mib']} MiB)")
assert (cluster["platform"], summary["hosts"], summary["devices_per_host"]) == ("gpu", 1, 1)
speed = summary["examples_per_second"]
step_ms = 1000 * summary["global_batch"] / speed
name = gpus[0]["name"] if gpus else ""
peak = float(os.environ.get("PEAK_TFLOPS") or next((v for k, v in PEAKS.items() if k in name), 0))
achieved = speed * flops_per_example / 1e12
print(f"examples/s {speed:.1f}; step {step_ms:.1f} ms; final loss {summary['final_loss']:.4f}")
print(f"model FLOPs per example {flops_per_example:.3g} (6 x params x positions); "
      f"achieved {achieved:.1f} TFLOP/s")
if peak:
    print(f"model FLOPs utilisation {achieved / peak:.1%} of {peak:g} TFLOP/s bf16 peak ({name})")
else:
    print(f"model FLOPs utilisation: unknown peak for {name!r}; set PEAK_TFLOPS")
print(f"phases (s): {json.dumps({k: round(v, 1) for k, v in summary['phase_seconds'].items()})}")
if step_ms < 5:
    print(f"warning: a step took {step_ms:.2f} ms, under 5 ms: make the model bigger")
PY

echo "== benchmark 1 (scripts/bench_overhead.py) on GPU 0"
python scripts/bench_overhead.py --gpu --loop-overrides trainer.precision=bfloat16 2>&1 \
    | tee "$OUT/bench_overhead.log"
echo "== LoRA fine-tune of a Gemma preset in bfloat16 on GPU 0"
python scripts/make_preset.py "$OUT/ft" --hidden 1024 --layers 8 --vocab 8000
FT=(
    model=hub "model.preset=$OUT/ft/preset" model.lora_rank=4 model.seq_len=256
    data=jsonl "data.path=$OUT/ft/train.jsonl" optimizer=adamw optimizer.learning_rate=1e-4
    trainer.precision=bfloat16 trainer.global_batch=16 trainer.steps=60
    trainer.log_interval=10 trainer.eval_batches=0 'cluster.gpus=[0]'
)
# JAX takes 75% of the GPU up front by default; without that, nvidia-smi shows what is used.
(while sleep 0.5; do
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0
done) > "$OUT/ft_memory.log" &
SAMPLER=$!
XLA_PYTHON_CLIENT_PREALLOCATE=false python -m training.run "${FT[@]}" "hydra.run.dir=$OUT/ft/run" \
    2>&1 | tee "$OUT/ft.log"
kill "$SAMPLER"
python - "$OUT/ft/run/summary.json" "$OUT/ft_memory.log" <<'PY'
import json, sys

summary = json.load(open(sys.argv[1]))
seq_len = summary["config"]["model"]["seq_len"]
used = [int(line) for line in open(sys.argv[2]) if line.strip().isdigit()]
print(f"status {summary['status']}; parameters {summary['parameters']:,}, "
      f"{summary['parameters_trained']:,} trained (LoRA)")
print(f"tokens/s {summary['examples_per_second'] * seq_len:,.0f} "
      f"({summary['examples_per_second']:.1f} examples of {seq_len} tokens); "
      f"final loss {summary['final_loss']:.4f}")
print(f"GPU 0 peak memory used {max(used, default=0):,} MiB (nvidia-smi, every 0.5 s)")
PY
echo "== fsdp beside data parallel on every GPU here (the transformer above, bfloat16)"
# With one GPU both are the same program (nothing to split over): the figures match.
ALL_GPUS=()
for arg in "${RUN[@]}"; do [[ $arg == cluster.gpus=* ]] || ALL_GPUS+=("$arg"); done
for STRATEGY in data_parallel fsdp; do
    (while sleep 0.5; do
        nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | sort -n | tail -1
    done) > "$OUT/$STRATEGY.memory.log" &
    SAMPLER=$!
    XLA_PYTHON_CLIENT_PREALLOCATE=false python -m training.run "${ALL_GPUS[@]}" \
        "strategy=$STRATEGY" "hydra.run.dir=$OUT/$STRATEGY" 2>&1 | tail -3
    kill "$SAMPLER"
    python - "$OUT/$STRATEGY/summary.json" "$OUT/$STRATEGY.memory.log" <<'PY'
import json, sys

summary = json.load(open(sys.argv[1]))
used = [int(line) for line in open(sys.argv[2]) if line.strip().isdigit()]
print(f"{summary['config']['strategy']['name']}: {summary['devices_total']} GPU(s), "
      f"examples/s {summary['examples_per_second']:.1f}, parameters "
      f"{summary['parameter_bytes_per_device']:,} bytes per GPU of "
      f"{summary['parameter_bytes_total']:,}; peak memory of the fullest GPU "
      f"{max(used, default=0):,} MiB (nvidia-smi, every 0.5 s)")
PY
done
echo "== done; logs in $OUT"
