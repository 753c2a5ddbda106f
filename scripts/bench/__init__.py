"""Benchmarks: each module measures one ratio (or one table of one ratio) against a baseline
measured in the same run, and prints it with its target. Run from the repository root:

    python -m scripts.bench.host_overhead      # the hosts' loop against a jax.jit loop
    python -m scripts.bench.system_step        # the system's step against plain processes
    python -m scripts.bench.first_step         # time to first step against plain processes
    python -m scripts.bench.compile_cache      # a second run's compile against the first's
    python -m scripts.bench.warm_start         # first step on a running Ray instance
    python -m scripts.bench.accelerator_loops  # on one accelerator: against jit and fit
    python -m scripts.bench.comm_bytes         # collective bytes against the plan
    python -m scripts.bench.fsdp_memory        # fsdp's state and bytes against their minimum
    python -m scripts.bench.remat_cost         # remat's temporaries and step time
    python -m scripts.bench.plan_memory        # the plan's memory against the compiled step
    python -m scripts.bench.memory_budget      # a model over the budget
    python -m scripts.bench.build_memory       # memory held while building and restoring
    python -m scripts.bench.scaling            # examples/s at 1, 2, 4, 8 devices
    python -m scripts.bench.plan_speedup       # the plan's predicted speedups
    python -m scripts.bench.recovery           # recovery from a lost host
    python -m scripts.bench.sweep_concurrency  # a sweep run sequentially and two at a time

`harness` holds what they share; the `*_process` modules are the fresh processes some of
them start (a baseline's, or a run timed from its launch), not benchmarks.
"""
