"""Forward + backward of one causal attention layer, the built-in transformer's einsum path
against JAX's Pallas TPU kernels (flash attention, splash attention) at a few block sizes: ms
per call, XLA's temporaries, and how far each kernel's output and gradients are from the
einsum path's (and from a float32 einsum). Only jax and numpy; one process.

    python scripts/probe_attention.py               # on the TPU: the 86 M and 302 M shapes
    python scripts/probe_attention.py --cpu-smoke   # anywhere: tiny shapes, kernels interpreted

Each variant takes query, key and value as the model has them, (batch, seq, heads, head_dim)
in bfloat16, and returns the attention in that layout with the gradients of all three for a
fixed random cotangent; the kernels' transposes into (batch, heads, seq, head_dim) are part
of what is timed. One variant failing prints its error and the probe goes on. Variants left
when `--budget-s` has passed are listed as skipped. With OUT set the table is also written
to $OUT/attention.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback
from contextlib import nullcontext
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import flash_attention as flash
from jax.experimental.pallas.ops.tpu import splash_attention as splash

# (batch, heads, seq, head_dim) of the transformer at 86 M and 302 M parameters, batch 16.
SHAPES = {"86M": (16, 12, 1024, 64), "302M": (16, 16, 1024, 64)}
SMOKE_SHAPES = {"smoke": (2, 2, 256, 64)}


def einsum_attention(q, k, v, exact: bool = False):
    """The transformer's einsum path (training/models/attention.py), in jax; `exact` with
    full-precision products, for a reference in float32."""
    precision = jax.lax.Precision.HIGHEST if exact else None
    scores = jnp.einsum("btnh,bsnh->bnts", q, k, precision=precision) * q.shape[-1] ** -0.5
    length = q.shape[1]
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    scores = jnp.where(causal, scores, jnp.asarray(-1e9, scores.dtype))
    weights = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", weights, v, precision=precision)


def heads_first(*xs):
    return [jnp.swapaxes(x, 1, 2) for x in xs]


def flash_attention(q, k, v, block: int | None):
    sizes = None
    if block:
        sizes = flash.BlockSizes(
            block_q=block,
            block_k_major=block,
            block_k=block,
            block_b=1,
            block_q_major_dkv=block,
            block_k_major_dkv=block,
            block_k_dkv=block,
            block_q_dkv=block,
            block_k_major_dq=block,
            block_k_dq=block,
            block_q_dq=block,
        )
    q, k, v = heads_first(q, k, v)
    out = flash.flash_attention(
        q, k, v, causal=True, sm_scale=q.shape[-1] ** -0.5, block_sizes=sizes
    )
    return jnp.swapaxes(out, 1, 2)


def splash_attention(q, k, v, block: int, fused_bwd: bool, interpret: bool):
    """Splash attention over one example's heads, mapped over the batch."""
    batch, seq, heads, head_dim = q.shape
    backward = dict(block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block)
    if not fused_bwd:
        backward.update(block_q_dq=block, block_kv_dq=block)
    sizes = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        use_fused_bwd_kernel=fused_bwd,
        **backward,
    )
    mask = splash.MultiHeadMask([splash.CausalMask((seq, seq))] * heads)
    kernel = splash.make_splash_mha_single_device(mask, block_sizes=sizes, interpret=interpret)
    q, k, v = heads_first(q * head_dim**-0.5, k, v)
    return jnp.swapaxes(jax.vmap(kernel)(q, k, v), 1, 2)


def variants(seq: int, interpret: bool) -> dict:
    """name -> (attention function, the context to compile it in); the einsum path first (the
    others are compared with it). Interpreted, splash attention takes its own flag; flash
    attention has none, and runs under TPU interpret mode instead (which splash's batched
    grid does not)."""
    in_flash_context = pltpu.force_tpu_interpret_mode if interpret else nullcontext
    found = {
        "einsum": (einsum_attention, nullcontext),
        "flash default blocks": (partial(flash_attention, block=None), in_flash_context),
    }
    blocks = [b for b in (128, 256, 512, 1024) if b <= seq]
    for block in blocks[1:]:
        found[f"flash blocks {block}"] = (partial(flash_attention, block=block), in_flash_context)
    for block in blocks:
        for fused in (False, True):
            name = f"splash blocks {block}" + (" fused bwd" if fused else "")
            kernel = partial(splash_attention, block=block, fused_bwd=fused, interpret=interpret)
            found[name] = (kernel, nullcontext)
    return found


