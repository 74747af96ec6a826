// The hardware floor of one dispatch + combine between two GPUs: the NVLink flag round trip and the
// SM-issued 16-byte store bandwidth to the peer (and to local memory, for scale).
//
// Build and run on a machine with 2 GPUs joined by NVLink (nvcc from the CUDA toolkit):
//   nvcc -O3 -arch=sm_90a -o floor benchmarks/floor.cu && ./floor [csv-out]
// Prints one line per figure; with an argument, also writes `metric,bytes,value` rows to that file.
//
// The flag round trip is polled the way the kernels poll: one lane spins on relaxed system-scope loads of
// its own 128-byte flag line; the writer stores with a relaxed system-scope store to the peer's line.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
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


// ---- The data skeleton of a T = 1 layer: the real kernels' memory traffic and critical path for one token at
// N = 2, written plainly (no ids, weights, headers, sequence guard or arrival counters; a stand-in quantization
// and the RMSNorm's CTA reduction). The dispatch's CTA 0 loads its token (16 bf16 per thread), packs it to
// 3696 bytes (one byte per element, a scale per 32), stages it in shared memory and stores it to the peer as
// 308 wide LL words; its last CTA polls the peer's words and copies the payload out. The combine's CTA 0 sends
// its 7168-byte partial as 598 wide LL words, then reduces: its own partial plus the peer's (polled), the sum of
// squares over the CTA, the normed row stored. Its time against the real kernels' says how much of theirs is
// design (this) and how much is what this leaves out.
constexpr int kThreads = 224, kRowWords = 308, kSlotWords = 598;

__device__ __forceinline__ void store_wide(void* p, unsigned a, unsigned b, unsigned c, unsigned e) {
  asm volatile(
      "{ .reg .b64 lo, hi; .reg .b128 w; mov.b64 lo, {%1, %2}; mov.b64 hi, {%3, %4}; mov.b128 w, {lo, hi}; "
      "st.relaxed.sys.global.b128 [%0], w; }" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(e) : "memory");
}

