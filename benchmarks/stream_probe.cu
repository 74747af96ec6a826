// The decode floor of the expert stage's weight streams on one GPU: what a plain kernel that only reads the
// weights (no arithmetic) takes, shaped as the grouped GEMM's launches at Kimi K3's T = 1 (J = 448, I = 512):
//   - one streaming kernel by size (16 MB .. 504 MB): its fixed cost (launch, ramp, drain) and marginal rate;
//   - gate / up (640 units of 192 KB over 320 CTAs: 2 rounds) and down (896 units of 64 KB over 299 CTAs: 3 rounds),
//     alone, back to back, with a programmatic dependent launch whose second kernel issues its first loads before
//     its wait, fused into one kernel with a grid barrier (the first loads of the second phase before it), and all
//     of their bytes as one kernel with no dependency;
//   - 24 MB read 20 us after an L2 prefetch of it (`cp.async.bulk.prefetch.L2`, `prefetch.global.L2`) or none.
// Every CTA has 64 KB of shared memory (3 an SM, as the BF16 GEMM) and streams through a 4-stage `cp.async` ring of
// 8 KB stages (3 in flight), as the GEMM streams its weights. Each figure is microseconds per layer over 30 layers
// back to back on fresh memory (no L2 reuse between layers), CUDA events.
//
// Build and run on one GPU (nvcc from the CUDA toolkit):
//   nvcc -O3 -gencode arch=compute_90a,code=sm_90a -o stream_probe benchmarks/stream_probe.cu && ./stream_probe
// Prints `metric,us_per_layer` rows.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define CHECK(call)                                                                                          \
  do {                                                                                                       \
    cudaError_t err_ = (call);                                                                               \
    if (err_ != cudaSuccess) {                                                                               \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_));          \
      std::exit(1);                                                                                          \
    }                                                                                                        \
  } while (0)

constexpr int kSmem = 64 << 10;
constexpr int kStage = 8192;
constexpr int kThreads = 128;

__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void cp_async_16(uint32_t smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem), "l"(gmem));
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;"); }

// Issues stage `st` of a unit at `p` into ring slot st % 4 (every thread its 16-byte chunks), then commits.
__device__ __forceinline__ void issue(const char* p, int st, int stages, uint32_t ring) {
  if (st < stages) {
    for (int c = threadIdx.x; c < kStage / 16; c += kThreads)
      cp_async_16(ring + (st % 4) * kStage + c * 16, p + (size_t)st * kStage + c * 16);
  }
  commit();
}

// Streams one unit of `bytes` through the ring; the first `issued` stages were issued by the caller.
__device__ float stream_unit(const char* p, size_t bytes, uint32_t ring, int issued, float acc) {
  extern __shared__ int4 smem[];
  const int stages = (int)(bytes / kStage);
  for (int st = issued; st < 3; st++) issue(p, st, stages, ring);
  for (int st = 0; st < stages; st++) {
    asm volatile("cp.async.wait_group 2;" ::: "memory");
    __syncthreads();
    issue(p, st + 3, stages, ring);
    const int4* s = smem + (st % 4) * (kStage / 16);
    for (int c = threadIdx.x; c < kStage / 16; c += kThreads) acc += __int_as_float(s[c].x ^ s[c].w);
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();
  return acc;
}

__device__ int early_loads(const char* p, uint32_t ring) {
  for (int st = 0; st < 3; st++) issue(p, st, 3, ring);
  return 3;
}

// Units u = cta, cta + grid, .. of `bytes` each. Bits of `mode`: 1 PDL trigger at the start, 2 griddepcontrol.wait
// at the start (a dependent launch), 4 the first unit's first stages issued before that wait.
__global__ void streamer(const char* base, int units, size_t bytes, float* sink, int mode) {
  extern __shared__ int4 smem[];
  const uint32_t ring = (uint32_t)__cvta_generic_to_shared(smem);
  if (mode & 1) asm volatile("griddepcontrol.launch_dependents;");
  int issued = 0;
  if ((mode & 4) && (int)blockIdx.x < units) issued = early_loads(base + (size_t)blockIdx.x * bytes, ring);
  if (mode & 2) asm volatile("griddepcontrol.wait;" ::: "memory");
  float acc = 0.f;
  for (int u = blockIdx.x; u < units; u += gridDim.x) {
    acc = stream_unit(base + (size_t)u * bytes, bytes, ring, u == (int)blockIdx.x ? issued : 0, acc);
  }
  if (acc == 1.2345f) *sink = acc;  // keeps the reads
}

// Both phases in one kernel: phase 1's units, phase 2's first stages issued, a grid barrier (all CTAs resident),
// phase 2's units.
__global__ void fused(const char* base1, int units1, size_t bytes1, const char* base2, int units2, size_t bytes2,
                      float* sink, int* barrier) {
  extern __shared__ int4 smem[];
  const uint32_t ring = (uint32_t)__cvta_generic_to_shared(smem);
  float acc = 0.f;
  for (int u = blockIdx.x; u < units1; u += gridDim.x) acc = stream_unit(base1 + (size_t)u * bytes1, bytes1, ring, 0, acc);
  int issued = (int)blockIdx.x < units2 ? early_loads(base2 + (size_t)blockIdx.x * bytes2, ring) : 0;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(barrier, 1);
    while (*(volatile int*)barrier < (int)gridDim.x) {
    }
    __threadfence();
  }
  __syncthreads();
  for (int u = blockIdx.x; u < units2; u += gridDim.x)
    acc = stream_unit(base2 + (size_t)u * bytes2, bytes2, ring, u == (int)blockIdx.x ? issued : 0, acc);
  if (acc == 1.2345f) *sink = acc;
}

