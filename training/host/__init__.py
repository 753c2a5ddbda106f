"""The host runtime: what runs in each host's process, one per host of the JAX cluster. The
Ray actor (`actor`) joins `jax.distributed` and runs the trainer (`trainer`), which feeds
this host's rows of every batch (`feed`) to the compiled step (`loop`, `compile_cache`),
saves and restores its shards (`checkpoints`), and tells the driver what it does through
events (`phases`, `warnings`, `training.events`). It never imports the driver.
"""
