# Subspace server image: build the server and the client on a builder image, run them on a slim
# one with only the binaries, the shared libraries they load and the default model.
#
# CPU image (the default; Debian 12, what CI builds and runs: scripts/docker_test.sh):
#   docker build -t subspace:cpu .
#   docker run -p 50051:50051 -p 8080:8080 -p 9090:9090 subspace:cpu
#   docker run subspace:cpu --kv-cache=full --drain-seconds=20        # extra server flags
#
# CUDA image: the same file on NVIDIA's images (only where they can be pulled):
#   docker build -t subspace:cuda \
#     --build-arg BUILD_BASE=nvidia/cuda:13.0.0-devel-ubuntu24.04 \
#     --build-arg RUN_BASE=nvidia/cuda:13.0.0-runtime-ubuntu24.04 \
#     --build-arg SUBSPACE_CUDA=ON [--build-arg CUDA_ARCHS="90"] .
#   docker run --gpus all subspace:cuda --device=cuda
#
# Where no registry can be reached, scripts/docker_test.sh makes a Debian 12 base image with
# debootstrap + docker import and passes it as BUILD_BASE and RUN_BASE.
ARG BUILD_BASE=debian:12
ARG RUN_BASE=debian:12-slim

FROM ${BUILD_BASE} AS build
ENV DEBIAN_FRONTEND=noninteractive
WORKDIR /src
# The build packages only (scripts/setup.sh build): every name exists in Debian 12 and Ubuntu
# 24.04 (universe, which NVIDIA's images enable).
COPY scripts/setup.sh scripts/setup.sh
RUN scripts/setup.sh build && rm -rf /var/lib/apt/lists/*
COPY . .
ARG SUBSPACE_CUDA=OFF
# sm_80 (A100) and sm_90 (H100/H200) when SUBSPACE_CUDA=ON.
ARG CUDA_ARCHS="80;90"
RUN cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DSUBSPACE_BUILD_TESTS=OFF \
      -DSUBSPACE_CUDA="${SUBSPACE_CUDA}" -DSUBSPACE_CUDA_EMULATOR=OFF \
      -DSUBSPACE_CUDA_ARCHITECTURES="${CUDA_ARCHS}" >/dev/null \
 && targets="subspace-server subspace" \
 && if [ "${SUBSPACE_CUDA}" = "ON" ]; then targets="$targets subspace_cuda"; fi \
 && cmake --build build -j "$(nproc)" --target $targets
# Collect the binaries (and the CUDA plugin, libsubspace_cuda.so, which --device cuda|auto opens
# from beside the server) and the shared libraries they load, transitively as ldd resolves them,
# except glibc (the runtime image has the same one) and the NVIDIA driver libraries (the
# container toolkit mounts them). Copying by soname keeps the image right whatever sonames the
# distribution ships.
RUN mkdir -p /out/lib /out/bin \
 && cp build/bin/subspace-server build/bin/subspace /out/bin/ \
 && if [ -f build/bin/libsubspace_cuda.so ]; then cp build/bin/libsubspace_cuda.so /out/bin/; fi \
 && ldd /out/bin/* \
    | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u \
    | grep -Ev '/(ld-linux[^/]*|libc|libm|libdl|libpthread|librt|libresolv|libcuda|libnvidia[^/]*)\.so' \
    | xargs -r -I{} cp -L {} /out/lib/ \
 && ls /out/lib

FROM ${RUN_BASE}
# Imported bases (debootstrap + docker import) carry no PATH of their own.
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
LABEL org.opencontainers.image.title="subspace-server" \
      org.opencontainers.image.description="gRPC LLM inference with a transform-coded KV cache"
COPY --from=build /out/lib/ /opt/subspace/lib/
COPY --from=build /out/bin/ /usr/local/bin/
# Both embedded models; the long-context one (the default) with its transform codec, which the
# server's --kv-cache auto serves from beside the GGUF, and its basis (--kv-cache compressed).
COPY models/subspace-tiny.gguf models/subspace-long.gguf models/subspace-long.codec \
     models/subspace-long.bases /opt/subspace/models/
# A system user by hand: minimal bases (debootstrap's minbase) have no useradd.
RUN echo /opt/subspace/lib > /etc/ld.so.conf.d/subspace.conf && ldconfig \
 && echo 'subspace:x:10001:10001:subspace:/opt/subspace:/usr/sbin/nologin' >> /etc/passwd \
 && echo 'subspace:x:10001:' >> /etc/group \
 && ! ldd /usr/local/bin/* | grep -v 'libcuda\.' | grep 'not found'
USER 10001:10001
WORKDIR /opt/subspace
EXPOSE 50051 8080 9090
# Health over gRPC (grpc.health.v1): NOT_SERVING until the model is loaded and while draining.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
  CMD ["subspace", "health", "--server=127.0.0.1:50051", "--timeout-seconds=3"]
# SIGTERM (docker stop's default) drains: give it more than --drain-seconds,
# e.g. `docker stop -t 40`.
STOPSIGNAL SIGTERM
ENTRYPOINT ["subspace-server", "--host=0.0.0.0", "--port=50051", "--http-port=8080", \
            "--metrics-port=9090"]
CMD ["--model=/opt/subspace/models/subspace-long.gguf"]
