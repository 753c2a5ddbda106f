"""The KubeRay manifests of cluster/kuberay/: made by `python -m training.kuberay` from the
run config (each file its output, as its first line says), valid against KubeRay's own CRD
schemas and Kubernetes' pod schema, and the cluster the `ray up` configs describe as Ray's own
KubeRay autoscaler reads them. No Ray instance is started."""

import copy
import functools
import gzip
import re
import shlex
from importlib.metadata import version
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from ray.autoscaler._private.kuberay.autoscaling_config import (
    _derive_autoscaling_config_from_ray_cr,
)
from ray.autoscaler._private.kuberay.utils import gke_tpu_accelerator_to_generation

from training import kuberay
from training.config import ConfigError

REPO = Path(__file__).resolve().parent.parent
MANIFESTS = sorted((REPO / "cluster" / "kuberay").glob("*.yaml"))
# The KubeRay release whose CRDs the manifests are checked against (its `authOptions`, token
# authentication, needs 1.5 or later), and its CRDs as the KubeRay repository has them at that
# tag, vendored (kuberay_crds/SOURCE.md says from where): no package registry ships them.
KUBERAY_RELEASE = "v1.7.0"
CRD_DIR = Path(__file__).resolve().parent / "kuberay_crds" / KUBERAY_RELEASE
CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml.gz", "RayJob": "ray.io_rayjobs.yaml.gz"}
# The Kubernetes release whose pod schema the pod templates are checked against.
KUBERNETES_VERSION = "1.33"


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def made_by(path: Path) -> list[str]:
    """The arguments of the `python -m training.kuberay` command on the manifest's first line."""
    first = path.read_text().splitlines()[0]
    prefix = "# python -m training.kuberay "
    assert first.startswith(prefix), f"{path.name}: no command on its first line"
    return shlex.split(first.removeprefix(prefix))


def cluster_spec(resource: dict) -> dict:
    return resource["spec"].get("rayClusterSpec", resource["spec"])


def pod_templates(resource: dict) -> list[dict]:
    spec = cluster_spec(resource)
    return [spec["headGroupSpec"]["template"]] + [
        group["template"] for group in spec["workerGroupSpecs"]
    ]


def test_the_manifests_are_a_rayjob_and_a_raycluster_for_gpu_and_for_tpu():
    found = set()
    for path in MANIFESTS:
        resource = load(path)
        limits = pod_templates(resource)[1]["spec"]["containers"][0]["resources"]["limits"]
        platform = (
            "tpu" if "google.com/tpu" in limits else "gpu" if "nvidia.com/gpu" in limits else "?"
        )
        found.add((resource["kind"], platform))
    assert found == {(kind, p) for kind in ("RayJob", "RayCluster") for p in ("gpu", "tpu")}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda path: path.name)
def test_each_manifest_is_what_its_command_renders_from_the_run_config(path):
    assert kuberay.render(made_by(path)) == path.read_text(), (
        f"{path.name} is not what its first line renders now; run that command again "
        f"(> {path.relative_to(REPO)})"
    )


@pytest.mark.parametrize(
    "path", [p for p in MANIFESTS if load(p)["kind"] == "RayJob"], ids=lambda path: path.name
)
def test_a_rayjob_runs_training_run_with_the_overrides_it_was_made_from(path):
    overrides = [a for a in made_by(path) if not a.startswith("-") and "=" in a]
    assert load(path)["spec"]["entrypoint"] == shlex.join(
        ["python", "-m", "training.run", *overrides]
    )


# --- the cluster the `ray up` configs describe, as Ray's KubeRay autoscaler reads it ----------


def ray_node_types(resource: dict) -> dict:
    """The node types Ray's KubeRay autoscaler derives from the manifest's cluster."""
    ray_cr = {"metadata": {"name": "t", "namespace": "default"}, "spec": cluster_spec(resource)}
    return _derive_autoscaling_config_from_ray_cr(ray_cr)["available_node_types"]


