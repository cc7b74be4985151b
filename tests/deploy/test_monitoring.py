#!/usr/bin/env python3
"""Monitoring against a real subspace-server on 127.0.0.1:

- PrometheusScrapeTest: a real Prometheus (Debian `prometheus`), storage in a temporary
  directory, scrapes the server every second with deploy/prometheus/alerts.yml loaded; after
  a few requests the query API returns subspace_generation_tokens_total > 0, and the rules
  are loaded and healthy.
- GrafanaMetricsTest: every subspace_* name in deploy/grafana/subspace.json's queries is a
  metric the server exports (histograms with their _bucket/_sum/_count series), and so is
  every subspace_* name in the alert rules.

    test_monitoring.py [PrometheusScrapeTest | GrafanaMetricsTest]
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.parse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from deploy_util import (DEPLOY, Server, free_port, run_client, stop_process,  # noqa: E402
                         wait_http)

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
SERVER = None


def setUpModule():
    global SERVER
    SERVER = Server()


def tearDownModule():
    if SERVER is not None:
        code = SERVER.stop()
        assert code == 0, "subspace-server exited %s after SIGTERM" % code


def exported_series(metrics_text):
    """Names of the series in a Prometheus text exposition, plus the family names of
    histograms and summaries (declared in # TYPE lines)."""
    names = set()
    for line in metrics_text.splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            names.add(re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0))
    return names


def query_names(expr):
    return set(re.findall(r"\bsubspace_[a-z0-9_]+", expr))


def run_requests(n=3):
    for i in range(n):
        r = run_client("--server", SERVER.address, "generate", "--prompt",
                       "In the beginning %d" % i, "--max-new-tokens", "8")
        assert r.returncode == 0, r.stderr


@unittest.skipUnless(os.path.exists(PROMETHEUS), "prometheus not installed (Debian prometheus)")
class PrometheusScrapeTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="subspace-prom-")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        shutil.copy(os.path.join(DEPLOY, "prometheus", "alerts.yml"), self.tmp)
        conf = os.path.join(self.tmp, "prometheus.yml")
        with open(conf, "w") as f:
            f.write(f"""global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files: [alerts.yml]
scrape_configs:
  - job_name: subspace
    static_configs:
      - targets: ["127.0.0.1:{SERVER.metrics_port}"]
""")
        self.url = "http://127.0.0.1:%d" % free_port()
        self.prom = subprocess.Popen(
            [PROMETHEUS, "--config.file=" + conf,
             "--storage.tsdb.path=" + os.path.join(self.tmp, "data"),
             "--web.listen-address=" + self.url[len("http://"):],
             "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        self.addCleanup(stop_process, self.prom)
        wait_http(self.url + "/-/ready", timeout_s=30, proc=self.prom)

    def api(self, path, **params):
        body = wait_http(self.url + path + "?" + urllib.parse.urlencode(params), timeout_s=10)
        reply = json.loads(body)
        self.assertEqual(reply["status"], "success", body)
        return reply["data"]

    def query_until(self, expr, pred, timeout_s=20):
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.api("/api/v1/query", query=expr)["result"]
            values = [float(r["value"][1]) for r in result]
            if values and pred(values):
                return values
            if time.monotonic() > deadline:
                self.fail("%s never satisfied the check: %s" % (expr, result))
            time.sleep(0.5)

    def test_scrapes_generated_tokens(self):
        run_requests()
        self.query_until('up{job="subspace"}', lambda v: v == [1.0])
        values = self.query_until("subspace_generation_tokens_total", lambda v: v[0] >= 24)
        self.assertGreaterEqual(values[0], 24)  # 3 requests x 8 tokens
        self.query_until("subspace_time_to_first_token_seconds_count", lambda v: v[0] >= 3)
        groups = self.api("/api/v1/rules")["groups"]
        rules = [r for g in groups for r in g["rules"]]
        self.assertTrue(rules)
        for r in rules:
            self.assertNotEqual(r.get("health"), "err", r)


class GrafanaMetricsTest(unittest.TestCase):
    def test_dashboard_and_alerts_use_exported_metrics(self):
        run_requests(1)  # histograms and labelled counters get their series
        exported = exported_series(SERVER.metrics_text())
        self.assertIn("subspace_generation_tokens_total", exported)
        with open(os.path.join(DEPLOY, "grafana", "subspace.json")) as f:
            dash = json.load(f)
        exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
        exprs += [v["query"]["query"] for v in dash["templating"]["list"]
                  if isinstance(v.get("query"), dict)]
        with open(os.path.join(DEPLOY, "prometheus", "alerts.yml")) as f:
            exprs.append(f.read())
        used = set().union(*(query_names(e) for e in exprs))
        self.assertGreater(len(used), 15)
        for name in sorted(used):
            with self.subTest(metric=name):
                self.assertIn(name, exported)


if __name__ == "__main__":
    unittest.main()
