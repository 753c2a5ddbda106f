"""Write `train.npz` for the example model: x (8192 × 16, float32) and y = a fixed smooth
function of x plus noise (8192 × 1). `python make_data.py [rows]`."""

import sys

import numpy as np


def make(rows: int = 8192, features: int = 16, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, features), dtype=np.float32)
    weights = rng.standard_normal((features, 1)).astype(np.float32) / np.sqrt(features)
    y = np.tanh(x @ weights) + 0.05 * rng.standard_normal((rows, 1), dtype=np.float32)
    return {"x": x, "y": y.astype(np.float32)}


if __name__ == "__main__":
    np.savez("train.npz", **make(int(sys.argv[1]) if len(sys.argv) > 1 else 8192))
    print("wrote train.npz")