def ray_up_worker_type(config: str) -> dict:
    ray_up = load(REPO / "cluster" / config)
    (worker,) = (
        t for n, t in ray_up["available_node_types"].items() if n != ray_up["head_node_type"]
    )
    return worker


@pytest.mark.parametrize(
    "path", [p for p in MANIFESTS if p.name.startswith("tpu-")], ids=lambda path: path.name
)
def test_the_tpu_manifests_give_ray_the_slice_of_the_ray_up_config(path):
    """gcp-tpu.yaml's slice (acceleratorType v5litepod-16) is what Ray reads from the pods'
    TPU node selectors and limits: its head resource once, and each VM's chips on each host."""
    slice_type = ray_up_worker_type("gcp-tpu.yaml")["node_config"]["acceleratorType"]
    hosts = ray_node_types(load(path))[kuberay.WORKER_GROUP]
    assert hosts["resources"][f"TPU-{slice_type}-head"] == 1
    chips = int(slice_type.rsplit("-", 1)[1])  # a v5e chip is one core: v5litepod-16 is 16 chips
    assert hosts["resources"]["TPU"] * hosts["max_workers"] == chips
    assert hosts["min_workers"] == hosts["max_workers"]


@pytest.mark.parametrize(
    "path", [p for p in MANIFESTS if p.name.startswith("gpu-")], ids=lambda path: path.name
)
@pytest.mark.parametrize("config", ["aws.yaml", "gcp.yaml"])
def test_the_gpu_manifests_give_ray_the_gpu_nodes_of_the_ray_up_configs(path, config):
    ray_up = ray_up_worker_type(config)
    hosts = ray_node_types(load(path))[kuberay.WORKER_GROUP]
    assert hosts["resources"]["GPU"] == ray_up["resources"]["GPU"]
    assert hosts["min_workers"] == hosts["max_workers"] == ray_up["max_workers"]


def test_each_tpu_version_is_labelled_as_rays_kuberay_autoscaler_reads_gke_labels():
    assert {
        version: gke_tpu_accelerator_to_generation[label]
        for version, label in kuberay.GKE_TPU_ACCELERATORS.items()
    } == {version: version for version in kuberay.GKE_TPU_ACCELERATORS}


def test_a_host_resource_marks_the_pods_as_ray_reads_them():
    resource = kuberay.manifest(
        "cluster",
        "t",
        ["cluster=ray", "cluster.hosts=3", "cluster.devices_per_host=4", "cluster.host_resource=h"],
        kuberay.Pods("i", "8", "32Gi", "24", "128Gi"),
    )
    hosts = ray_node_types(resource)[kuberay.WORKER_GROUP]
    assert (hosts["resources"]["h"], hosts["resources"]["GPU"], hosts["max_workers"]) == (1, 4, 3)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["cluster=local"], "cluster=local: a KubeRay cluster is a Ray cluster the run joins"),
        (["cluster=ray"], "cluster.hosts is read from a running cluster; give it"),
        (
            [
                "cluster=ray",
                "cluster.platform=cpu",
                "cluster.hosts=2",
                "cluster.devices_per_host=1",
            ],
            "cluster.platform=cpu: KubeRay manifests are made for GPU hosts",
        ),
        (
            ["cluster=ray", "cluster.platform=tpu"],
            "cluster.platform=tpu on Kubernetes needs the slice",
        ),
        (
            [
                "cluster=ray",
                "cluster.platform=tpu",
                "cluster.tpu_topology=2x2",
                "cluster.tpu_version=v3",
            ],
            "cluster.tpu_version=v3 has no GKE TPU node pool",
        ),
    ],
)
def test_a_config_that_does_not_say_which_pods_fails_clearly(overrides, message, capsys):
    assert kuberay.main(overrides) == 2
    assert f"error: {message}" in capsys.readouterr().err
    with pytest.raises(ConfigError):
        kuberay.manifest("job", "t", overrides, kuberay.Pods("i", "1", "1Gi", "1", "1Gi"))


