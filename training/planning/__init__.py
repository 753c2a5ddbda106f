"""The analysis behind `training.plan` and the driver's checks: the layout rules derived from
a model (`auto_layout`), what each mesh axis sends (`tensor_parallel` over `layer_graph`,
`collectives`, `megatron`), what a step holds (`activations`, `costs`) and its time
(`costs`), and what a compiled step really holds and sends (`compiled`). Above
`training.build` and `training.parallel`, below the driver and the hosts.
"""
