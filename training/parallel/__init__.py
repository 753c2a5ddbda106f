"""Parallelism: the device mesh and the Keras distribution a strategy gives (`mesh`), the
layout rules derived from a model (`auto_layout`), fully sharded data parallelism's split and
gathering of weights (`fsdp`), and the analysis behind `training.plan`: what each mesh axis
sends (`tensor_parallel` over `layer_graph`, `collectives`, `megatron`), what a step holds
(`activations`, `costs`, `dtypes`) and its time (`costs`), and what a compiled step really
holds and sends (`compiled`). Used by the driver and the hosts alike; it imports neither.
"""
