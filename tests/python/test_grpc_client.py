#!/usr/bin/env python3
"""Integration test of the gRPC service from outside: starts a real subspace-server on port 0,
talks to it with Python gRPC (Generate, GenerateStream, sessions, health) and with the
`subspace` command-line client, then stops it with SIGTERM and expects exit code 0.

    test_grpc_client.py [--server-bin PATH] [--client-bin PATH] [--model GGUF] [unittest args]

The same settings come from $SUBSPACE_SERVER_BIN, $SUBSPACE_CLIENT_BIN, $SUBSPACE_TEST_MODEL.
Defaults: build/bin/subspace-server, build/bin/subspace, build/test_data/gqa_f32.gguf (written
by tests/reference/make_reference.py) or models/subspace-tiny.gguf. When the model sits beside
a make_reference.py manifest, greedy generation is checked token for token against it.
Needs python3-grpcio and python3-protobuf, plus protoc with grpc_python_plugin (Debian
protobuf-compiler, protobuf-compiler-grpc) or a grpc_tools new enough for proto3 `optional`.
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

try:
    import grpc
except ImportError:  # a Python without gRPC first on PATH (pyenv): use Debian's python3-grpcio
    if os.path.realpath(sys.executable) != os.path.realpath("/usr/bin/python3") and \
            os.path.exists("/usr/bin/python3"):
        os.execv("/usr/bin/python3", ["/usr/bin/python3"] + sys.argv)
    raise

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
START_TIMEOUT_S = 120  # model loading on a busy CI machine
RPC_TIMEOUT_S = 60

ARGS = None  # parsed command line, set in main()
pb = pbg = health_pb = health_pbg = None  # generated modules, set by generate_stubs()


def generate_stubs(out_dir):
    """Compiles proto/subspace.proto and proto/health.proto (the standard grpc.health.v1, as
    Debian's python3-grpcio comes without grpcio-health-checking) to Python modules in out_dir
    and imports them."""
    global pb, pbg, health_pb, health_pbg
    include = os.path.join(ROOT, "proto")
    protoc, plugin = shutil.which("protoc"), shutil.which("grpc_python_plugin")
    for name in ("subspace.proto", "health.proto"):
        if protoc and plugin:
            cmd = [protoc, "--plugin=protoc-gen-grpc_python=" + plugin]
        else:  # grpc_tools bundles its own protoc; Debian's (1.14) predates proto3 `optional`
            cmd = [sys.executable, "-m", "grpc_tools.protoc"]
        cmd += ["-I" + include, "--python_out=" + out_dir, "--grpc_python_out=" + out_dir,
                os.path.join(include, name)]
        subprocess.run(cmd, check=True)
    sys.path.insert(0, out_dir)
    import subspace_pb2 as pb  # noqa: E402
    import subspace_pb2_grpc as pbg  # noqa: E402
    import health_pb2 as health_pb  # noqa: E402
    import health_pb2_grpc as health_pbg  # noqa: E402


def reference_greedy(model_path):
    """(prompt, generated) from the make_reference.py manifest beside the model, or None."""
    manifest = os.path.join(os.path.dirname(model_path), "manifest.txt")
    if not os.path.exists(manifest):
        return None
    with open(manifest) as f:
        lines = f.readlines()
    for line in lines:
        fields = line.split()
        if not fields or fields[0] != "greedy":
            continue
        kv = dict(f.split("=", 1) for f in fields[1:])
        if kv.get("gguf") == os.path.basename(model_path):
            ids = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
            return ids(kv["prompt"]), ids(kv["generated"])
    return None


class ServerProcess:
    """subspace-server on port 0; its output is collected by a thread (so the pipe never
    fills) and scanned for the bound port."""

    # server/main.cc: "subspace-server listening on port N, metrics port M"
    PORT_RE = re.compile(r"listening on port (\d+)")

    def __init__(self, server_bin, model):
        self.lines = []
        self.port = None
        self._port_found = threading.Event()
        self.proc = subprocess.Popen(
            [server_bin, "--model", model, "--port", "0", "--metrics-port", "0", "--http-port", "-1",
             "--host", "127.0.0.1"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if self.port is None:
                m = self.PORT_RE.search(line)
                if m:
                    self.port = int(m.group(1))
                    self._port_found.set()
        self._port_found.set()  # exited: stop waiting

    def wait_for_port(self, timeout):
        self._port_found.wait(timeout)
        if self.port is None:
            raise RuntimeError("subspace-server printed no port (exit code %s); output:\n%s" %
                               (self.proc.poll(), self.output()))
        return self.port

    def output(self):
        return "\n".join(self.lines[-60:])

    def stop(self, timeout=60):
        """SIGTERM, then the exit code (killing it after `timeout` seconds)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            code = "timeout"
        self._reader.join(5)
        self.proc.stdout.close()
        return code


class GrpcClientTest(unittest.TestCase):
    server = None
    channel = None
    stub = None
    target = None

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="subspace_grpc_test_")
        generate_stubs(cls.tmp)
        cls.server = ServerProcess(ARGS.server_bin, ARGS.model)
        try:
            port = cls.server.wait_for_port(START_TIMEOUT_S)
            cls.target = "127.0.0.1:%d" % port
            cls.channel = grpc.insecure_channel(cls.target)
            cls.stub = pbg.SubspaceStub(cls.channel)
            cls.health = health_pbg.HealthStub(cls.channel)
            cls.wait_until_serving()
            cls.info = cls.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=RPC_TIMEOUT_S)
        except BaseException:
            cls.server.stop(10)
            sys.stderr.write("server output:\n%s\n" % cls.server.output())
            raise

    @classmethod
    def wait_until_serving(cls):
        deadline = time.monotonic() + START_TIMEOUT_S
        last = None
        while time.monotonic() < deadline:
            if cls.server.proc.poll() is not None:
                raise RuntimeError("subspace-server exited with %s" % cls.server.proc.poll())
            try:
                reply = cls.health.Check(health_pb.HealthCheckRequest(service=""), timeout=5,
                                         wait_for_ready=True)
                last = reply.status
                if reply.status == health_pb.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError as e:
                last = e.code()
            time.sleep(0.1)
        raise RuntimeError("health never became SERVING (last: %s)" % last)

    @classmethod
    def tearDownClass(cls):
        if cls.channel is not None:
            cls.channel.close()
        code = cls.server.stop() if cls.server else 0
        shutil.rmtree(cls.tmp, ignore_errors=True)
        if code != 0:  # an error here fails the run like a failed test
            raise AssertionError("subspace-server exited with %s after SIGTERM; output:\n%s" %
                                 (code, cls.server.output()))

    # --- helpers -----------------------------------------------------------------------------

    def prompt_ids(self, n, offset=0):
        """n ordinary token ids (specials 0-2 avoided), deterministic."""
        vocab = self.info.vocab_size
        return [3 + (7 * i + offset) % (vocab - 3) for i in range(n)]

    def greedy_request(self, ids, n, **kw):
        return pb.GenerateRequest(tokens=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
            max_new_tokens=n, temperature=0.0, ignore_eos=True), **kw)

    def cli(self, *args, expect_ok=True):
        if not ARGS.client_bin or not os.path.exists(ARGS.client_bin):
            self.skipTest("no subspace client binary at %s" % ARGS.client_bin)
        cmd = [ARGS.client_bin, "--server", self.target, "--timeout-seconds",
               str(RPC_TIMEOUT_S)] + list(args)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=RPC_TIMEOUT_S * 2)
        if expect_ok:
            self.assertEqual(r.returncode, 0, "%s\nstdout:\n%s\nstderr:\n%s" %
                             (" ".join(cmd), r.stdout, r.stderr))
        return r

    # --- gRPC from Python --------------------------------------------------------------------

    def test_health_serving(self):
        reply = self.health.Check(health_pb.HealthCheckRequest(service=""), timeout=RPC_TIMEOUT_S)
        self.assertEqual(reply.status, health_pb.HealthCheckResponse.SERVING)

    def test_model_info(self):
        self.assertGreater(self.info.vocab_size, 3)
        self.assertGreater(self.info.context_length, 0)
        self.assertGreater(self.info.layers, 0)
        self.assertTrue(self.info.architecture)

    def test_generate_greedy(self):
        ref = reference_greedy(ARGS.model)
        prompt, want = ref if ref else (self.prompt_ids(6), None)
        n = len(want) if want else 8
        request = self.greedy_request(prompt, n, request_id="py-greedy")
        reply = self.stub.Generate(request, timeout=RPC_TIMEOUT_S)
        self.assertEqual(reply.request_id, "py-greedy")
        self.assertEqual(len(reply.token_ids), n)
        self.assertEqual(reply.usage.prompt_tokens, len(prompt))
        self.assertEqual(reply.usage.generated_tokens, n)
        self.assertEqual(reply.finish_reason, pb.FINISH_REASON_LENGTH)
        self.assertGreaterEqual(reply.timings.total_seconds,
                                reply.timings.time_to_first_token_seconds)
        if want:  # the NumPy float64 reference of tests/reference/make_reference.py
            self.assertEqual(list(reply.token_ids), want)
        again = self.stub.Generate(request, timeout=RPC_TIMEOUT_S)
        self.assertEqual(list(again.token_ids), list(reply.token_ids))

    def test_generate_text_prompt_and_logprobs(self):
        request = pb.GenerateRequest(text="hello world", sampling=pb.SamplingParams(
            max_new_tokens=4, ignore_eos=True, logprobs=3))
        reply = self.stub.Generate(request, timeout=RPC_TIMEOUT_S)
        self.assertTrue(reply.request_id)  # generated by the server
        self.assertGreater(reply.usage.prompt_tokens, 0)
        self.assertEqual(len(reply.tokens), 4)
        for token in reply.tokens:
            self.assertLessEqual(token.logprob, 0.0)
            self.assertEqual(len(token.top_logprobs), 3)
            # greedy: the chosen token is the most likely one
            self.assertEqual(token.top_logprobs[0].id, token.id)

    def test_stream_matches_unary(self):
        request = self.greedy_request(self.prompt_ids(5, offset=1), 8)
        unary = self.stub.Generate(request, timeout=RPC_TIMEOUT_S)
        chunks, finals, text, ids = 0, [], "", []
        for message in self.stub.GenerateStream(request, timeout=RPC_TIMEOUT_S):
            self.assertTrue(message.request_id)
            if message.WhichOneof("event") == "chunk":
                self.assertFalse(finals, "chunk after the final message")
                chunks += 1
                text += message.chunk.text
                ids += [t.id for t in message.chunk.tokens]
            else:
                finals.append(message.final)
        self.assertEqual(len(finals), 1)
        self.assertGreaterEqual(chunks, 1)
        self.assertEqual(finals[0].usage.generated_tokens, 8)
        self.assertEqual(finals[0].finish_reason, pb.FINISH_REASON_LENGTH)
        self.assertEqual(text, unary.text)
        self.assertEqual(ids, list(unary.token_ids))

    def test_invalid_argument(self):
        request = pb.GenerateRequest(text="x", sampling=pb.SamplingParams(temperature=-1.0))
        with self.assertRaises(grpc.RpcError) as cm:
            self.stub.Generate(request, timeout=RPC_TIMEOUT_S)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)

    def test_session_reuses_cache(self):
        session = self.stub.CreateSession(pb.CreateSessionRequest(), timeout=RPC_TIMEOUT_S)
        self.assertTrue(session.session_id)
        md = (("x-session-id", session.session_id),)
        first = self.stub.Generate(
            self.greedy_request(self.prompt_ids(6), 4, session_id=session.session_id),
            metadata=md, timeout=RPC_TIMEOUT_S)
        self.assertEqual(first.session_id, session.session_id)
        second = self.stub.Generate(
            self.greedy_request(self.prompt_ids(3, offset=5), 4, session_id=session.session_id),
            metadata=md, timeout=RPC_TIMEOUT_S)
        self.assertEqual(second.usage.prompt_tokens, 3)
        self.assertGreater(second.usage.reused_tokens, 0)
        got = self.stub.GetSession(pb.GetSessionRequest(session_id=session.session_id),
                                   metadata=md, timeout=RPC_TIMEOUT_S)
        self.assertEqual(got.tokens, 6 + 4 + 3 + 4)
        listed = self.stub.ListSessions(pb.ListSessionsRequest(), timeout=RPC_TIMEOUT_S)
        self.assertIn(session.session_id, [s.session_id for s in listed.sessions])
        self.stub.DeleteSession(pb.DeleteSessionRequest(session_id=session.session_id),
                                metadata=md, timeout=RPC_TIMEOUT_S)
        with self.assertRaises(grpc.RpcError) as cm:
            self.stub.GetSession(pb.GetSessionRequest(session_id=session.session_id),
                                 timeout=RPC_TIMEOUT_S)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.NOT_FOUND)

    def test_cache_stats(self):
        stats = self.stub.GetCacheStats(pb.GetCacheStatsRequest(), timeout=RPC_TIMEOUT_S)
        self.assertGreater(stats.blocks_total, 0)
        self.assertLessEqual(stats.blocks_free, stats.blocks_total)

    # --- the subspace command-line client ----------------------------------------------------

    def test_cli_generate_and_stream(self):
        for command in ("generate", "stream"):
            r = self.cli(command, "--prompt", "abc", "--max-new-tokens", "5", "--ignore-eos")
            self.assertTrue(r.stdout.endswith("\n"))
            self.assertRegex(r.stderr, r"generated 5 tokens, finish: length")
        r = self.cli("generate", "--request",
                     json.dumps({"tokens": {"ids": self.prompt_ids(4)},
                                 "sampling": {"max_new_tokens": 3, "ignore_eos": True}}),
                     "--json")
        reply = json.loads(r.stdout)
        self.assertEqual(len(reply["token_ids"]), 3)
        self.assertEqual(reply["finish_reason"], "FINISH_REASON_LENGTH")
        r = self.cli("stream", "--prompt", "abc", "--max-new-tokens", "3", "--ignore-eos",
                     "--json")
        messages = [json.loads(line) for line in r.stdout.splitlines()]
        self.assertIn("final", messages[-1])
        self.assertEqual(messages[-1]["final"]["usage"]["generated_tokens"], 3)

    def test_cli_sessions(self):
        session_id = self.cli("session", "create", "--ttl-seconds", "60").stdout.strip()
        self.assertTrue(session_id)
        self.assertIn(session_id, self.cli("session", "list").stdout)
        self.cli("generate", "--session", session_id, "--prompt", "abc", "--max-new-tokens", "2")
        got = json.loads(self.cli("session", "get", session_id, "--json").stdout)
        self.assertGreater(got["tokens"], 0)
        self.cli("session", "delete", session_id)
        r = self.cli("session", "get", session_id, expect_ok=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("NOT_FOUND", r.stderr)

    def test_cli_info_stats_and_errors(self):
        info = json.loads(self.cli("info", "--json").stdout)
        self.assertEqual(info["vocab_size"], self.info.vocab_size)
        self.assertIn("blocks_total", json.loads(self.cli("stats", "--json").stdout))
        r = self.cli("generate", "--prompt", "x", "--temperature", "-1", expect_ok=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("INVALID_ARGUMENT", r.stderr)

    def test_cli_health(self):
        self.assertEqual(self.cli("health").stdout, "SERVING\n")
        r = self.cli("health", "--service", "subspace.v1.Subspace", "--wait-seconds", "5")
        self.assertEqual(r.stdout, "SERVING\n")
        r = self.cli("health", "--service", "no.such.Service", expect_ok=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertEqual(r.stdout, "SERVICE_UNKNOWN\n")

    def test_cli_bench(self):
        out = os.path.join(self.tmp, "bench.json")
        r = self.cli("bench", "--num-requests", "8", "--concurrency", "4", "--prompt-tokens",
                     "4:12", "--output-tokens", "2:6", "--seed", "7", "--json", out)
        for row in ("Successful requests:", "TTFT", "TPOT", "ITL", "E2E"):
            self.assertIn(row, r.stdout)
        with open(out) as f:
            report = json.load(f)
        self.assertEqual(report["successful"], 8)
        self.assertEqual(report["failed"], 0)
        self.assertEqual(len(report["requests"]), 8)
        for q in report["requests"]:
            self.assertTrue(4 <= q["prompt_tokens"] <= 12, q)
            self.assertTrue(2 <= q["output_tokens"] <= 6, q)  # ignore_eos: exactly as drawn
        self.assertEqual(report["total_output_tokens"],
                         sum(q["output_tokens"] for q in report["requests"]))
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            self.assertLessEqual(report[key]["p50"], report[key]["p99"])


def main():
    global ARGS
    default_model = os.path.join(ROOT, "build", "test_data", "gqa_f32.gguf")
    if not os.path.exists(default_model):
        default_model = os.path.join(ROOT, "models", "subspace-tiny.gguf")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server-bin", default=os.environ.get(
        "SUBSPACE_SERVER_BIN", os.path.join(ROOT, "build", "bin", "subspace-server")))
    ap.add_argument("--client-bin", default=os.environ.get(
        "SUBSPACE_CLIENT_BIN", os.path.join(ROOT, "build", "bin", "subspace")))
    ap.add_argument("--model", default=os.environ.get("SUBSPACE_TEST_MODEL", default_model))
    ARGS, rest = ap.parse_known_args()
    for what, path in (("server binary", ARGS.server_bin), ("model", ARGS.model)):
        if not os.path.exists(path):
            sys.exit("test_grpc_client.py: no %s at %s" % (what, path))
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)


if __name__ == "__main__":
    main()