def test_the_image_is_of_the_ray_the_manifests_name_and_the_project_pins():
    dockerfile = (REPO / "cluster" / "kuberay" / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE=rayproject/ray:(\S+)-py311$", dockerfile, re.M)[1] == (
        kuberay.RAY_VERSION
    )
    assert version("ray").split(".")[:2] == kuberay.RAY_VERSION.split(".")[:2]


# --- KubeRay's CRD schemas ------------------------------------------------------------------


def refusing_unknown_fields(schema: dict) -> dict:
    """`schema` with unknown fields refused wherever the CRD does not keep them
    (x-kubernetes-preserve-unknown-fields), as the API server's strict field validation
    (kubectl's default since Kubernetes 1.27) refuses them; plain JSON Schema allows them."""
    strict = dict(schema)
    if "properties" in schema:
        strict["properties"] = {
            k: refusing_unknown_fields(v) for k, v in schema["properties"].items()
        }
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            strict.setdefault("additionalProperties", False)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            strict[key] = refusing_unknown_fields(schema[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in schema:
            strict[key] = [refusing_unknown_fields(s) for s in schema[key]]
    return strict


@functools.cache
def crd_validator(kind: str) -> jsonschema.Draft202012Validator:
    """The validator of the CRD's served version (libyaml reads its megabyte in a second)."""
    path = CRD_DIR / CRD_FILES[kind]
    crd = yaml.load(gzip.decompress(path.read_bytes()), Loader=yaml.CSafeLoader)
    served = kuberay.API_VERSION.split("/")[1]
    (schema,) = (
        v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v["name"] == served
    )
    return jsonschema.Draft202012Validator(refusing_unknown_fields(schema))


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda path: path.name)
def test_each_manifest_is_valid_against_kuberays_crd(path):
    resource = load(path)
    crd_validator(resource["kind"]).validate(resource)


def misspelt_num_of_hosts(group: dict) -> None:
    group["numOfHost"] = group.pop("numOfHosts")


BROKEN_FIELDS = {
    "a count as text": lambda group: group.update(numOfHosts="four"),
    "a required field missing": lambda group: group.pop("groupName"),
    "a misspelt field": misspelt_num_of_hosts,
    "a limit that is no quantity": lambda group: group["template"]["spec"]["containers"][0][
        "resources"
    ]["limits"].update(cpu=["24"]),
}


@pytest.mark.parametrize("break_field", BROKEN_FIELDS.values(), ids=BROKEN_FIELDS)
@pytest.mark.parametrize("kind", ["RayJob", "RayCluster"])
def test_the_crd_check_refuses_a_broken_worker_group(kind, break_field):
    validator = crd_validator(kind)
    resource = load(next(p for p in MANIFESTS if load(p)["kind"] == kind))
    validator.validate(resource)
    broken = copy.deepcopy(resource)
    break_field(cluster_spec(broken)["workerGroupSpecs"][0])
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(broken)


# --- Kubernetes' own pod schema (kubernetes-validate, from PyPI) -----------------------------


def validate_pod_template(template: dict) -> None:
    pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}}
    kubernetes_validate.validate({**pod_template, "template": template}, KUBERNETES_VERSION, True)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda path: path.name)
def test_each_pod_template_is_valid_against_kubernetes_pod_schema(path):
    for template in pod_templates(load(path)):
        validate_pod_template(template)


@pytest.mark.parametrize(
    "break_pod",
    [
        lambda spec: spec.update(nodeSelectors=spec.pop("nodeSelector")),
        lambda spec: spec["containers"][0].update(resources={"limit": {"cpu": "1"}}),
        lambda spec: spec["containers"][0].pop("name"),
    ],
    ids=["a misspelt field", "a misspelt nested field", "a required field missing"],
)
def test_the_pod_check_refuses_a_broken_pod(break_pod):
    template = pod_templates(load(MANIFESTS[-1]))[1]  # a TPU host pod
    validate_pod_template(template)
    broken = copy.deepcopy(template)
    break_pod(broken["spec"])
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_pod_template(broken)
