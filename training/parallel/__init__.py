"""Parallelism as the hosts run it: the device mesh and the Keras distribution a strategy
gives (`mesh`), fully sharded data parallelism's split and gathering of weights (`fsdp`), and
the bytes of dtypes and arrays (`dtypes`). Used by the driver, the hosts and the planning
(`training.planning`) alike; it imports none of them.
"""
