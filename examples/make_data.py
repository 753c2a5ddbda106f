"""Data for the example models: `train.npz` for the regression MLP, x (8192 × 16, float32)
and y = a fixed smooth function of x plus noise (8192 × 1); `images.npz` for the classifier,
x (8192 × 8 × 8 × 1) noisy images of 10 fixed patterns and y their class ids (8192).
`python make_data.py [rows]`."""

import sys

import numpy as np


def make(rows: int = 8192, features: int = 16, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, features), dtype=np.float32)
    weights = rng.standard_normal((features, 1)).astype(np.float32) / np.sqrt(features)
    y = np.tanh(x @ weights) + 0.05 * rng.standard_normal((rows, 1), dtype=np.float32)
    return {"x": x, "y": y.astype(np.float32)}


def make_images(
    rows: int = 8192, classes: int = 10, size: int = 8, noise: float = 1.0, seed: int = 0
) -> dict[str, np.ndarray]:
    """Each class is a fixed random pattern; an example is its class's pattern plus noise."""
    rng = np.random.default_rng(seed)
    patterns = rng.standard_normal((classes, size, size, 1), dtype=np.float32)
    y = rng.integers(0, classes, rows)
    x = patterns[y] + noise * rng.standard_normal((rows, size, size, 1), dtype=np.float32)
    return {"x": x.astype(np.float32), "y": y.astype(np.int32)}


if __name__ == "__main__":
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    np.savez("train.npz", **make(rows))
    np.savez("images.npz", **make_images(rows))
    print("wrote train.npz and images.npz")
