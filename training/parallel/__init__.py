"""Parallelism: the device mesh and the Keras distribution a strategy gives (`mesh`), the
layout rules derived from a model (`auto_layout`), and the analysis behind `training.plan`:
what each mesh axis sends (`tensor_parallel` over `layer_graph`, `collectives`, `megatron`),
memory and step time (`costs`, `dtypes`), and what a compiled step really holds and sends
(`compiled`). Used by the driver and the hosts alike; it imports neither.
"""
