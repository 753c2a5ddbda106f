"""The Megatron minimum: what the built-in transformer's layout (`training.models.transformer`)
must send over the `model` axis by Megatron's count, the floor the benchmarks and tests hold the
compiled step to. It lives with the cost model, which knows the transformer, so that the model
does not import the cost model."""

from __future__ import annotations

from training.planning.collectives import Collective


def megatron_minimum(
    examples: int, value_bytes: int, n: int, layers: int, d_model: int, seq_len: int, **_
) -> list[Collective]:
    """What the transformer's RULES must send over a model group of `n` devices in one step on
    `examples` sequences (`**_`: its other build arguments): per block one all-reduce of the
    hidden state after attention and one after the MLP, and one of each of their inputs'
    gradients; the embedding's all-reduce and the output head's input gradient; the softmax's
    maximum and sum of exponentials over the split vocabulary; and the position table
    gathered."""
    tokens = examples * seq_len
    hidden = Collective("all-reduce", tokens * d_model * value_bytes, n, "hidden state")
    softmax = Collective("all-reduce", tokens * 4, n, "softmax")
    positions = Collective("all-gather", seq_len * d_model * 4, n, "position table")
    return [hidden] * (4 * layers + 2) + [softmax] * 2 + [positions]
