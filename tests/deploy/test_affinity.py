#!/usr/bin/env python3
"""Session affinity through a real nginx: two subspace-server replicas on 127.0.0.1, nginx
running deploy/nginx/subspace.conf (its replica list and listen port replaced) in the
foreground from a temporary prefix, and calls through it:

- the `subspace` CLI (health, generate) works through the proxy;
- sessions made the plain way -- `subspace session create`, then `subspace generate --session
  ID` -- find their session on every call (no NOT_FOUND) and reuse its cached tokens: the client
  library makes the session id before the create call and sends it as x-session-id on that call
  and every later one, so all of them hash to the replica holding the session
  (docs/operations.md, "Scaling out");
- those sessions land on both replicas, each on exactly one, and proposing a taken id through
  the proxy reaches the replica that has it (ALREADY_EXISTS).
"""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

if not os.environ.get("SUBSPACE_TEST_REEXEC") and importlib.util.find_spec("grpc") is None:
    # pyenv python first on PATH: use Debian's python3-grpcio
    if os.path.exists("/usr/bin/python3"):
        os.environ["SUBSPACE_TEST_REEXEC"] = "1"
        os.execv("/usr/bin/python3", ["/usr/bin/python3"] + sys.argv)
import grpc  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from deploy_util import (DEPLOY, ROOT, Server, free_port, run_client,  # noqa: E402
                         stop_process)

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
SESSIONS = 20
pb = pbg = None


def nginx_config(prefix, port, upstreams):
    """Writes PREFIX/nginx.conf around deploy/nginx/subspace.conf, with the given replicas
    and listen port; everything nginx writes stays under PREFIX. Returns its path."""
    with open(os.path.join(DEPLOY, "nginx", "subspace.conf")) as f:
        site = f.read()
    lines, replaced = [], False
    for line in site.splitlines():
        stripped = line.strip()
        if stripped.startswith("server ") and stripped.endswith(":50051;"):
            if not replaced:  # the example replicas become ours
                lines += ["    server %s;" % u for u in upstreams]
                replaced = True
            continue
        if stripped.startswith("listen "):
            line = "    listen 127.0.0.1:%d http2;" % port
        lines.append(line)
    assert replaced, "no `server ...:50051;` lines in deploy/nginx/subspace.conf"
    with open(os.path.join(prefix, "subspace.conf"), "w") as f:
        f.write("\n".join(lines) + "\n")
    tmp = lambda name: os.path.join(prefix, name)  # noqa: E731
    conf = tmp("nginx.conf")
    user = "user root;\n" if os.geteuid() == 0 else ""
    with open(conf, "w") as f:
        f.write(f"""{user}worker_processes 1;
pid {tmp('nginx.pid')};
error_log {tmp('error.log')} warn;
events {{ worker_connections 256; }}
http {{
    access_log {tmp('access.log')};
    client_body_temp_path {tmp('client_body')};
    proxy_temp_path {tmp('proxy')};
    fastcgi_temp_path {tmp('fastcgi')};
    uwsgi_temp_path {tmp('uwsgi')};
    scgi_temp_path {tmp('scgi')};
    include {tmp('subspace.conf')};
}}
""")
    return conf


def generate_stubs(out_dir):
    global pb, pbg
    include = os.path.join(ROOT, "proto")
    subprocess.run(["protoc", "--plugin=protoc-gen-grpc_python=" +
                    shutil.which("grpc_python_plugin"), "-I" + include,
                    "--python_out=" + out_dir, "--grpc_python_out=" + out_dir,
                    os.path.join(include, "subspace.proto")], check=True)
    sys.path.insert(0, out_dir)
    import subspace_pb2 as pb  # noqa: E402
    import subspace_pb2_grpc as pbg  # noqa: E402


@unittest.skipUnless(os.path.exists(NGINX), "nginx not installed (Debian nginx-light)")
@unittest.skipUnless(shutil.which("grpc_python_plugin"), "no protobuf-compiler-grpc")
class AffinityTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="subspace-affinity-")
        cls.replicas, cls.nginx, cls.channels = [], None, []
        try:
            generate_stubs(cls.tmp)
            cls.replicas = [Server(metrics=False) for _ in range(2)]
            cls.port = free_port()
            conf = nginx_config(cls.tmp, cls.port, [r.address for r in cls.replicas])
            cls.nginx = subprocess.Popen(
                [NGINX, "-p", cls.tmp, "-c", conf, "-e", os.path.join(cls.tmp, "error.log"),
                 "-g", "daemon off;"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                text=True, start_new_session=True)
            cls.proxy = "127.0.0.1:%d" % cls.port
            r = run_client("--server", cls.proxy, "health", "--wait-seconds", "15")
            if r.returncode != 0:
                raise RuntimeError("no health through nginx: %s %s" % (r.stdout, r.stderr))
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        for ch in cls.channels:
            ch.close()
        if cls.nginx is not None:
            stop_process(cls.nginx)
        for r in cls.replicas:
            r.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def stub(self, address):
        ch = grpc.insecure_channel(address)
        self.channels.append(ch)
        return pbg.SubspaceStub(ch)

    def test_cli_through_proxy(self):
        r = run_client("--server", self.proxy, "generate", "--prompt", "In the beginning",
                       "--max-new-tokens", "4")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("generated 4 tokens", r.stderr)

    def test_sessions_stay_on_their_replica(self):
        sessions = []
        for i in range(SESSIONS):
            r = run_client("--server", self.proxy, "session", "create")
            self.assertEqual(r.returncode, 0, r.stderr)
            sid = r.stdout.strip()
            self.assertRegex(sid, r"^[0-9a-f]{32}$")
            sessions.append(sid)
            for turn in range(2):
                r = run_client("--server", self.proxy, "--json", "generate", "--session", sid,
                               "--prompt", " And God said %d" % turn, "--max-new-tokens", "2")
                self.assertEqual(r.returncode, 0, r.stderr)  # NOT_FOUND if misrouted
                self.assertNotIn("NOT_FOUND", r.stderr)
                usage = json.loads(r.stdout)["usage"]
                self.assertEqual(usage["generated_tokens"], 2)
                if turn > 0:
                    self.assertGreater(usage["reused_tokens"], 0, "session cache not reused")

        per_replica = []
        for rep in self.replicas:
            listed = self.stub(rep.address).ListSessions(pb.ListSessionsRequest(), timeout=30)
            per_replica.append({s.session_id for s in listed.sessions} & set(sessions))
        self.assertEqual(per_replica[0] | per_replica[1], set(sessions))
        self.assertFalse(per_replica[0] & per_replica[1])
        # 20 random ids on a two-server ring: all on one replica has odds below 1e-4.
        self.assertTrue(per_replica[0] and per_replica[1],
                        "every session on one replica: %s" % [len(s) for s in per_replica])

        # The id routes the create itself: proposing a taken one reaches its replica.
        r = run_client("--server", self.proxy, "session", "create", "--id", sessions[0])
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("ALREADY_EXISTS", r.stderr)

if __name__ == "__main__":
    unittest.main()
