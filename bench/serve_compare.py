#!/usr/bin/env python3
"""One load generator for several endpoints: Subspace over gRPC (Generate / GenerateStream) and
over its OpenAI-compatible HTTP API (/v1/completions), and llama.cpp's llama-server (its
/completion, or with --llama-openai its /v1/completions), so all see the same requests the same
way.

    serve_compare.py [--subspace HOST:PORT] [--subspace-http http://HOST:PORT] [--llama URL]
        [--llama-openai] [--stream] [--rounds 1] [--requests 16] [--concurrency 8]
        [--prompt-tokens 64] [--output-tokens 32] [--vocab 32000] [--seed 1]

Every request is a prompt of random token ids (the same list for every endpoint, BOS first),
greedy, exactly --output-tokens new tokens (EOS ignored, no prompt cache reuse), whole answers
or, with --stream, streamed (time to the first streamed token measured). `concurrency` client
threads keep that many requests in flight. With --rounds R the endpoints take turns R times
(interleaved, so a slow minute of the machine hits all of them) and the summary gives each one's
median with its spread, and the median of the per-round ratios to the first endpoint. Prints
one markdown row per endpoint and round. bench/serve_side_by_side.sh starts the servers on one
model and runs this.
"""
import argparse
import concurrent.futures
import json
import os
import random
import shutil
import statistics
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


# A caller takes a prompt and returns (output tokens, seconds to the first streamed token or
# None when not streaming).

def subspace_caller(address, output_tokens, stream):
    tmp = tempfile.mkdtemp()
    pb, pbg = load_stubs(tmp)
    channel = grpc.insecure_channel(address)
    client = pbg.SubspaceStub(channel)

    def call(prompt):
        request = pb.GenerateRequest(
            tokens=pb.TokenIds(ids=prompt),
            sampling=pb.SamplingParams(max_new_tokens=output_tokens, temperature=0.0,
                                       ignore_eos=True))
        if not stream:
            response = client.Generate(request, timeout=600)
            return len(response.token_ids), None
        t0, ttft, produced = time.monotonic(), None, 0
        for message in client.GenerateStream(request, timeout=600):
            if message.HasField("chunk") and message.chunk.tokens:
                if ttft is None:
                    ttft = time.monotonic() - t0
            elif message.HasField("final"):
                produced = message.final.usage.generated_tokens
        return produced, ttft
    return call


def openai_caller(base_url, output_tokens, stream, extra=None):
    """/v1/completions of an OpenAI-compatible server (ours, or llama-server's)."""
    base = base_url.rstrip("/")
    with urllib.request.urlopen(base + "/v1/models", timeout=60) as reply:
        model = json.loads(reply.read())["data"][0]["id"]

    def call(prompt):
        body = {"model": model, "prompt": prompt, "max_tokens": output_tokens,
                "temperature": 0.0, "ignore_eos": True, **(extra or {})}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        request = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        t0 = time.monotonic()
        with urllib.request.urlopen(request, timeout=600) as reply:
            if not stream:
                return int(json.loads(reply.read())["usage"]["completion_tokens"]), None
            ttft, produced, chunks = None, None, 0
            for line in reply:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    produced = int(event["usage"]["completion_tokens"])
                for choice in event.get("choices", []):
                    if choice.get("text"):
                        chunks += 1
                        if ttft is None:
                            ttft = time.monotonic() - t0
            return (produced if produced is not None else chunks), ttft
    return call


def llama_caller(url, output_tokens, stream):
    if stream:
        raise SystemExit("--stream with llama-server: use --llama-openai")

    def call(prompt):
        body = json.dumps({"prompt": prompt, "n_predict": output_tokens, "temperature": 0.0,
                           "ignore_eos": True, "cache_prompt": False}).encode()
        request = urllib.request.Request(url.rstrip("/") + "/completion", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as reply:
            return int(json.loads(reply.read())["tokens_predicted"]), None
    return call


def run(name, call, prompts, concurrency, round_index):
    call(prompts[0])  # warm-up, not timed
    latencies, ttfts, produced = [], [], 0
    start = time.monotonic()

    def one(prompt):
        t0 = time.monotonic()
        n, ttft = call(prompt)
        return n, time.monotonic() - t0, ttft

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for n, latency, ttft in pool.map(one, prompts):
            produced += n
            latencies.append(latency)
            if ttft is not None:
                ttfts.append(ttft)
    wall = time.monotonic() - start
    latencies.sort()
    p90 = latencies[min(len(latencies) - 1, int(0.9 * len(latencies)))]
    ttft_p50 = statistics.median(ttfts) * 1e3 if ttfts else float("nan")
    print("| %s | %d | %d | %d | %.1f | %.1f | %.2f | %.2f | %.1f |" % (
        name, round_index, len(prompts), concurrency, wall, produced / wall,
        sum(latencies) / len(latencies), p90, ttft_p50), flush=True)
    return produced / wall, ttft_p50


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--subspace", help="host:port of subspace-server (gRPC)")
    ap.add_argument("--subspace-http", help="base URL of subspace-server's HTTP API")
    ap.add_argument("--llama", help="base URL of llama-server")
    ap.add_argument("--llama-openai", action="store_true",
                    help="llama-server through its OpenAI /v1/completions (default /completion)")
    ap.add_argument("--stream", action="store_true", help="streamed requests; TTFT measured")
    ap.add_argument("--rounds", type=int, default=1)
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
    targets = []
    if args.subspace:
        targets.append(("Subspace gRPC", subspace_caller(args.subspace, args.output_tokens,
                                                          args.stream)))
    if args.subspace_http:
        targets.append(("Subspace HTTP", openai_caller(args.subspace_http, args.output_tokens,
                                                        args.stream)))
    if args.llama:
        if args.llama_openai:
            # Its prompt cache off, as for /completion: every request prefills its prompt.
            targets.append(("llama-server /v1", openai_caller(
                args.llama, args.output_tokens, args.stream, {"cache_prompt": False})))
        else:
            targets.append(("llama-server", llama_caller(args.llama, args.output_tokens,
                                                         args.stream)))
    print("| endpoint | round | requests | concurrency | wall s | output tok/s |"
          " mean latency s | p90 latency s | TTFT p50 ms |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    results = {name: [] for name, _ in targets}
    for r in range(args.rounds):
        for name, call in targets:
            results[name].append(run(name, call, prompts, args.concurrency, r + 1))
    if args.rounds > 1 or len(targets) > 1:
        first = targets[0][0]
        print("\n| endpoint | output tok/s, median (min-max) | vs %s, median of rounds |"
              " TTFT p50 ms, median |" % first)
        print("|---|--:|--:|--:|")
        for name, _ in targets:
            rates = [rate for rate, _ in results[name]]
            ratios = [rate / base for (rate, _), (base, _) in zip(results[name], results[first])]
            ttfts = [t for _, t in results[name] if t == t]
            print("| %s | %.1f (%.1f-%.1f) | %.3fx | %s |" % (
                name, statistics.median(rates), min(rates), max(rates),
                statistics.median(ratios),
                "%.1f" % statistics.median(ttfts) if ttfts else "-"), flush=True)


if __name__ == "__main__":
    main()