// `mode` 0: spins `ns` only; 1: one bulk L2 prefetch per 64 KB of `bytes` at `base` first; 2: one
// `prefetch.global.L2` per 128-byte line.
__global__ void prefetcher(const char* base, size_t bytes, int mode, uint64_t ns) {
  const uint64_t t0 = globaltimer();
  const size_t share = (bytes / gridDim.x) & ~(size_t)65535;
  const char* p = base + blockIdx.x * share;
  if (mode == 1 && threadIdx.x == 0) {
    for (size_t o = 0; o < share; o += 65536) asm volatile("cp.async.bulk.prefetch.L2.global [%0], 65536;" ::"l"(p + o));
  }
  if (mode == 2) {
    for (size_t o = threadIdx.x * 128; o < share; o += blockDim.x * 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(p + o));
  }
  while (globaltimer() - t0 < ns) {
  }
}

static cudaStream_t stream;
static float* sink;

static void launch(const char* base, int units, size_t bytes, int grid, int mode, bool dependent) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = kThreads;
  config.dynamicSmemBytes = kSmem;
  config.stream = stream;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attr;
  config.numAttrs = dependent ? 1 : 0;
  CHECK(cudaLaunchKernelEx(&config, streamer, base, units, bytes, sink, mode));
}

// Microseconds per layer of `layer(l)` over 30 layers (2 warm-up layers first), each layer on its own memory.
template <typename F>
static void timed(const char* name, F layer) {
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  const int layers = 30;
  layer(layers);
  layer(layers + 1);
  CHECK(cudaEventRecord(e0, stream));
  for (int l = 0; l < layers; l++) layer(l);
  CHECK(cudaEventRecord(e1, stream));
  CHECK(cudaEventSynchronize(e1));
  float ms = 0.f;
  CHECK(cudaEventElapsedTime(&ms, e0, e1));
  std::printf("%s,%.2f\n", name, ms * 1000.f / layers);
  CHECK(cudaEventDestroy(e0));
  CHECK(cudaEventDestroy(e1));
}

int main() {
  const size_t kB = 1024;
  const size_t up_bytes = 192 * kB, down_bytes = 64 * kB;  // a gate / up unit (12 steps of two weights), a down unit
  const int up_units = 640, down_units = 896;
  const size_t layer_bytes = up_units * up_bytes + down_units * down_bytes;  // 184.5 MB
  char* buf;
  int* barriers;
  CHECK(cudaMalloc(&buf, 32 * layer_bytes + (504u << 20)));
  CHECK(cudaMalloc(&sink, 4));
  CHECK(cudaMalloc(&barriers, 4 * 64));
  CHECK(cudaMemset(buf, 1, 32 * layer_bytes + (504u << 20)));
  CHECK(cudaStreamCreate(&stream));
  CHECK(cudaFuncSetAttribute(streamer, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  CHECK(cudaFuncSetAttribute(fused, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  std::printf("metric,us_per_layer\n");
  for (int mb : {16, 32, 63, 126, 252, 504}) {
    const size_t total = (size_t)mb << 20;
    const int units = (int)(total / up_bytes);
    char name[64];
    std::snprintf(name, sizeof(name), "one_kernel_%dMB_grid396", mb);
    // 504 MB layers overlap (the buffer holds 32 layers of 184.5 MB): still far past the L2 between reuses.
    timed(name, [&](int l) { launch(buf + (size_t)(l % 8) * total, units, up_bytes, 396, 0, false); });
  }
  auto up = [&](int l) { return buf + (size_t)l * layer_bytes; };
  auto down = [&](int l) { return up(l) + up_units * up_bytes; };
  timed("gate_up_alone", [&](int l) { launch(up(l), up_units, up_bytes, 320, 0, false); });
  timed("down_alone", [&](int l) { launch(down(l), down_units, down_bytes, 299, 0, false); });
  timed("both_as_one_stream", [&](int l) { launch(up(l), (int)(layer_bytes / up_bytes), up_bytes, 316, 0, false); });
  timed("both_back_to_back", [&](int l) {
    launch(up(l), up_units, up_bytes, 320, 0, false);
    launch(down(l), down_units, down_bytes, 299, 0, false);
  });
  timed("both_pdl_early_loads", [&](int l) {
    launch(up(l), up_units, up_bytes, 320, 1, false);
    launch(down(l), down_units, down_bytes, 299, 2 | 4, true);
  });
  CHECK(cudaMemset(barriers, 0, 4 * 64));  // a counter per layer, zeroed before any runs
  timed("both_fused_grid_barrier", [&](int l) {
    fused<<<320, kThreads, kSmem, stream>>>(up(l), up_units, up_bytes, down(l), down_units, down_bytes, sink,
                                             barriers + l);
  });
  const size_t pf_bytes = 24u << 20;
  const char* names[] = {"read_24MB_after_20us_no_prefetch", "read_24MB_after_20us_bulk_prefetch",
                         "read_24MB_after_20us_line_prefetch"};
  for (int mode = 0; mode < 3; mode++) {
    timed(names[mode], [&](int l) {
      prefetcher<<<132, kThreads, 0, stream>>>(up(l), pf_bytes, mode, 20000);
      launch(up(l), (int)(pf_bytes / up_bytes), up_bytes, 320, 0, false);
    });
  }
  timed("spin_20us_alone", [&](int l) { prefetcher<<<132, kThreads, 0, stream>>>(up(l), 0, 0, 20000); });
  return 0;
}
