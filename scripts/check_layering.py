#!/usr/bin/python3
"""Checks that every #include follows the module layering docs/design.md describes.

Static libraries only fail to link a wrong include when nothing above links the target it
reaches, and the binaries link everything, so the layering is checked here, from the one place
that declares it: core/CMakeLists.txt's `subspace_core_module(NAME DEPS ...)` lines. A core
module may include itself and the modules it depends on, transitively; core/ includes nothing
outside core/ (no gRPC, Prometheus, CUDA, runtime, server, tools); kernels/ includes only kernels/
and core/base; cuda/ includes core/, kernels/ and cuda/; runtime/ (options into backends and
caches) includes core/, cuda/'s plugin ABI and capabilities, and itself, no gRPC, Prometheus, server or tools;
cli/ includes only itself. Prints every violation; exit 1 if any.
  scripts/check_layering.py [repo root]
"""
import os
import re
import sys

root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
cmake = open(os.path.join(root, "core", "CMakeLists.txt")).read()
deps = {}
for m in re.finditer(r"subspace_core_module\((\w+)([^)]*)\)", cmake):
    words = m.group(2).split()
    direct = []
    if "DEPS" in words:
        for w in words[words.index("DEPS") + 1:]:
            if w == "PRIVATE_DEPS":
                break
            if w.startswith("subspace_"):
                direct.append(w[len("subspace_"):])
            # absl, OpenBLAS, ... are not modules
    deps[m.group(1)] = direct
if not deps:
    sys.exit("check_layering: no subspace_core_module() in core/CMakeLists.txt")


def closure(mod, seen=None):
    seen = set() if seen is None else seen
    for d in deps.get(mod, []):
        if d not in seen:
            seen.add(d)
            closure(d, seen)
    return seen


include = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)
bad = []
for top in ("core", "kernels", "cuda", "runtime", "cli"):
    for dirpath, _, files in os.walk(os.path.join(root, top)):
        for f in sorted(files):
            if not f.endswith((".h", ".cc", ".cu", ".cuh")):
                continue
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, root)
            parts = rel.split(os.sep)
            for inc in include.findall(open(path).read()):
                first = inc.split("/")[0]
                if top == "core":
                    mod = parts[1]
                    if first in ("server", "cuda", "kernels", "tools", "runtime", "cli", "proto",
                                 "grpcpp", "grpc", "prometheus", "cublas_v2.h", "cuda_runtime.h"):
                        bad.append(f"{rel}: includes {inc} (core/ knows no gRPC, Prometheus, "
                                   "CUDA, runtime, server or tools)")
                    elif first == "core":
                        target = inc.split("/")[1]
                        if target != mod and target not in closure(mod):
                            bad.append(f"{rel}: includes {inc}, but module {mod} does not "
                                       f"depend on {target} (core/CMakeLists.txt)")
                elif top == "kernels":
                    if first in ("cuda", "server", "tools") or (
                            first == "core" and inc.split("/")[1] != "base"):
                        bad.append(f"{rel}: includes {inc} (kernels/ includes only kernels/ "
                                   "and core/base/)")
                elif top == "runtime":
                    if first in ("server", "tools", "cli", "proto", "grpcpp", "grpc", "prometheus",
                                 "kernels", "cublas_v2.h", "cuda_runtime.h") or (
                            first == "cuda" and
                            inc not in ("cuda/cuda_plugin.h", "cuda/cuda_capabilities.h")):
                        bad.append(f"{rel}: includes {inc} (runtime/ reaches CUDA only through "
                                   "cuda/cuda_plugin.h and cuda/cuda_capabilities.h, and knows "
                                   "no gRPC, Prometheus, server, tools or cli)")
                elif top == "cli":
                    if "/" in inc and first != "cli" and first != "absl":
                        bad.append(f"{rel}: includes {inc} (cli/ is Abseil only)")
                elif first in ("server", "tools", "runtime", "cli"):
                    bad.append(f"{rel}: includes {inc} (cuda/ is below runtime/, server/ and "
                               "tools/)")
for b in bad:
    print(b)
print(f"check_layering: {len(deps)} core modules, {len(bad)} violation(s)")
sys.exit(1 if bad else 0)
