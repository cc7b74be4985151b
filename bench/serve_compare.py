#!/usr/bin/env python3
"""One load generator for two servers: Subspace (gRPC Generate) and llama.cpp's llama-server
(HTTP /completion), so both see the same requests the same way.

    serve_compare.py --subspace HOST:PORT --llama http://HOST:PORT [--requests 16]
        [--concurrency 8] [--prompt-tokens 64] [--output-tokens 32] [--vocab 32000] [--seed 1]

Every request is a prompt of random token ids (the same list for both servers, BOS first),
greedy, exactly --output-tokens new tokens (EOS ignored, no prompt cache reuse), non-streaming.
`concurrency` client threads keep that many requests in flight. Prints one markdown row per
server: wall time, output tokens/s, mean and p90 request latency. bench/serve_side_by_side.sh
starts both servers on one model and runs this.
"""
import argparse
import concurrent.futures
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

try:
    import grpc
except ImportError:  # a Python without gRPC first on PATH (pyenv): use Debian's python3-grpcio
    if os.path.realpath(sys.executable) != "/usr/bin/python3" and os.path.exists("/usr/bin/python3"):
        os.execv("/usr/bin/python3", ["/usr/bin/python3"] + sys.argv)
    raise

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def load_stubs(out_dir):
    include = os.path.join(ROOT, "proto")
    subprocess.run(["protoc", "--plugin=protoc-gen-grpc_python=" + shutil.which("grpc_python_plugin"),
                    "-I" + include, "--python_out=" + out_dir, "--grpc_python_out=" + out_dir,
                    os.path.join(include, "subspace.proto")], check=True)
    sys.path.insert(0, out_dir)
    import subspace_pb2  # noqa: E402
    import subspace_pb2_grpc  # noqa: E402
    return subspace_pb2, subspace_pb2_grpc


def subspace_caller(address, output_tokens):
    tmp = tempfile.mkdtemp()
    pb, pbg = load_stubs(tmp)
    channel = grpc.insecure_channel(address)
    client = pbg.SubspaceStub(channel)

    def call(prompt):
        request = pb.GenerateRequest(
            tokens=pb.TokenIds(ids=prompt),
            sampling=pb.SamplingParams(max_new_tokens=output_tokens, temperature=0.0,
                                       ignore_eos=True))
        response = client.Generate(request, timeout=600)
        return len(response.token_ids)
    return call


def llama_caller(url, output_tokens):
    def call(prompt):
        body = json.dumps({"prompt": prompt, "n_predict": output_tokens, "temperature": 0.0,
                           "ignore_eos": True, "cache_prompt": False}).encode()
        request = urllib.request.Request(url.rstrip("/") + "/completion", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as reply:
            return int(json.loads(reply.read())["tokens_predicted"])
    return call


def run(name, call, prompts, concurrency):
    call(prompts[0])  # warm-up, not timed
    latencies, produced = [], 0
    start = time.monotonic()

    def one(prompt):
        t0 = time.monotonic()
        n = call(prompt)
        return n, time.monotonic() - t0

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for n, latency in pool.map(one, prompts):
            produced += n
            latencies.append(latency)
    wall = time.monotonic() - start
    latencies.sort()
    p90 = latencies[min(len(latencies) - 1, int(0.9 * len(latencies)))]
    print("| %s | %d | %d | %.1f | %.1f | %.2f | %.2f |" % (
        name, len(prompts), concurrency, wall, produced / wall,
        sum(latencies) / len(latencies), p90), flush=True)
    return produced / wall


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--subspace", help="host:port of subspace-server")
    ap.add_argument("--llama", help="base URL of llama-server")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    prompts = [[1] + [rng.randrange(3, args.vocab) for _ in range(args.prompt_tokens - 1)]
               for _ in range(args.requests)]
    print("| server | requests | concurrency | wall s | output tok/s | mean latency s |"
          " p90 latency s |")
    print("|---|--:|--:|--:|--:|--:|--:|")
    rates = {}
    if args.subspace:
        rates["subspace"] = run("Subspace", subspace_caller(args.subspace, args.output_tokens),
                                prompts, args.concurrency)
    if args.llama:
        rates["llama"] = run("llama-server", llama_caller(args.llama, args.output_tokens),
                             prompts, args.concurrency)
    if len(rates) == 2:
        print("\nSubspace / llama-server output tok/s: %.2fx" % (rates["subspace"] / rates["llama"]))


if __name__ == "__main__":
    main()
