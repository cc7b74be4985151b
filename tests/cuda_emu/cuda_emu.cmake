# The CUDA code on the CPU (tests/cuda_emu/cuda_emu.h says how and what it cannot show): every
# kernels/*.cu rewritten by rewrite_cu.cmake and built by the host compiler against the emulated
# runtime, and every GPU test built again against it as `<name>_emu` (label emu), on every
# machine with the CUDA headers, nvcc or not.
set(SUBSPACE_EMU_DIR ${CMAKE_CURRENT_SOURCE_DIR}/cuda_emu)
file(GLOB SUBSPACE_KERNEL_CU_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/kernels/*.cu)
set(SUBSPACE_EMU_KERNEL_SOURCES)
foreach(cu ${SUBSPACE_KERNEL_CU_SOURCES})
  get_filename_component(name ${cu} NAME_WE)
  set(out ${CMAKE_CURRENT_BINARY_DIR}/cuda_emu/${name}.cc)
  add_custom_command(OUTPUT ${out}
    COMMAND ${CMAKE_COMMAND} -DIN=${cu} -DOUT=${out} -P ${SUBSPACE_EMU_DIR}/rewrite_cu.cmake
    DEPENDS ${cu} ${SUBSPACE_EMU_DIR}/rewrite_cu.cmake
    COMMENT "Rewriting ${name}.cu for the CUDA emulator" VERBATIM)
  list(APPEND SUBSPACE_EMU_KERNEL_SOURCES ${out})
endforeach()
# The kernels pun types through pointers as device code may (nvcc does not exploit strict
# aliasing there); the host compiler must not either.
set_source_files_properties(${SUBSPACE_EMU_KERNEL_SOURCES} PROPERTIES
  COMPILE_OPTIONS "-include;${SUBSPACE_EMU_DIR}/cuda_emu.h;-Wno-unknown-pragmas;-Wno-attributes;-fno-strict-aliasing")

add_library(subspace_kernels_emu STATIC ${SUBSPACE_EMU_KERNEL_SOURCES}
                                        ${SUBSPACE_EMU_DIR}/cuda_emu_runtime.cc
                                        ${SUBSPACE_EMU_DIR}/cuda_emu_api.cc)
target_include_directories(subspace_kernels_emu PUBLIC ${PROJECT_SOURCE_DIR})
target_include_directories(subspace_kernels_emu SYSTEM PUBLIC ${CUDAToolkit_INCLUDE_DIRS})
target_link_libraries(subspace_kernels_emu PUBLIC subspace_core)
target_compile_definitions(subspace_kernels_emu PUBLIC SUBSPACE_WITH_CUDA=1)

add_executable(cuda_emu_test ${SUBSPACE_EMU_DIR}/cuda_emu_test.cc)
set_source_files_properties(${SUBSPACE_EMU_DIR}/cuda_emu_test.cc PROPERTIES
  COMPILE_OPTIONS "-include;${SUBSPACE_EMU_DIR}/cuda_emu.h")
target_link_libraries(cuda_emu_test PRIVATE subspace_kernels_emu GTest::gtest_main)
set_target_properties(cuda_emu_test PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
gtest_discover_tests(cuda_emu_test DISCOVERY_TIMEOUT 60 PROPERTIES LABELS emu)

# SUBSPACE_EMU_TESTS: the GPU suites built for the emulator, by name (e.g. "layer_ops_test;
# cuda_model_test"); empty, the default, builds them all. scripts/sanitize.sh sets it in the ASan
# build to the suites its kernel slices run, the only emulated tests that build runs.
set(SUBSPACE_EMU_TESTS "" CACHE STRING "GPU test suites built for the emulator (empty: all)")
function(subspace_emu_skip name out)
  set(skip FALSE)
  if(SUBSPACE_EMU_TESTS AND NOT name IN_LIST SUBSPACE_EMU_TESTS)
    set(skip TRUE)
  endif()
  set(${out} ${skip} PARENT_SCOPE)
endfunction()

foreach(src ${SUBSPACE_GPU_TESTS})
  get_filename_component(name ${src} NAME_WE)
  if(name MATCHES "^cuda_model(_cache|_ops)?_test$")
    continue()  # below: they also need the emulated backend and cuBLAS
  endif()
  subspace_emu_skip(${name} skip)
  if(skip)
    continue()
  endif()
  add_executable(${name}_emu ${src})
  target_link_libraries(${name}_emu PRIVATE subspace_kernels_emu subspace_kernel_twins
                                            subspace_test_util GTest::gtest_main)
  target_compile_definitions(${name}_emu PRIVATE SUBSPACE_CUDA_EMULATOR=1)
  set_target_properties(${name}_emu PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
  gtest_discover_tests(${name}_emu DISCOVERY_TIMEOUT 60 TEST_SUFFIX .emu
                       PROPERTIES LABELS emu)
endforeach()

# The CUDA backend end to end (cuda_model_test, cuda_model_cache_test, cuda_model_ops_test) on the
# emulated device:
# its host code as is, the kernels emulated, cuBLAS replaced by tests/cuda_emu/cublas_emu.cc,
# built as libcublas.so.<major> in a directory the test puts first on the loader's path, so
# cuda/gemm.cc loads it as it loads cuBLAS.
add_library(subspace_cuda_backend_emu STATIC ${SUBSPACE_CUDA_BACKEND_SOURCES})
target_link_libraries(subspace_cuda_backend_emu
  PUBLIC subspace_kernels_emu subspace_cuda_host subspace_core ${CMAKE_DL_LIBS})

add_library(cublas_emu SHARED ${SUBSPACE_EMU_DIR}/cublas_emu.cc)
target_include_directories(cublas_emu PRIVATE ${PROJECT_SOURCE_DIR})
target_include_directories(cublas_emu SYSTEM PRIVATE ${CUDAToolkit_INCLUDE_DIRS})
set_target_properties(cublas_emu PROPERTIES
  OUTPUT_NAME cublas
  SUFFIX ".so.${CUDAToolkit_VERSION_MAJOR}"
  LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests/cuda_emu_lib)

foreach(name cuda_model_test cuda_model_cache_test cuda_model_ops_test)
  subspace_emu_skip(${name} skip)
  if(skip)
    continue()
  endif()
  add_executable(${name}_emu ${CMAKE_CURRENT_SOURCE_DIR}/cuda/${name}.cc)
  add_dependencies(${name}_emu cublas_emu)
  target_link_libraries(${name}_emu PRIVATE subspace_cuda_backend_emu subspace_kernel_twins
                                            subspace_test_util GTest::gtest_main)
  target_compile_definitions(${name}_emu PRIVATE SUBSPACE_CUDA_EMULATOR=1)
  # libcublas.so.N resolves subspace::emu::Submit from the executable.
  set_target_properties(${name}_emu PROPERTIES
    RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests ENABLE_EXPORTS ON)
  gtest_discover_tests(${name}_emu DISCOVERY_TIMEOUT 60 TEST_SUFFIX .emu
                       PROPERTIES LABELS emu
                                  ENVIRONMENT LD_LIBRARY_PATH=${CMAKE_BINARY_DIR}/tests/cuda_emu_lib)
endforeach()
