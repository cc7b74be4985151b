#!/usr/bin/env python3
"""Session affinity through a real nginx: two subspace-server replicas on 127.0.0.1, nginx
running deploy/nginx/subspace.conf (its replica list and listen port replaced) in the
foreground from a temporary prefix, and calls through it:

- the `subspace` CLI (health, generate) works through the proxy;
- a session created with routing key K in `x-session-id`, then continued with the same key,
  finds its session on every call (no NOT_FOUND) and reuses its cached tokens;
- the sessions of many keys land on both replicas, each session on exactly one.

Routing key vs. session id: CreateSession cannot take a client-chosen id, so a session's
server-made id is not known when the create call is routed. The client therefore picks a
routing key first and sends it as x-session-id on the create call and on every later call of
that session (docs/operations.md, "Scaling out"). The C++ client library sends the session id
itself as x-session-id, which routes the later calls right only when the create call happened
to land on the replica that id hashes to; this test does not rely on that.
"""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
import uuid

if not os.environ.get("SUBSPACE_TEST_REEXEC"):
    try:
        import grpc  # noqa: F401
    except ImportError:  # pyenv python first on PATH: use Debian's python3-grpcio
        if os.path.exists("/usr/bin/python3"):
            os.environ["SUBSPACE_TEST_REEXEC"] = "1"
            os.execv("/usr/bin/python3", ["/usr/bin/python3"] + sys.argv)
        raise
import grpc  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from deploy_util import (DEPLOY, ROOT, Server, free_port, run_client,  # noqa: E402
                         stop_process)

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
SESSION_KEYS = 20
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

    def test_same_key_same_replica(self):
        proxy = self.stub(self.proxy)
        placed = {}  # session id -> routing key
        for i in range(SESSION_KEYS):
            key = [("x-session-id", "key-%s" % uuid.uuid4().hex)]
            session = proxy.CreateSession(pb.CreateSessionRequest(), metadata=key, timeout=30)
            placed[session.session_id] = key
            for turn in range(3):
                req = pb.GenerateRequest(text=" And God said %d" % turn,
                                         session_id=session.session_id,
                                         sampling=pb.SamplingParams(max_new_tokens=2))
                resp = proxy.Generate(req, metadata=key, timeout=30)  # NOT_FOUND if misrouted
                self.assertEqual(resp.usage.generated_tokens, 2)
                if turn > 0:
                    self.assertGreater(resp.usage.reused_tokens, 0, "session cache not reused")

        per_replica = []
        for r in self.replicas:
            listed = self.stub(r.address).ListSessions(pb.ListSessionsRequest(), timeout=30)
            per_replica.append({s.session_id for s in listed.sessions} & set(placed))
        self.assertEqual(per_replica[0] | per_replica[1], set(placed))
        self.assertFalse(per_replica[0] & per_replica[1])
        # 20 random keys on a two-server ring: all on one replica has odds below 1e-4.
        self.assertTrue(per_replica[0] and per_replica[1],
                        "every session on one replica: %s" % [len(s) for s in per_replica])

        # A key keeps its replica: a second session with an old key joins the first.
        sid, key = next(iter(placed.items()))
        again = proxy.CreateSession(pb.CreateSessionRequest(), metadata=key, timeout=30)
        home = 0 if sid in per_replica[0] else 1
        listed = self.stub(self.replicas[home].address).ListSessions(
            pb.ListSessionsRequest(), timeout=30)
        self.assertIn(again.session_id, {s.session_id for s in listed.sessions})


if __name__ == "__main__":
    unittest.main()
