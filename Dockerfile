# Subspace server image: build on the CUDA 13.0 devel image, run on the matching runtime image
# with only the binaries, the shared libraries they load and the default model.
#
#   docker build -t subspace:dev .
#   docker run --gpus all -p 50051:50051 -p 9090:9090 subspace:dev
#   docker run --gpus all subspace:dev --kv-cache=full --drain-seconds=20   # extra flags
#
# Build deps come from scripts/setup.sh, the same script the README's quick start uses; every
# package it names exists under the same name in Ubuntu 24.04 (universe, which these images
# enable). It also installs the test and training tools (python3-torch, prometheus), which
# only cost builder-stage time: nothing of them reaches the runtime image.
ARG CUDA_VERSION=13.0.0
ARG UBUNTU=ubuntu24.04

FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS build
ENV DEBIAN_FRONTEND=noninteractive
WORKDIR /src
COPY scripts/setup.sh scripts/setup.sh
RUN scripts/setup.sh && rm -rf /var/lib/apt/lists/*
COPY . .
# sm_80 (A100) and sm_90 (H100/H200) by default; override with
#   --build-arg CUDA_ARCHS="90"
ARG CUDA_ARCHS="80;90"
RUN scripts/build.sh -DSUBSPACE_CUDA=ON -DSUBSPACE_BUILD_TESTS=OFF \
      -DSUBSPACE_CUDA_ARCHITECTURES="${CUDA_ARCHS}"
# Collect the shared libraries the two binaries and the CUDA plugin (libsubspace_cuda.so, opened
# by --device cuda|auto from beside the server) load (transitively, as ldd resolves them),
# except glibc, which the runtime image has in the same version, and the NVIDIA driver
# libraries, which the container toolkit mounts from the host. Copying by soname from the
# builder instead of naming runtime packages keeps the image right whatever sonames Ubuntu
# ships (libgrpc++1.51t64, libprotobuf32t64, ... change with every release).
RUN mkdir -p /out/lib /out/bin \
 && cp build/bin/subspace-server build/bin/subspace build/bin/libsubspace_cuda.so /out/bin/ \
 && ldd /out/bin/subspace-server /out/bin/subspace /out/bin/libsubspace_cuda.so \
    | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u \
    | grep -Ev '/(ld-linux[^/]*|libc|libm|libdl|libpthread|librt|libresolv|libcuda|libnvidia[^/]*)\.so' \
    | xargs -r -I{} cp -L {} /out/lib/ \
 && ls /out/lib

FROM nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU}
LABEL org.opencontainers.image.title="subspace-server" \
      org.opencontainers.image.description="gRPC LLM inference with a low-rank compressed KV cache"
COPY --from=build /out/lib/ /opt/subspace/lib/
COPY --from=build /out/bin/ /usr/local/bin/
COPY models/subspace-tiny.gguf /opt/subspace/models/subspace-tiny.gguf
RUN echo /opt/subspace/lib > /etc/ld.so.conf.d/subspace.conf && ldconfig \
 && useradd --system --uid 10001 --home-dir /opt/subspace --shell /usr/sbin/nologin subspace \
 && ! ldd /usr/local/bin/subspace-server /usr/local/bin/subspace /usr/local/bin/libsubspace_cuda.so \
      | grep -v 'libcuda\.' | grep 'not found'
USER 10001:10001
WORKDIR /opt/subspace
EXPOSE 50051 9090
# Health over gRPC (grpc.health.v1): NOT_SERVING until the model is loaded and while draining.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
  CMD ["subspace", "health", "--server=127.0.0.1:50051", "--timeout-seconds=3"]
# SIGTERM (docker stop's default) drains: give it more than --drain-seconds,
# e.g. `docker stop -t 40`.
STOPSIGNAL SIGTERM
ENTRYPOINT ["subspace-server", "--host=0.0.0.0", "--port=50051", "--metrics-port=9090"]
CMD ["--model=/opt/subspace/models/subspace-tiny.gguf"]
