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

// ---- The skeleton of a layer: what any design with a kernel per stage pays before it moves a byte of data.
// `exchange` is a dispatch or a combine stripped to its synchronisation: CTA 0's thread 0 reads the layer's
// epoch (one past the last completed layer), stores it into the peer's flag line of this stage, and polls its
// own line until the peer's store lands (one NVLink crossing each way, overlapped); the combine stage then
// records the layer as completed. `idle` stands for the expert stage between them inside a jitted program.
// Every kernel waits on its predecessor with griddepcontrol.wait and releases its dependents as the real
// kernels do (after the flag store), so with programmatic launch the boundaries cost what ours cost.
__global__ void __launch_bounds__(224) exchange(unsigned* peer_line, unsigned* own_line, unsigned* completed,
                                                int record) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    unsigned epoch = load_relaxed_sys(completed) + 1;
    store_relaxed_sys(peer_line, epoch);
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    while ((int)(load_relaxed_sys(own_line) - epoch) < 0) {
    }
    if (record) store_relaxed_sys(completed, epoch);
  } else {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  }
}

__global__ void __launch_bounds__(224) idle() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

template <typename... Args>
static void launch(void (*kernel)(Args...), int grid, cudaStream_t stream, bool pdl, Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(224);
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = pdl ? 1 : 0;
  CHECK(cudaLaunchKernelEx(&config, kernel, args...));
}

// Median over replays of (elapsed / layers) of a CUDA graph of `layers` skeleton layers per GPU (the slower
// GPU's), both GPUs' graphs launched back to back as the harness launches the real kernels.
static double skeleton_us(unsigned* lines[2], int stages, bool pdl, int grid, int layers, int replays) {
  cudaStream_t streams[2];
  cudaGraphExec_t execs[2];
  cudaEvent_t start[2], stop[2];
  for (int d = 0; d < 2; ++d) {
    CHECK(cudaSetDevice(d));
    CHECK(cudaStreamCreateWithFlags(&streams[d], cudaStreamNonBlocking));
    CHECK(cudaEventCreate(&start[d]));
    CHECK(cudaEventCreate(&stop[d]));
    unsigned* own = lines[d];
    unsigned* peer = lines[1 - d];
    // Words (4 bytes) at 128-byte lines: 0 the dispatch flag, 32 the combine flag, 64 the completed layer.
    CHECK(cudaStreamBeginCapture(streams[d], cudaStreamCaptureModeThreadLocal));
    for (int l = 0; l < layers; ++l) {
      launch(exchange, grid, streams[d], pdl, peer, own, own + 64, 0);
      if (stages == 3) launch(idle, grid, streams[d], pdl);
      launch(exchange, grid, streams[d], pdl, peer + 32, own + 32, own + 64, 1);
    }
    cudaGraph_t graph;
    CHECK(cudaStreamEndCapture(streams[d], &graph));
    CHECK(cudaGraphInstantiate(&execs[d], graph, 0));
    CHECK(cudaGraphDestroy(graph));
  }
  std::vector<double> per;
  for (int it = 0; it < replays + 2; ++it) {
    for (int d = 0; d < 2; ++d) {
      CHECK(cudaSetDevice(d));
      CHECK(cudaEventRecord(start[d], streams[d]));
      CHECK(cudaGraphLaunch(execs[d], streams[d]));
      CHECK(cudaEventRecord(stop[d], streams[d]));
    }
    double worst = 0;
    for (int d = 0; d < 2; ++d) {
      CHECK(cudaSetDevice(d));
      CHECK(cudaEventSynchronize(stop[d]));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, start[d], stop[d]));
      worst = std::max(worst, ms * 1e3 / layers);
    }
    if (it >= 2) per.push_back(worst);
  }
  for (int d = 0; d < 2; ++d) {
    CHECK(cudaSetDevice(d));
    CHECK(cudaGraphExecDestroy(execs[d]));
    CHECK(cudaStreamDestroy(streams[d]));
  }
  return median(per);
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

  // The skeleton of a layer (see `exchange`): two stages (the kernels alone) and three (a jitted layer's
  // dispatch, expert stage and combine), with and without programmatic launch; grids of 16 CTAs (the default
  // grid at T = 1 with a buffer of 8 rows) and 256 (the cap).
  unsigned* lines[2];
  for (int d = 0; d < 2; ++d) {
    CHECK(cudaSetDevice(d));
    CHECK(cudaMalloc(&lines[d], 3 * 128));
    CHECK(cudaMemset(lines[d], 0, 3 * 128));
    CHECK(cudaDeviceSynchronize());
  }
  for (int grid : {16, 256}) {
    for (int stages : {2, 3}) {
      for (int pdl : {1, 0}) {
        double us = skeleton_us(lines, stages, pdl != 0, grid, 50, 30);
        std::printf("skeleton_layer_us stages=%d pdl=%d grid=%d %.3f\n", stages, pdl, grid, us);
        if (csv) std::fprintf(csv, "skeleton_layer_us_s%d_pdl%d_g%d,0,%.4f\n", stages, pdl, grid, us);
      }
    }
  }
  if (csv) std::fclose(csv);
  return 0;
}