def forward_backward(attention):
    """(q, k, v, cotangent) -> (output, dq, dk, dv)."""

    def step(q, k, v, cotangent):
        out, pullback = jax.vjp(attention, q, k, v)
        return (out, *pullback(cotangent.astype(out.dtype)))

    return jax.jit(step)


def max_difference(got, want) -> float:
    return max(
        float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
        for a, b in zip(got, want, strict=True)
    )


def inputs(shape):
    batch, heads, seq, head_dim = shape
    keys = jax.random.split(jax.random.key(0), 4)
    return [
        jax.random.normal(key, (batch, seq, heads, head_dim), jnp.float32).astype(jnp.bfloat16)
        for key in keys
    ]


def measure(attention, context, args, reps: int) -> tuple[dict, tuple]:
    with context():
        compiled = forward_backward(attention).lower(*args).compile()
    temporaries = compiled.memory_analysis().temp_size_in_bytes
    result = jax.block_until_ready(compiled(*args))
    for _ in range(2):  # warm-up
        jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return {"ms": statistics.median(times), "temp_gb": temporaries / 1e9}, result


def probe(shapes: dict, reps: int, budget_s: float, interpret: bool) -> list[dict]:
    rows = []
    start = time.monotonic()
    for shape_name, shape in shapes.items():
        args = inputs(shape)
        exact = forward_backward(partial(einsum_attention, exact=True))(
            *(x.astype(jnp.float32) for x in args)
        )
        reference = None
        for name, (attention, context) in variants(shape[2], interpret).items():
            row = {"shape": shape_name, "bnth": list(shape), "variant": name}
            rows.append(row)
            if time.monotonic() - start > budget_s:
                row["error"] = "skipped: time budget spent"
                continue
            try:
                figures, result = measure(attention, context, args, reps)
            except Exception as error:  # one variant failing must not end the probe
                traceback.print_exc()
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                print(f"{shape_name} {name}: {row['error']}", flush=True)
                continue
            reference = result if reference is None else reference
            row.update(figures)
            row["diff_out_vs_einsum"] = max_difference(result[:1], reference[:1])
            row["diff_grads_vs_einsum"] = max_difference(result[1:], reference[1:])
            row["diff_out_vs_f32"] = max_difference(result[:1], exact[:1])
            row["diff_grads_vs_f32"] = max_difference(result[1:], exact[1:])
            print(f"{shape_name} {name}: {row['ms']:.2f} ms, {row['temp_gb']:.3f} GB", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        f"{'shape':6} {'variant':28} {'ms':>8} {'temp GB':>8} "
        f"{'out-ein':>8} {'grad-ein':>8} {'out-f32':>8} {'grad-f32':>8}"
    ]
    for row in rows:
        head = f"{row['shape']:6} {row['variant']:28}"
        if "error" in row:
            lines.append(f"{head} {row['error']}")
            continue
        lines.append(
            f"{head} {row['ms']:8.2f} {row['temp_gb']:8.3f} {row['diff_out_vs_einsum']:8.4f} "
            f"{row['diff_grads_vs_einsum']:8.4f} {row['diff_out_vs_f32']:8.4f} "
            f"{row['diff_grads_vs_f32']:8.4f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="tiny shapes, the kernels in interpret mode"
    )
    parser.add_argument("--reps", type=int, default=10, help="timed calls per variant")
    parser.add_argument(
        "--budget-s", type=float, default=180, help="variants left after this are skipped"
    )
    args = parser.parse_args()
    smoke = args.cpu_smoke
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    rows = probe(SMOKE_SHAPES if smoke else SHAPES, 2 if smoke else args.reps, args.budget_s, smoke)
    print(table(rows))
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "attention.json")
        with open(path, "w") as f:
            json.dump(
                {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "rows": rows},
                f,
                indent=1,
            )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
