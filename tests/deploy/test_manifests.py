#!/usr/bin/env python3
"""Static checks of deploy/: every YAML file parses; the Kubernetes manifests ask for a GPU,
probe over native gRPC, give the drain time to finish and take their flags from the
ConfigMap; the proxy configs hash on x-session-id; promtool accepts the Prometheus config
and rules; the Grafana dashboard is valid JSON. Runs in well under a second (plus promtool).
"""
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import unittest

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from deploy_util import DEPLOY, ROOT  # noqa: E402

K8S = os.path.join(DEPLOY, "k8s")


def load_all(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


class YamlSyntaxTest(unittest.TestCase):
    def test_every_yaml_file_parses(self):
        files = glob.glob(os.path.join(DEPLOY, "**", "*.y*ml"), recursive=True)
        self.assertGreater(len(files), 8)
        for path in files:
            with self.subTest(path=os.path.relpath(path, ROOT)):
                self.assertTrue(load_all(path))


class KubernetesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.kustomization = load_all(os.path.join(K8S, "kustomization.yaml"))[0]
        cls.docs = {}
        for name in os.listdir(K8S):
            if name != "kustomization.yaml" and name.endswith(".yaml"):
                for d in load_all(os.path.join(K8S, name)):
                    cls.docs[d["kind"]] = d

    def test_kustomization_lists_existing_files(self):
        for res in self.kustomization["resources"]:
            self.assertTrue(os.path.exists(os.path.join(K8S, res)), res)
        with open(os.path.join(K8S, "kustomization.yaml")) as f:
            self.assertIn("# - hpa.yaml", f.read())  # optional, documented, off by default
        self.assertIn("HorizontalPodAutoscaler", self.docs)

    def test_every_resource_has_kind_and_name(self):
        for kind in ("Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "PodMonitor"):
            self.assertIn(kind, self.docs)
        for d in self.docs.values():
            self.assertIn("apiVersion", d)
            self.assertTrue(d["metadata"]["name"])

    def container(self):
        return self.docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]

    def test_gpu_and_grpc_probes(self):
        c = self.container()
        self.assertEqual(c["resources"]["limits"]["nvidia.com/gpu"], 1)
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            self.assertEqual(c[probe]["grpc"]["port"], 50051, probe)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        self.assertEqual(ports, {"grpc": 50051, "http": 8080, "metrics": 9090})

    def test_grace_period_covers_prestop_and_drain(self):
        spec = self.docs["Deployment"]["spec"]["template"]["spec"]
        pre_stop = self.container()["lifecycle"]["preStop"]["sleep"]["seconds"]
        drain = int(self.docs["ConfigMap"]["data"]["DRAIN_SECONDS"])
        self.assertGreater(spec["terminationGracePeriodSeconds"], pre_stop + drain)

    def test_args_come_from_the_configmap(self):
        c = self.container()
        data = self.docs["ConfigMap"]["data"]
        self.assertEqual(c["envFrom"][0]["configMapRef"]["name"],
                         self.docs["ConfigMap"]["metadata"]["name"])
        used = set()
        for arg in c["args"]:
            self.assertRegex(arg, r"^--[a-z-]+=")
            used.update(re.findall(r"\$\((\w+)\)", arg))
        self.assertEqual(used, set(data), "ConfigMap keys and $(VARS) in args differ")

    def test_session_dir_is_a_writable_volume(self):
        # The root filesystem is read-only: the sessions SIGTERM writes need a mounted volume.
        c = self.container()
        dirs = [a.split("=", 1)[1] for a in c["args"] if a.startswith("--session-dir=")]
        self.assertEqual(len(dirs), 1)
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
        self.assertIn(dirs[0], mounts)
        volumes = {v["name"] for v in self.docs["Deployment"]["spec"]["template"]["spec"]["volumes"]}
        self.assertIn(mounts[dirs[0]], volumes)

    def test_services_select_the_pods(self):
        labels = self.docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
        for name in ("service.yaml", "service-headless.yaml"):
            svc = load_all(os.path.join(K8S, name))[0]
            for k, v in svc["spec"]["selector"].items():
                self.assertEqual(labels.get(k), v, name)
        headless = load_all(os.path.join(K8S, "service-headless.yaml"))[0]
        self.assertEqual(headless["spec"]["clusterIP"], "None")
        self.assertEqual(self.docs["PodMonitor"]["spec"]["podMetricsEndpoints"][0]["port"],
                         "metrics")


class ProxyConfigTest(unittest.TestCase):
    def test_envoy_ring_hash_on_session_header(self):
        cfg = load_all(os.path.join(DEPLOY, "envoy", "envoy.yaml"))[0]
        cluster = cfg["static_resources"]["clusters"][0]
        self.assertEqual(cluster["lb_policy"], "RING_HASH")
        opts = cluster["typed_extension_protocol_options"][
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
        self.assertIn("http2_protocol_options", opts["explicit_http_config"])
        hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        route = hcm["typed_config"]["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
        self.assertEqual(route["cluster"], cluster["name"])
        self.assertEqual(route["hash_policy"][0]["header"]["header_name"], "x-session-id")

    def test_nginx_hashes_on_session_header(self):
        with open(os.path.join(DEPLOY, "nginx", "subspace.conf")) as f:
            text = f.read()
        self.assertRegex(text, r"hash \$http_x_session_id consistent;")
        self.assertRegex(text, r"grpc_pass grpc://subspace;")
        self.assertRegex(text, r"listen \d+ http2;")
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        if os.path.exists(nginx):  # full syntax check: wrapped as the affinity test runs it
            from test_affinity import nginx_config  # noqa: E402
            import tempfile
            with tempfile.TemporaryDirectory() as tmp:
                conf = nginx_config(tmp, 18080, ["127.0.0.1:1", "127.0.0.1:2"])
                r = subprocess.run([nginx, "-t", "-q", "-p", tmp, "-c", conf,
                                    "-e", os.path.join(tmp, "error.log")],
                                   capture_output=True, text=True)
                self.assertEqual(r.returncode, 0, r.stderr)


class PrometheusConfigTest(unittest.TestCase):
    def setUp(self):
        self.promtool = shutil.which("promtool")
        if not self.promtool:
            self.skipTest("promtool not installed (Debian prometheus)")

    def test_config_and_rules(self):
        for args in (["check", "config", os.path.join(DEPLOY, "prometheus", "prometheus.yml")],
                     ["check", "rules", os.path.join(DEPLOY, "prometheus", "alerts.yml")]):
            r = subprocess.run([self.promtool, *args], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_alerts_cover_the_runbook(self):
        rules = load_all(os.path.join(DEPLOY, "prometheus", "alerts.yml"))[0]
        names = [r["alert"] for g in rules["groups"] for r in g["rules"]]
        with open(os.path.join(ROOT, "docs", "operations.md")) as f:
            doc = f.read()
        for name in names:
            self.assertIn("### " + name, doc, "docs/operations.md has no runbook for " + name)


class GrafanaTest(unittest.TestCase):
    def test_dashboard_json(self):
        with open(os.path.join(DEPLOY, "grafana", "subspace.json")) as f:
            dash = json.load(f)
        self.assertEqual(dash["uid"], "subspace")
        ids = [p["id"] for p in dash["panels"]]
        self.assertEqual(len(ids), len(set(ids)))
        for p in dash["panels"]:
            self.assertTrue(p["targets"], p["title"])


if __name__ == "__main__":
    unittest.main()
