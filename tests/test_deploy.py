"""The Kubernetes manifests (deploy/kubernetes/) against the image and the code.

Every port, probe path, user, signal and grace a manifest names must be the
one the image serves: read here from the Dockerfile and from the code, never
typed a second time in the test. (tests/test_container.py runs the image under
the same constraints: read-only root, the /tmp volume, the user, no capabilities.)
"""

from __future__ import annotations

import glob
import os
import re
import signal

import pytest
from conftest import ROOT

from orisha.admin import HEALTH_PATH, METRICS_PATH, READY_PATH
from orisha.supervisor import STOP_SIGNALS
from orisha.targets.container import runtime

yaml = pytest.importorskip("yaml")

DEPLOY = os.path.join(ROOT, "deploy", "kubernetes")


def dockerfile() -> dict[str, list[str]]:
    """Instruction → its argument lines (continuations joined, comments dropped)."""
    out: dict[str, list[str]] = {}
    with open(os.path.join(ROOT, "Dockerfile")) as f:
        text = re.sub(r"\\\n", " ", f.read())
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.setdefault(word.upper(), []).append(rest.strip())
    return out


def image_env() -> dict[str, str]:
    env = {}
    for arg in dockerfile().get("ENV", []):
        for pair in arg.split():
            k, _, v = pair.partition("=")
            env[k] = v
    return env


def manifests() -> dict[str, dict]:
    docs = {}
    for path in sorted(glob.glob(os.path.join(DEPLOY, "*.yaml"))):
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                docs[doc["kind"]] = doc
    return docs


@pytest.fixture(scope="module")
def k8s():
    return manifests()


@pytest.fixture(scope="module")
def pod(k8s):
    return k8s["Deployment"]["spec"]["template"]


@pytest.fixture(scope="module")
def container(pod):
    (c,) = pod["spec"]["containers"]
    return c


def port_number(container: dict, port) -> int:
    """A probe's or Service's port: a number, or the name of a container port."""
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p["name"] == port)


def served_ports() -> tuple[int, int]:
    """(site port, admin port) the image serves: the executable's defaults under the image's ENV."""
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(image_env())
        args = runtime.parser().parse_args([])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert args.admin_port, "the image does not turn the admin port on"
    return args.port, args.admin_port


def test_every_manifest_parses_and_the_kustomization_lists_them(k8s):
    assert set(k8s) == {"Deployment", "Service", "PodDisruptionBudget", "Kustomization"}
    listed = set(k8s["Kustomization"]["resources"])
    assert listed == {os.path.basename(p) for p in glob.glob(os.path.join(DEPLOY, "*.yaml"))
                      if not p.endswith("kustomization.yaml")}


def test_ports_are_the_ones_the_image_serves(k8s, pod, container):
    site, admin = served_ports()
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert named == {"http": site, "admin": admin}
    exposed = {int(p.split("/")[0]) for arg in dockerfile()["EXPOSE"] for p in arg.split()}
    assert {site, admin} <= exposed
    (svc_port,) = k8s["Service"]["spec"]["ports"]
    assert port_number(container, svc_port["targetPort"]) == site
    notes = pod["metadata"]["annotations"]
    assert int(notes["prometheus.io/port"]) == admin and notes["prometheus.io/path"] == METRICS_PATH


def test_probes_name_the_admin_paths(container):
    _, admin = served_ports()
    probes = {kind: container[kind]["httpGet"] for kind in
              ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probes["startupProbe"]["path"] == READY_PATH
    assert probes["readinessProbe"]["path"] == READY_PATH
    assert probes["livenessProbe"]["path"] == HEALTH_PATH
    assert all(port_number(container, p["port"]) == admin for p in probes.values())
    # The image's own HEALTHCHECK runs the probe of its PID 1, /init (default URL: /readyz on
    # $ADMIN_PORT), which runs the executable: ENTRYPOINT ["/init", "/orisha"].
    (entry,) = dockerfile()["ENTRYPOINT"]
    (check,) = dockerfile()["HEALTHCHECK"]
    cmd = re.search(r"CMD (\[.*\])", check).group(1)
    init, exe = yaml.safe_load(entry)
    assert exe == "/orisha" and yaml.safe_load(cmd) == [init, "--health"]


def test_user_and_filesystem_match_the_image(pod, container):
    uid, gid = (int(x) for x in dockerfile()["USER"][0].split(":"))
    sec = pod["spec"]["securityContext"]
    assert (sec["runAsUser"], sec["runAsGroup"], sec["runAsNonRoot"]) == (uid, gid, True)
    csec = container["securityContext"]
    assert csec["readOnlyRootFilesystem"] and not csec["allowPrivilegeEscalation"]
    assert csec["capabilities"]["drop"] == ["ALL"]
    # Read-only root: /tmp (where the executable unpacks) must be a writable volume.
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]


def test_signals_and_grace_cover_a_graceful_stop(pod, container):
    # Kubernetes sends SIGTERM (it ignores the image's STOPSIGNAL): both must be a graceful stop.
    (stop,) = dockerfile()["STOPSIGNAL"]
    assert signal.Signals[stop] in STOP_SIGNALS and signal.SIGTERM in STOP_SIGNALS
    args = runtime.parser().parse_args(container.get("args", []))  # the default, or --grace
    pre = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["spec"]["terminationGracePeriodSeconds"] >= pre + runtime.stop_seconds(args.grace)


def test_workers_follow_the_cpu_limit(container):
    env = {e["name"]: e for e in container["env"]}
    ref = env["WORKERS"]["valueFrom"]["resourceFieldRef"]
    assert ref["resource"] == "limits.cpu" and str(ref["divisor"]) == "1"
    assert "limits" in container["resources"] and "cpu" in container["resources"]["limits"]
    # every variable set here is one the executable reads
    help_text = runtime.parser().format_help()
    assert all(f"${name}" in help_text for name in env)


def test_rollouts_and_disruptions_keep_replicas_serving(k8s, pod):
    spec = k8s["Deployment"]["spec"]
    roll = spec["strategy"]["rollingUpdate"]
    assert spec["strategy"]["type"] == "RollingUpdate" and roll["maxUnavailable"] == 0
    assert roll["maxSurge"] >= 1 and spec["replicas"] >= 2
    labels = pod["metadata"]["labels"]
    for selector in (spec["selector"]["matchLabels"], k8s["Service"]["spec"]["selector"],
                     k8s["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= labels.items()
    pdb = k8s["PodDisruptionBudget"]["spec"]
    # A budget that allows no disruption would block every node drain.
    assert pdb.get("maxUnavailable", 0) >= 1 or pdb["minAvailable"] < spec["replicas"]