__device__ __forceinline__ uint4 load_wide(const void* p) {
  uint4 v;
  asm volatile(
      "{ .reg .b64 lo, hi; .reg .b128 w; ld.relaxed.sys.global.b128 w, [%4]; mov.b128 {lo, hi}, w; "
      "mov.b64 {%0, %1}, lo; mov.b64 {%2, %3}, hi; }"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ float lo_f(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_f(unsigned w) { return __uint_as_float(w & 0xFFFF0000u); }

// Polls stop after this many rounds and raise `error` (a broken run reports itself instead of hanging).
constexpr long long kMaxPolls = 1ll << 24;

__global__ void __launch_bounds__(kThreads) data_dispatch(const uint4* x, uint4* peer_row, const uint4* own_row,
                                                          unsigned* recv, unsigned* ctrl) {
  __shared__ unsigned stage[3 * kRowWords];
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const int tid = threadIdx.x;
  const unsigned epoch = load_relaxed_sys(ctrl) + 1;
  if (blockIdx.x == 0) {
    uint4 a = x[2 * tid], b = x[2 * tid + 1];
    unsigned words[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    unsigned top = 0;
    for (int w = 0; w < 8; ++w) top = max(top, max(words[w] & 0x7FFFu, (words[w] >> 16) & 0x7FFFu));
    top = max(top, __shfl_xor_sync(0xFFFFFFFFu, top, 1));
    for (int j = 0; j < 4; ++j) {  // stand-in for E4M3: each element's top byte
      unsigned p = __byte_perm(words[2 * j], words[2 * j + 1], 0x7531);
      stage[4 * tid + j] = p;
    }
    unsigned scale = top >> 7;
    unsigned sf = scale;
    for (int k = 1; k < 4; ++k) sf |= __shfl_sync(0xFFFFFFFFu, scale, (threadIdx.x + 2 * k) % 32) << (8 * k);
    if (tid % 8 == 0) stage[896 + tid / 8] = sf;
    __syncthreads();
    for (int w = tid; w < kRowWords; w += kThreads) store_wide(peer_row + w, stage[3 * w], stage[3 * w + 1], stage[3 * w + 2], epoch);
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  } else {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (blockIdx.x == gridDim.x - 1) {
      for (int w = tid; w < kRowWords; w += kThreads) {
        uint4 v;
        long long polls = 0;
        do {
          v = load_wide(own_row + w);
        } while (v.w != epoch && ++polls < kMaxPolls);
        if (polls >= kMaxPolls) ctrl[32] = 1;
        recv[3 * w] = v.x;
        recv[3 * w + 1] = v.y;
        recv[3 * w + 2] = v.z;
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads) data_combine(const unsigned* out, const uint4* gamma, uint4* peer_slot,
                                                         const uint4* own_slot, uint4* result, unsigned* ctrl) {
  __shared__ float stash[kThreads / 32];
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const int tid = threadIdx.x;
  const unsigned epoch = load_relaxed_sys(ctrl) + 1;
  if (blockIdx.x != 0) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    return;
  }
  // Send: word w carries pieces 3w .. 3w + 2 of the 1792 4-byte pieces of the partial.
  unsigned pieces[9];
  for (int k = 0; k < 3; ++k)
    for (int c = 0; c < 3; ++c) {
      int index = (tid + k * kThreads) * 3 + c;
      pieces[3 * k + c] = index < 1792 ? out[index] : 0;
    }
  for (int k = 0; k < 3; ++k) {
    int w = tid + k * kThreads;
    if (w < kSlotWords) store_wide(peer_slot + w, pieces[3 * k], pieces[3 * k + 1], pieces[3 * k + 2], epoch);
  }
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  // Reduce: elements [16 tid, 16 tid + 16) = pieces 8 tid .. 8 tid + 7.
  const uint4* own = reinterpret_cast<const uint4*>(out) + 2 * tid;
  uint4 o0 = own[0], o1 = own[1], g0 = gamma[2 * tid], g1 = gamma[2 * tid + 1];
  const int first = (8 * tid) / 3, offset = (8 * tid) % 3;
  unsigned loaded[12];
  long long polls = 0;
  for (;;) {
    uint4 a = load_wide(own_slot + first), b = load_wide(own_slot + first + 1), c = load_wide(own_slot + first + 2),
          d = load_wide(own_slot + first + 3);
    if ((a.w == epoch && b.w == epoch && c.w == epoch && (offset != 2 || d.w == epoch)) || ++polls >= kMaxPolls) {
      unsigned l[12] = {a.x, a.y, a.z, b.x, b.y, b.z, c.x, c.y, c.z, d.x, d.y, d.z};
      for (int i = 0; i < 12; ++i) loaded[i] = l[i];
      break;
    }
  }
  if (polls >= kMaxPolls) ctrl[32] = 2;
  unsigned mine[8] = {o0.x, o0.y, o0.z, o0.w, o1.x, o1.y, o1.z, o1.w};
  unsigned gam[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
  float v[16];
  float ss = 0.f;
  for (int j = 0; j < 8; ++j) {
    unsigned peer = offset == 0 ? loaded[j] : offset == 1 ? loaded[j + 1] : loaded[j + 2];
    v[2 * j] = __bfloat162float(__float2bfloat16_rn(lo_f(mine[j]) + lo_f(peer)));
    v[2 * j + 1] = __bfloat162float(__float2bfloat16_rn(hi_f(mine[j]) + hi_f(peer)));
    ss += v[2 * j] * v[2 * j] + v[2 * j + 1] * v[2 * j + 1];
  }
  for (int k = 1; k < 32; k <<= 1) ss += __shfl_xor_sync(0xFFFFFFFFu, ss, k);
  if (tid % 32 == 0) stash[tid / 32] = ss;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < kThreads / 32; ++w) total += stash[w];
  float rstd = rsqrtf(total / 3584.f + 1e-5f);
  unsigned normed[8];
  for (int j = 0; j < 8; ++j) {
    __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * j] * rstd * lo_f(gam[j]), v[2 * j + 1] * rstd * hi_f(gam[j]));
    normed[j] = *reinterpret_cast<unsigned*>(&h);
  }
  result[2 * tid] = make_uint4(normed[0], normed[1], normed[2], normed[3]);
  result[2 * tid + 1] = make_uint4(normed[4], normed[5], normed[6], normed[7]);
  if (tid == 0) store_relaxed_sys(ctrl, epoch);
}

// Per GPU: the inputs (x, out, gamma: 7168 bytes each, random BF16), the receive regions the peer writes (a row of
// 308 words, a slot of 598 + 4 words of padding), the outputs, and a control line (word 0 the completed layer,
// word 32 an error).
struct DataSide {
  uint4 *x, *out, *gamma, *row, *slot, *result;
  unsigned *recv, *ctrl;
};

static double data_skeleton_us(DataSide side[2], int grid, int layers, int replays, unsigned* error) {
  cudaStream_t streams[2];
  cudaGraphExec_t execs[2];
  cudaEvent_t start[2], stop[2];
  for (int d = 0; d < 2; ++d) {
    CHECK(cudaSetDevice(d));
    CHECK(cudaStreamCreateWithFlags(&streams[d], cudaStreamNonBlocking));
    CHECK(cudaEventCreate(&start[d]));
    CHECK(cudaEventCreate(&stop[d]));
    DataSide& me = side[d];
    DataSide& peer = side[1 - d];
    CHECK(cudaStreamBeginCapture(streams[d], cudaStreamCaptureModeThreadLocal));
    for (int l = 0; l < layers; ++l) {
      launch(data_dispatch, grid, streams[d], true, (const uint4*)me.x, peer.row, (const uint4*)me.row, me.recv, me.ctrl);
      launch(data_combine, grid, streams[d], true, (const unsigned*)me.out, (const uint4*)me.gamma, peer.slot,
             (const uint4*)me.slot, me.result, me.ctrl);
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
  *error = 0;
  for (int d = 0; d < 2; ++d) {
    CHECK(cudaSetDevice(d));
    unsigned e = 0;
    CHECK(cudaMemcpy(&e, side[d].ctrl + 32, 4, cudaMemcpyDeviceToHost));
    *error |= e;
    CHECK(cudaGraphExecDestroy(execs[d]));
    CHECK(cudaStreamDestroy(streams[d]));
  }
  return median(per);
}

// Checks the last layer's outputs of the data skeleton on the host: every GPU's copied-out row is its peer's
// packed token, and its normed row matches a host computation (within 2 %: the host sums in another order).
static bool data_skeleton_ok(DataSide side[2], const std::vector<unsigned short> inputs[2][3]) {
  auto f = [](unsigned short h) { unsigned u = unsigned(h) << 16; float r; std::memcpy(&r, &u, 4); return r; };
  bool ok = true;
  for (int d = 0; d < 2; ++d) {
    CHECK(cudaSetDevice(d));
    std::vector<unsigned char> recv(3696);
    std::vector<unsigned short> result(3584);
    CHECK(cudaMemcpy(recv.data(), side[d].recv, 3696, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(result.data(), side[d].result, 7168, cudaMemcpyDeviceToHost));
    const std::vector<unsigned short>& px = inputs[1 - d][0];
    for (int i = 0; i < 3584; ++i)
      if (recv[i] != (px[i] >> 8)) { ok = false; break; }
    double ss = 0;
    std::vector<double> routed(3584);
    for (int i = 0; i < 3584; ++i) {
      routed[i] = double(f(inputs[0][1][i])) + double(f(inputs[1][1][i]));
      ss += routed[i] * routed[i];
    }
    double rstd = 1.0 / std::sqrt(ss / 3584 + 1e-5);
    for (int i = 0; i < 3584; ++i) {
      double want = routed[i] * rstd * f(inputs[d][2][i]), got = f(result[i]);
      if (std::fabs(got - want) > 0.02 * std::fabs(want) + 1e-2) { ok = false; break; }
    }
  }
  return ok;
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

  // The data skeleton of a T = 1 layer (see `data_dispatch`), grids of 16 as the real kernels' at T = 1.
  {
    DataSide side[2];
    std::vector<unsigned short> inputs[2][3];
    unsigned seed = 12345;
    for (int d = 0; d < 2; ++d) {
      CHECK(cudaSetDevice(d));
      for (int k = 0; k < 3; ++k) {
        inputs[d][k].resize(3584);
        for (auto& h : inputs[d][k]) {  // BF16 of magnitude 2^-3 .. 2^3, both signs
          seed = seed * 1664525u + 1013904223u;
          h = (unsigned short)(((seed >> 16) & 0x807F) | ((124 + (seed >> 28) % 7) << 7));
        }
      }
      CHECK(cudaMalloc(&side[d].x, 7168));
      CHECK(cudaMalloc(&side[d].out, 7168));
      CHECK(cudaMalloc(&side[d].gamma, 7168));
      CHECK(cudaMemcpy(side[d].x, inputs[d][0].data(), 7168, cudaMemcpyHostToDevice));
      CHECK(cudaMemcpy(side[d].out, inputs[d][1].data(), 7168, cudaMemcpyHostToDevice));
      CHECK(cudaMemcpy(side[d].gamma, inputs[d][2].data(), 7168, cudaMemcpyHostToDevice));
      CHECK(cudaMalloc(&side[d].row, kRowWords * 16));
      CHECK(cudaMalloc(&side[d].slot, (kSlotWords + 4) * 16));
      CHECK(cudaMalloc(&side[d].result, 7168));
      CHECK(cudaMalloc(&side[d].recv, 3696));
      CHECK(cudaMalloc(&side[d].ctrl, 256));
      CHECK(cudaMemset(side[d].row, 0, kRowWords * 16));
      CHECK(cudaMemset(side[d].slot, 0, (kSlotWords + 4) * 16));
      CHECK(cudaMemset(side[d].ctrl, 0, 256));
      CHECK(cudaDeviceSynchronize());
    }
    unsigned error = 0;
    double us = data_skeleton_us(side, 16, 50, 30, &error);
    bool ok = error == 0 && data_skeleton_ok(side, inputs);
    std::printf("data_skeleton_layer_us T=1 grid=16 %.3f (%s)\n", us, ok ? "outputs checked" : "OUTPUTS WRONG");
    if (csv) std::fprintf(csv, "data_skeleton_layer_us_t1_g16%s,0,%.4f\n", ok ? "" : "_WRONG", us);
  }
  if (csv) std::fclose(csv);
  return 0;
}
