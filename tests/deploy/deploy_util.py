"""Helpers for the deployment tests: run real subspace-server replicas and other daemons on
127.0.0.1 with ports picked at start, wait for them, and stop every process started."""
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
DEPLOY = os.path.join(ROOT, "deploy")
START_TIMEOUT_S = 60

_LISTENING = re.compile(r"subspace-server listening on port (\d+), metrics port (-?\d+)")


def env_or(name, default):
    return os.environ.get(name) or default


def server_bin():
    return env_or("SUBSPACE_SERVER_BIN", os.path.join(ROOT, "build", "bin", "subspace-server"))


def client_bin():
    return env_or("SUBSPACE_CLIENT_BIN", os.path.join(ROOT, "build", "bin", "subspace"))


def model_path():
    return env_or("SUBSPACE_TEST_MODEL", os.path.join(ROOT, "models", "subspace-tiny.gguf"))


def free_port():
    """A port free on 127.0.0.1 now, for daemons that cannot pick their own (a small race)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A subspace-server on 127.0.0.1 with gRPC and metrics ports picked by the server."""

    def __init__(self, *extra_flags, metrics=True):
        cmd = [server_bin(), "--model", model_path(), "--host", "127.0.0.1", "--port", "0",
               "--metrics-port", "0" if metrics else "-1", "--http-port", "-1", "--kv-cache-bytes", str(32 << 20),
               "--drain-seconds", "2", "--log-level", "warn", *extra_flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.stop()
                raise RuntimeError("subspace-server exited before listening: %s" % cmd)
            m = _LISTENING.search(line)
            if m:
                self.port, self.metrics_port = int(m.group(1)), int(m.group(2))
                break
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("subspace-server did not print its ports")
        self.address = "127.0.0.1:%d" % self.port

    def metrics_text(self):
        url = "http://127.0.0.1:%d/metrics" % self.metrics_port
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read().decode()

    def stop(self):
        """SIGTERM (drain), then SIGKILL if it does not exit; returns the exit code."""
        return stop_process(self.proc)


def stop_process(proc, timeout_s=10):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for f in (proc.stdout, proc.stderr):
        if f:
            f.close()
    return proc.returncode


def wait_http(url, timeout_s=START_TIMEOUT_S, proc=None):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.read().decode()
        except OSError:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError("process exited with %s before %s answered" %
                                   (proc.returncode, url))
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def run_client(*args, timeout_s=60):
    """Runs the `subspace` CLI; returns the CompletedProcess (text)."""
    return subprocess.run([client_bin(), *args], capture_output=True, text=True,
                          timeout=timeout_s)
