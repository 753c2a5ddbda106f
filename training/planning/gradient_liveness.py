"""How many of a step's gradients are alive at once, by the compiler of the run's devices.

- libtpu, where the layout splits weights over `data` and there is no model axis (fsdp;
  `training/build.py` then leaves the gathers to it): each weight's gradient is
  reduce-scattered as the backward pass makes it, so what stays is each gradient split as
  its weight, beside the layer being differentiated: its gathered weights and their whole
  gradients, counted for the largest layer (its weights' paths but the last part). Read from
  libtpu's compiled steps for v5e slices of 4 to 256 chips
  (`tests/planning/test_compile_target.py`, README "Plan before launching").
- libtpu, where the layout splits weights over `data` and there is a model axis (hybrid +
  fsdp): the explicit gather's backward constrains each gradient to its weight's layout
  (`training.parallel.fsdp.gather_for_use`), which libtpu reduce-scatters weight by weight
  (an `all-reduce-scatter` fusion each), but its scheduler may place those after the whole
  backward pass, every gradient alive whole over `data` until then; the estimate counts
  them so, once (the scatter's output is split). Read from its buffers (`--xla_dump_to`,
  `*live-range.txt`) of the built-in transformer's step: at d_model 4096 on 256 v5e chips
  (hybrid 64 × 4) every reduce-scatter comes after the backward pass, its peak holding
  every MLP kernel's whole gradient; at d_model 1024 on 4 chips (2 × 2) each block's come
  after that block's backward pass.
- libtpu, where no trainable weight is split over `data` and there is no model axis (data
  parallel): its AllReduceCombiner joins the gradients' all-reduces into groups of at most
  `TPU_ALL_REDUCE_COMBINE_BYTES`, each reduced in place and consumed by the optimizer's
  update; the estimate counts the largest group, once (`largest_all_reduce_group`). Read
  from its memory-usage report (`--xla_dump_to`) and HLO for the models of
  `scripts/bench/plan_memory.py` on 4 v5e chips: the MLP's four 64 MiB kernel gradients each
  reduced alone, in one 64 MiB temporary they share; the transformer's 99 MiB of gradients
  in one all-reduce, alive together; the Llama's 130 MiB in two (16 and 114 MiB).
- XLA:CPU (and XLA:GPU, not measured here) makes every gradient of a weight split over
  `data` whole and all-reduces them together before slicing, with the explicit gather too:
  `training.planning.costs.made_gradient_bytes`, which the plan says it counts
  (`whole_gradients_note`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from training.contracts import LayoutRules
from training.models import axis_names, rule_axes
from training.parallel.fsdp import gathers_left_to_the_compiler
from training.parallel.mesh import MeshShape


def splits_over_data(rules: LayoutRules, trainable) -> bool:
    """Whether the layout splits any trainable weight over `data` (fsdp, keras-hub's rules)."""
    return any("data" in axis_names(rule_axes(path, rules)) for path in trainable)


# libtpu's (0.0.42.1) AllReduceCombiner joins all-reduces up to this size (its log, with
# LIBTPU_INIT_ARGS=--vmodule=all_reduce_combiner=3: "threshold of 125829120 bytes").
TPU_ALL_REDUCE_COMBINE_BYTES = 120 * 2**20


def all_reduced_in_groups(platform: str, mesh: MeshShape, rules: LayoutRules, trainable) -> bool:
    """Whether the run's compiled step all-reduces the gradients over `data` in libtpu's
    combined groups, each consumed by the update: on TPU, data parallel (no model axis, no
    trainable weight split over `data`)."""
    return (
        platform == "tpu"
        and mesh.data > 1
        and mesh.model == 1
        and not splits_over_data(rules, trainable)
    )


def largest_all_reduce_group(gradients: Iterable[int]) -> int:
    """The largest group libtpu's combiner makes of these gradients' all-reduces (bytes per
    device, in the step's order): each joins the first group it fits under
    `TPU_ALL_REDUCE_COMBINE_BYTES`, else starts one, as its log shows it place them."""
    groups: list[int] = []
    for size in gradients:
        fits = next(
            (i for i, total in enumerate(groups) if total + size <= TPU_ALL_REDUCE_COMBINE_BYTES),
            None,
        )
        if fits is None:
            groups.append(size)
        else:
            groups[fits] += size
    return max(groups, default=0)


def reduce_scattered_as_made(platform: str, mesh: MeshShape, rules: LayoutRules, trainable) -> bool:
    """Whether the run's compiled step reduce-scatters each gradient of a weight split over
    `data` as it is made: on TPU without a model axis, where the hosts' step leaves the
    gathers to libtpu (`training/build.py`)."""
    return gathers_left_to_the_compiler(platform, mesh.model) and splits_over_data(rules, trainable)


def whole_until_scattered(platform: str, mesh: MeshShape, rules: LayoutRules, trainable) -> bool:
    """Whether the run's compiled step may hold every gradient of a weight split over `data`
    whole over `data` at once, each until its own reduce-scatter: libtpu's with a model axis,
    whose step gathers those weights explicitly."""
    return platform == "tpu" and mesh.model > 1 and splits_over_data(rules, trainable)


@dataclass(frozen=True)
class ShardedGradients:
    """Per device, by weight path: each gradient split as its weight (`kept`), and as the
    step makes it, whole over `data` (`made`)."""

    kept: dict[str, int]
    made: dict[str, int]

    @property
    def window(self) -> int:
        """The largest layer's gathered weights and whole gradients, alive at once."""
        layers: dict[str, int] = {}
        for path, size in self.made.items():
            layer = path.rsplit("/", 1)[0]
            layers[layer] = layers.get(layer, 0) + size
        return 2 * max(layers.values(), default=0)

    @property
    def all_made(self) -> int:
        """Every split gradient, beside a layer's window."""
        return sum(self.kept.values()) + self.window


def whole_gradients_note(platform: str, mesh: MeshShape, rules: LayoutRules, trainable) -> str:
    """What the estimate counts of the gradients of weights split over `data`, where the
    run's compiler keeps them whole ("" where no weight is, or it does not)."""
    if not splits_over_data(rules, trainable) or reduce_scattered_as_made(
        platform, mesh, rules, trainable
    ):
        return ""
    if whole_until_scattered(platform, mesh, rules, trainable):
        return (
            "the estimate counts every gradient of a weight split over `data` whole over "
            "`data`, once: libtpu's step with a model axis reduce-scatters each on its own, "
            "but may schedule them all after the backward pass"
        )
    known = "as XLA:CPU's step does" if platform == "cpu" else f"not measured on {platform}"
    return (
        "the estimate counts every gradient of a weight split over `data` whole, and the "
        f"reduction's copy ({known}); libtpu without a model axis reduce-scatters each as it "
        "is made"
    )
