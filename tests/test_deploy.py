"""The Kubernetes manifests (deploy/kubernetes/) against the image and the code.

Every port, probe path, user, signal and grace a manifest names must be the
one the image serves: read here from the Dockerfile and from the code, never
typed a second time in the test. The objects checked are what ``kubectl kustomize``
renders (this machine's kubectl, kustomize v5), the base and each overlay, so a layout
kustomize refuses (an overlay inside its own base: "cycle detected") fails here.
(tests/test_container.py runs the image under the same constraints: read-only root,
the /tmp volume, the user, no capabilities.)
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import subprocess

import pytest
from conftest import ROOT

from orisha.serving.admin import HEALTH_PATH, METRICS_PATH, READY_PATH
from orisha.serving.pool import STOP_SIGNALS
from orisha.targets.container import runtime

yaml = pytest.importorskip("yaml")

DEPLOY = os.path.join(ROOT, "deploy", "kubernetes")
BASE = os.path.join(DEPLOY, "base")
OVERLAYS = os.path.join(DEPLOY, "overlays")


def kustomizations() -> list[str]:
    """Every folder under deploy/ with a kustomization."""
    return sorted(os.path.dirname(p) for p in glob.glob(os.path.join(ROOT, "deploy", "**",
                                                                     "kustomization.yaml"),
                                                        recursive=True))


def render(folder: str) -> list[dict]:
    """The objects ``kubectl kustomize folder`` renders (kubectl must be there: no skip)."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is not installed (this machine kind has it: /usr/bin/kubectl)"
    r = subprocess.run([kubectl, "kustomize", folder], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"kubectl kustomize {os.path.relpath(folder, ROOT)}: {r.stderr}"
    return [d for d in yaml.safe_load_all(r.stdout) if d]


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


def by_kind(docs: list[dict]) -> dict[str, dict]:
    out = {}
    for doc in docs:
        assert doc["kind"] not in out, f"two {doc['kind']} objects"
        out[doc["kind"]] = doc
    return out


@pytest.fixture(scope="module")
def k8s():
    return by_kind(render(BASE))


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


def test_every_kustomization_renders_and_lists_its_files():
    """The base and both overlays render; each lists every manifest beside it (none forgotten)."""
    folders = kustomizations()
    assert folders == [BASE, os.path.join(OVERLAYS, "tls-acme"),
                       os.path.join(OVERLAYS, "tls-cert-manager")]
    for folder in folders:
        assert render(folder)
        with open(os.path.join(folder, "kustomization.yaml")) as f:
            k = yaml.safe_load(f)
        named = set(k.get("resources", [])) | {p["path"] for p in k.get("patches", []) if "path" in p}
        beside = {os.path.basename(p) for p in glob.glob(os.path.join(folder, "*.yaml"))
                  if not p.endswith("kustomization.yaml")}
        assert beside <= named, (folder, beside - named)


def test_the_base_renders_the_three_objects(k8s):
    assert set(k8s) == {"Deployment", "Service", "PodDisruptionBudget"}


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


def _env_args(container: dict):
    """The executable's options under the image's ENV and the container's env."""
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(image_env())
        os.environ.update({e["name"]: e["value"] for e in container["env"] if "value" in e})
        return runtime.parser().parse_args(container.get("args", []))
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _overlay(name: str):
    objs = by_kind(render(os.path.join(OVERLAYS, name)))
    (c,) = objs["Deployment"]["spec"]["template"]["spec"]["containers"]
    return objs, c


def _ports_line_up(objs: dict, c: dict) -> None:
    """The ports the executable binds under the env are the container's named ports, and
    the Service targets them by name, h3 over UDP on the TLS port's number."""
    args = _env_args(c)
    named = {p["name"]: (p["containerPort"], p.get("protocol", "TCP")) for p in c["ports"]}
    assert named["https"] == (args.port, "TCP") and named["h3"] == (args.port, "UDP")
    assert named["http"] == (args.http_port, "TCP") and args.http3
    for p in objs["Service"]["spec"]["ports"]:
        assert p["targetPort"] in named and named[p["targetPort"]][1] == p.get("protocol", "TCP")
    assert named["admin"] == (args.admin_port, "TCP")
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[kind]["httpGet"]["port"] in named, kind
    help_text = runtime.parser().format_help()
    assert all(f"${e['name']}" in help_text for e in c["env"])


def test_the_acme_overlay_renders_one_replica_with_its_state_volume():
    objs, c = _overlay("tls-acme")
    spec = objs["Deployment"]["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    args = _env_args(c)
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["DOMAINS"] and args.acme_email  # what the executable orders a certificate for
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["state"] == args.state
    (claim,) = [v for v in spec["template"]["spec"]["volumes"] if v["name"] == "state"]
    assert claim["persistentVolumeClaim"]["claimName"] == objs["PersistentVolumeClaim"]["metadata"]["name"]
    assert objs["Service"]["spec"]["type"] == "LoadBalancer"
    _ports_line_up(objs, c)


def test_the_cert_manager_overlay_mounts_the_secret_the_certificate_names():
    objs, c = _overlay("tls-cert-manager")
    spec = objs["Deployment"]["spec"]
    assert spec["replicas"] >= 2 and spec["strategy"]["type"] == "RollingUpdate"
    args = _env_args(c)
    (tls,) = [v for v in spec["template"]["spec"]["volumes"] if v["name"] == "tls"]
    assert tls["secret"]["secretName"] == objs["Certificate"]["spec"]["secretName"]
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "tls"]
    assert "subPath" not in mount  # a subPath file is never updated on renewal
    (cert,), (key,) = args.tls_cert, args.tls_key  # --tls-cert repeats (SNI): one pair here
    assert os.path.dirname(cert) == mount["mountPath"] == os.path.dirname(key)
    _ports_line_up(objs, c)
