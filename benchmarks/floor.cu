// The hardware floor of one dispatch + combine between two GPUs: the NVLink flag round trip and the
// SM-issued 16-byte store bandwidth to the peer (and to local memory, for scale).
//
// Build and run on a machine with 2 GPUs joined by NVLink (nvcc from the CUDA toolkit):
//   nvcc -O3 -arch=sm_90a -o floor benchmarks/floor.cu && ./floor [csv-out]
// Prints one line per figure; with an argument, also writes `metric,bytes,value` rows to that file.
//
// The flag round trip is polled the way the kernels poll: one lane spins on relaxed system-scope loads of
// its own 128-byte flag line; the writer stores with a relaxed system-scope store to the peer's line.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(call)                                                                      \
  do {                                                                                   \
    cudaError_t err_ = (call);                                                           \
    if (err_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call,                  \
                   cudaGetErrorString(err_));                                            \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

__device__ __forceinline__ unsigned load_relaxed_sys(const unsigned* p) {
  unsigned v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void store_relaxed_sys(unsigned* p, unsigned v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Ping side: raise the peer's flag to i, wait for our own flag to read i. Pong side answers.
__global__ void ping(unsigned* peer_flag, unsigned* own_flag, int iters, long long* cycles) {
  long long start = clock64();
  for (int i = 1; i <= iters; ++i) {
    store_relaxed_sys(peer_flag, i);
    while (load_relaxed_sys(own_flag) != (unsigned)i) {
    }
  }
  *cycles = clock64() - start;
}

__global__ void pong(unsigned* peer_flag, unsigned* own_flag, int iters) {
  for (int i = 1; i <= iters; ++i) {
    while (load_relaxed_sys(own_flag) != (unsigned)i) {
    }
    store_relaxed_sys(peer_flag, i);
  }
}

// Every thread stores 16-byte words to dst, grid-strided: the SM store path the kernels use.
__global__ void store16(uint4* dst, size_t words, unsigned salt) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  size_t step = (size_t)gridDim.x * blockDim.x;
  for (; i < words; i += step) {
    dst[i] = make_uint4(i ^ salt, i + salt, salt, i);
  }
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  int count = 0;
  CHECK(cudaGetDeviceCount(&count));
  if (count < 2) {
    std::fprintf(stderr, "needs 2 GPUs, found %d\n", count);
    return 1;
  }
  FILE* csv = argc > 1 ? std::fopen(argv[1], "w") : nullptr;
  if (csv) std::fprintf(csv, "metric,bytes,value\n");
  int can = 0;
  CHECK(cudaDeviceCanAccessPeer(&can, 0, 1));
  if (!can) {
    std::fprintf(stderr, "no peer access between GPU 0 and 1\n");
    return 1;
  }
  for (int d = 0; d < 2; ++d) {
    CHECK(cudaSetDevice(d));
    cudaError_t e = cudaDeviceEnablePeerAccess(1 - d, 0);
    if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) CHECK(e);
    cudaGetLastError();
  }
  unsigned* flags[2];
  for (int d = 0; d < 2; ++d) {
    CHECK(cudaSetDevice(d));
    CHECK(cudaMalloc(&flags[d], 128));
    CHECK(cudaMemset(flags[d], 0, 128));
    CHECK(cudaDeviceSynchronize());
  }
  // Flag round trip: median of several runs of `iters` round trips each.
  const int iters = 20000;
  std::vector<double> rtts;
  long long* d_cycles;
  CHECK(cudaSetDevice(0));
  CHECK(cudaMalloc(&d_cycles, sizeof(long long)));
  for (int run = 0; run < 7; ++run) {
    for (int d = 0; d < 2; ++d) {
      CHECK(cudaSetDevice(d));
      CHECK(cudaMemset(flags[d], 0, 128));
      CHECK(cudaDeviceSynchronize());
    }
    cudaEvent_t a, b;
    CHECK(cudaSetDevice(1));
    pong<<<1, 1>>>(flags[0], flags[1], iters);
    CHECK(cudaGetLastError());
    CHECK(cudaSetDevice(0));
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    CHECK(cudaEventRecord(a));
    ping<<<1, 1>>>(flags[1], flags[0], iters, d_cycles);
    CHECK(cudaGetLastError());
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    CHECK(cudaSetDevice(1));
    CHECK(cudaDeviceSynchronize());
    if (run > 0) rtts.push_back(ms * 1e3 / iters);
  }
  double rtt = median(rtts);
  std::printf("flag_round_trip_us %.3f\n", rtt);
  if (csv) std::fprintf(csv, "flag_round_trip_us,0,%.4f\n", rtt);

  // Store bandwidth from GPU 0's SMs to GPU 1 (peer) and to GPU 0 (local), several sizes.
  const size_t max_bytes = size_t(1) << 30;
  uint4 *local_buf, *peer_buf;
  CHECK(cudaSetDevice(1));
  CHECK(cudaMalloc(&peer_buf, max_bytes));
  CHECK(cudaSetDevice(0));
  CHECK(cudaMalloc(&local_buf, max_bytes));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const size_t sizes[] = {size_t(64) << 10, size_t(1) << 20, size_t(8) << 20, size_t(256) << 20, max_bytes};
  for (int target = 0; target < 2; ++target) {
    uint4* dst = target ? peer_buf : local_buf;
    for (size_t bytes : sizes) {
      size_t words = bytes / 16;
      int blocks = (int)std::min<size_t>((words + 255) / 256, (size_t)prop.multiProcessorCount * 8);
      int reps = bytes >= (size_t(256) << 20) ? 5 : 50;
      cudaEvent_t a, b;
      CHECK(cudaEventCreate(&a));
      CHECK(cudaEventCreate(&b));
      store16<<<blocks, 256>>>(dst, words, 1);  // warm up
      CHECK(cudaGetLastError());
      std::vector<double> gbps;
      for (int r = 0; r < 9; ++r) {
        CHECK(cudaEventRecord(a));
        for (int k = 0; k < reps; ++k) store16<<<blocks, 256>>>(dst, words, r + k);
        CHECK(cudaEventRecord(b));
        CHECK(cudaEventSynchronize(b));
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, a, b));
        gbps.push_back(double(bytes) * reps / (ms * 1e-3) / 1e9);
      }
      double bw = median(gbps);
      const char* name = target ? "peer_store_GBps" : "local_store_GBps";
      std::printf("%s bytes=%zu %.1f\n", name, bytes, bw);
      if (csv) std::fprintf(csv, "%s,%zu,%.2f\n", name, bytes, bw);
    }
  }
  if (csv) std::fclose(csv);
  return 0;
}
