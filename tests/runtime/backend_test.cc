// --device selection: parsing, the CPU backend for either cache kind, and the CUDA choices'
// answers on a machine without a GPU (or a binary without CUDA). The CUDA backend's own
// correctness is tests/cuda/cuda_model_test.cc (gpu label).
#include "runtime/backend.h"

#include <gtest/gtest.h>

#include <utility>

#include "kernels/device_info.h"
#include "tests/core/model/tiny_model_util.h"

namespace subspace::runtime {
namespace {

bool HasCudaDevice() {
#if defined(SUBSPACE_WITH_CUDA)
  return !kernels::ListCudaDevices().empty();
#else
  return false;
#endif
}

KvCacheOptions Full() {
  KvCacheOptions o;
  o.kind = KvCacheKind::kFull;
  return o;
}

TEST(BackendTest, ParsesDevices) {
  EXPECT_EQ(*ParseDevice("cpu"), Device::kCpu);
  EXPECT_EQ(*ParseDevice("cuda"), Device::kCuda);
  EXPECT_EQ(*ParseDevice("auto"), Device::kAuto);
  const absl::StatusOr<Device> bad = ParseDevice("gpu");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("cpu, cuda or auto"), std::string::npos);
}

TEST(BackendTest, CpuServesBothCacheKinds) {
  for (KvCacheKind kind : {KvCacheKind::kFull, KvCacheKind::kCompressed}) {
    absl::StatusOr<testing::TinyModel> tiny = testing::LoadTinyModel();
    ASSERT_TRUE(tiny.ok());
    KvCacheOptions cache;
    cache.kind = kind;
    cache.rank_k = cache.rank_v = 2;
    absl::StatusOr<Backend> b = CreateBackend(
        {.device = Device::kCpu, .kv_cache_bytes = int64_t{4} << 20}, tiny->model, cache, {});
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(b->model->device_name(), "cpu");
    EXPECT_EQ(b->cache->geometry().n_layers, tiny->model->config().n_layers);
  }
}

TEST(BackendTest, GpuMemoryFractionNeedsCuda) {
  absl::StatusOr<testing::TinyModel> tiny = testing::LoadTinyModel();
  ASSERT_TRUE(tiny.ok());
  EXPECT_EQ(
      CreateBackend({.device = Device::kCpu, .kv_cache_bytes = 1 << 20, .gpu_memory_fraction = 0.5},
                    tiny->model, Full(), {})
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateBackend(
                {.device = Device::kAuto, .kv_cache_bytes = 1 << 20, .gpu_memory_fraction = 1.5},
                tiny->model, Full(), {})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// What only the CPU cache does (fp32 blocks or codes) is refused by name on cuda, before any
// device is looked for (so this runs on machines without a GPU too).
TEST(BackendTest, CudaRefusesCompressedFeaturesThatRunOnTheCpuOnly) {
  if (!CudaBackendBuilt()) GTEST_SKIP() << "built without CUDA";
  absl::StatusOr<testing::TinyModel> tiny = testing::LoadTinyModel();
  ASSERT_TRUE(tiny.ok());
  const auto refused = [&](const KvCacheOptions& cache, const char* flag) {
    const absl::Status st =
        CreateBackend({.device = Device::kCuda, .kv_cache_bytes = 1 << 20}, tiny->model, cache, {})
            .status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find(flag), std::string::npos) << st;
  };
  KvCacheOptions cache;
  cache.kind = KvCacheKind::kCompressed;
  // The device cache refreshes with every method and keeps outliers: no refusal (UNAVAILABLE
  // without a GPU).
  KvCacheOptions pca = cache;
  pca.refresh.method = RefreshMethod::kPca;
  KvCacheOptions kqsvd = cache;
  kqsvd.refresh.method = RefreshMethod::kKqsvd;
  KvCacheOptions outliers = cache;
  outliers.outlier_threshold = 0.5f;
  for (const KvCacheOptions& runs : {pca, kqsvd, outliers}) {
    EXPECT_NE(
        CreateBackend({.device = Device::kCuda, .kv_cache_bytes = 1 << 20}, tiny->model, runs, {})
            .status()
            .code(),
        absl::StatusCode::kInvalidArgument);
  }
  KvCacheOptions fp32 = cache;
  fp32.full_dtype = CoeffDtype::kFp32;
  refused(fp32, "--kv-full-dtype");
  KvCacheOptions coeff32 = cache;
  coeff32.coeff_dtype = CoeffDtype::kFp32;
  refused(coeff32, "--kv-coeff-dtype fp32");
  KvCacheOptions coeff4 = cache;
  coeff4.coeff_dtype = CoeffDtype::kInt4;
  refused(coeff4, "--kv-coeff-dtype int4");
}

// The refusal a server asks for before its start-up work: the CPU-only cache kind on --device
// cuda, whatever the build, and nothing for the CPU or auto; the transform-coded cache runs on
// both backends.
TEST(BackendTest, CpuOnlyCachesAreRefusedForCudaBeforeAnyWork) {
  KvCacheOptions quantized;
  quantized.kind = KvCacheKind::kQuantized;
  const absl::Status st = CheckCacheRunsOn(Device::kCuda, quantized);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("--kv-cache quantized"), std::string::npos) << st;
  EXPECT_TRUE(CheckCacheRunsOn(Device::kCpu, quantized).ok());
  EXPECT_TRUE(CheckCacheRunsOn(Device::kAuto, quantized).ok());
  KvCacheOptions transform;
  transform.kind = KvCacheKind::kTransform;
  for (Device d : {Device::kCuda, Device::kCpu, Device::kAuto}) {
    EXPECT_TRUE(CheckCacheRunsOn(d, transform).ok());
  }
  EXPECT_TRUE(CheckCacheRunsOn(Device::kCuda, KvCacheOptions{}).ok());  // compressed
  // Refreshing its codes online is the CPU cache's alone so far.
  transform.refresh.method = RefreshMethod::kPca;
  const absl::Status refresh = CheckCacheRunsOn(Device::kCuda, transform);
  EXPECT_EQ(refresh.code(), absl::StatusCode::kInvalidArgument) << refresh;
  EXPECT_NE(refresh.message().find("--refresh-method pca with --kv-cache transform"),
            std::string::npos)
      << refresh;
  EXPECT_TRUE(CheckCacheRunsOn(Device::kCpu, transform).ok());
}

TEST(BackendTest, WithoutAGpuCudaIsUnavailableAndAutoFallsBackToCpu) {
  if (HasCudaDevice()) GTEST_SKIP() << "a CUDA device is present";
  absl::StatusOr<testing::TinyModel> tiny = testing::LoadTinyModel();
  ASSERT_TRUE(tiny.ok());
  const absl::Status st =
      CreateBackend({.device = Device::kCuda, .kv_cache_bytes = 1 << 20}, tiny->model, Full(), {})
          .status();
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  absl::StatusOr<Backend> b =
      CreateBackend({.device = Device::kAuto, .kv_cache_bytes = 1 << 20}, tiny->model, Full(), {});
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->model->device_name(), "cpu");
}

}  // namespace
}  // namespace subspace::runtime
