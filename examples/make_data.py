"""Data for the example models: `train.npz` for the regression MLP, x (8192 × 16, float32)
and y = a fixed smooth function of x plus noise (8192 × 1); `images.npz` for the classifier,
x (8192 × 8 × 8 × 1) noisy images of 10 fixed patterns and y their class ids (8192);
`tickets.npz` for the ticket model of two outputs, `x_title`, `x_body`, `x_tags`,
`y_priority` and `y_department`. `python make_data.py [rows]`."""

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


def make_tickets(
    rows: int = 8192,
    num_words: int = 10000,
    num_tags: int = 12,
    num_departments: int = 4,
    title_length: int = 10,
    body_length: int = 40,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Support tickets as the ticket model reads them: a title and a body of token ids, tags
    multi-hot; the department is told by the title's first word, the priority (a number in
    [0, 1], the target of a binary cross-entropy) by the tags."""
    rng = np.random.default_rng(seed)
    title = rng.integers(1, num_words, (rows, title_length))
    body = rng.integers(1, num_words, (rows, body_length))
    tags = rng.integers(0, 2, (rows, num_tags)).astype(np.float32)
    department = title[:, 0] % num_departments
    urgency = tags @ rng.standard_normal(num_tags).astype(np.float32)
    priority = 1 / (1 + np.exp(-urgency))
    return {
        "x_title": title.astype(np.int32),
        "x_body": body.astype(np.int32),
        "x_tags": tags,
        "y_priority": priority[:, None].astype(np.float32),
        "y_department": department.astype(np.int32),
    }


if __name__ == "__main__":
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    np.savez("train.npz", **make(rows))
    np.savez("images.npz", **make_images(rows))
    np.savez("tickets.npz", **make_tickets(rows))
    print("wrote train.npz, images.npz and tickets.npz")
