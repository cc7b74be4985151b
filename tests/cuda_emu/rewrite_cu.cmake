# cmake -DIN=kernels/x.cu -DOUT=build/.../x.cc -P rewrite_cu.cmake
# Turns a .cu file into C++ the host compiler builds against tests/cuda_emu/cuda_emu.h:
#   kernel<<<grid, block, smem, stream>>>(args)  ->  Launcher(grid, block, smem, stream).Run(kernel, args)
#   extern __shared__ __align__(16) T name[];     ->  T* const name = DynamicShared<T>();
# The kernel expression is a name with at most one template argument list, as ours are written;
# anything else is left as is and fails to compile, loudly.
file(READ "${IN}" src)
string(REGEX REPLACE
  "([A-Za-z_][A-Za-z0-9_:]*(<[^<>;]*>)?)<<<([^;]*)>>>\\("
  "::subspace::emu::Launcher(\\3).Run(\\1, " src "${src}")
string(REGEX REPLACE
  "extern __shared__ (__align__\\([0-9]+\\) )?([A-Za-z0-9_:]+) ([A-Za-z0-9_]+)\\[\\];"
  "\\2* const \\3 = ::subspace::emu::DynamicShared<\\2>();" src "${src}")
if(src MATCHES "<<<|extern __shared__")
  message(FATAL_ERROR "${IN}: a launch or extern __shared__ array rewrite_cu.cmake cannot rewrite")
endif()
file(WRITE "${OUT}.tmp" "// Generated from ${IN} by tests/cuda_emu/rewrite_cu.cmake; do not edit.\n#line 1 \"${IN}\"\n${src}")
file(COPY_FILE "${OUT}.tmp" "${OUT}" ONLY_IF_DIFFERENT)
file(REMOVE "${OUT}.tmp")
