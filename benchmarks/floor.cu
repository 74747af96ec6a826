// The hardware floor of one dispatch + combine between two GPUs: the NVLink flag round trip and the
// SM-issued 16-byte store bandwidth to the peer (and to local memory, for scale); then the skeletons of a layer,
// timed as the kernel harness times the kernels: the synchronisation alone (`exchange`) and a T = 1 layer's data
// path with a ladder of the kernels' features (`data_dispatch`, `data_combine`).
//
// Build and run on a machine with 2 GPUs joined by NVLink (nvcc from the CUDA toolkit):
//   nvcc -O3 -arch=sm_90a -o floor benchmarks/floor.cu && ./floor [csv-out]
// Also the peer store bandwidth with both GPUs storing into each other at once (`peer_store_bidir_GBps`).
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

// Median over `replays` replays of the per-layer time of one CUDA graph per GPU, the slower GPU's: `capture(d, stream,
// n)` enqueues n of GPU d's layers while the stream is captured; each graph is `warmup` layers, an event record node,
// `layers` layers and another event record node, and the time per layer is the time between the two nodes over
// `layers`: the steady layers only. (Both GPUs' graphs are launched back to back as the harness launches the real
// kernels: the GPU launched first waits for the other in its first layer, a start-up skew that the warm-up layers
// absorb; the harness times its kernels the same way since `9d05f78`.)
template <typename Capture>
static double graph_us(int layers, int replays, Capture capture, int warmup = 10) {
  cudaStream_t streams[2];
  cudaGraphExec_t execs[2];
  cudaEvent_t first[2], last[2];
  for (int d = 0; d < 2; ++d) {
    CHECK(cudaSetDevice(d));
    CHECK(cudaStreamCreateWithFlags(&streams[d], cudaStreamNonBlocking));
    CHECK(cudaEventCreate(&first[d]));
    CHECK(cudaEventCreate(&last[d]));
    CHECK(cudaStreamBeginCapture(streams[d], cudaStreamCaptureModeThreadLocal));
    capture(d, streams[d], warmup);
    CHECK(cudaEventRecordWithFlags(first[d], streams[d], cudaEventRecordExternal));
    capture(d, streams[d], layers);
    CHECK(cudaEventRecordWithFlags(last[d], streams[d], cudaEventRecordExternal));
    cudaGraph_t graph;
    CHECK(cudaStreamEndCapture(streams[d], &graph));
    CHECK(cudaGraphInstantiate(&execs[d], graph, 0));
    CHECK(cudaGraphDestroy(graph));
  }
  std::vector<double> per;
  for (int it = 0; it < replays + 2; ++it) {
    for (int d = 0; d < 2; ++d) {
      CHECK(cudaSetDevice(d));
      CHECK(cudaGraphLaunch(execs[d], streams[d]));
    }
    double worst = 0;
    for (int d = 0; d < 2; ++d) {
      CHECK(cudaSetDevice(d));
      CHECK(cudaStreamSynchronize(streams[d]));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, first[d], last[d]));
      worst = std::max(worst, ms * 1e3 / layers);
    }
    if (it >= 2) per.push_back(worst);  // two warm-up replays
  }
  for (int d = 0; d < 2; ++d) {
    CHECK(cudaSetDevice(d));
    CHECK(cudaGraphExecDestroy(execs[d]));
    CHECK(cudaStreamDestroy(streams[d]));
  }
  return median(per);
}


// ---- The data skeleton of a T = 1 layer: the real kernels' memory traffic and critical path for one token at
// N = 2, written plainly. Bare (features 0): the dispatch's CTA 0 loads its token (16 bf16 per thread), packs it
// to 3696 bytes (a stand-in quantization: each element's top byte, a scale per 32), stages it in shared memory
// and stores it to the peer as 308 wide LL words; its last CTA polls the peer's words and copies the payload
// out. The combine's CTA 0 sends its 7168-byte partial as 598 wide LL words, then reduces: its own partial plus
// the peer's (polled), the sum of squares over the CTA, the normed row stored. Each feature bit adds one thing
// the real kernels do, the way they do it, so that the ladder says what each costs:
//   kQuant  the MXFP8 arithmetic (scale from the block's amax, 16 multiplies, cvt to e4m3) and the norm's exact
//           division;
//   kRoute  routing: ids and weights loaded with the token, the destination mask (redux, shared memory) before
//           the stores, ids / weights / a header as LL words beside the row, polled and copied by the copy-out
//           with it, the own row's outputs; the combine reads the token's mask (ids) before it reduces;
//   kGuard  the sequence guard: two epoch words read and checked, every CTA arriving on a counter (barrier +
//           atomic), the last one handing the epoch on at its end;
//   kReady  the ready line: the combine's CTA 0 tells the peer at its start, the dispatch polls it (acquire)
//           before its stores;
//   kRows   a buffer of 8 rows: the dispatch's CTAs 1-7 store empty headers and their own rows' constants, the
//           copy-out covers 8 rows (7 empty), the combine's CTAs 0-7 read their row's mirror word and send only a
//           full row;
//   kTimer  the poll timeout: %globaltimer read before each poll loop and every 32 unanswered polls;
//   kTable  the peer's base address loaded from a table in this rank's memory (lane d holds rank d's) and
//           taken with a shuffle, as the kernels find their peers;
//   kNoBarrier (a measurement only, unsafe in the kernels) the guard's arrival without its CTA barrier;
//   kArriveOnly (a measurement only, without kGuard) the guard's arrivals and hand-over without its epoch checks;
//   kReadyRelaxed (a measurement only, unsafe in the kernels) the ready poll with relaxed loads.
// Its time against the real kernels' says how much of theirs is the design and how much each part of it costs.
constexpr int kThreads = 224, kRowWords = 308, kSlotWords = 598, kTopk = 16, kRows8 = 8;
enum Feature { kQuant = 1, kRoute = 2, kGuard = 4, kReady = 8, kRows = 16, kTimer = 32, kTable = 64, kNoBarrier = 128,
              kArriveOnly = 256, kReadyRelaxed = 512 };
constexpr unsigned kEmpty = 0xFFFFFFFFu;
// Control words (4 bytes each) of a side's `ctrl`: lines of 128 bytes.
constexpr int kEpochD = 0, kEpochC = 1, kCountD = 32, kCountC = 64, kError = 96, kReadyLine = 128;

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

__device__ __forceinline__ void store_ll(void* p, unsigned v, unsigned e) {
  asm volatile("st.relaxed.sys.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(v), "r"(e) : "memory");
}

__device__ __forceinline__ uint2 load_ll(const void* p) {
  unsigned long long v;
  asm volatile("ld.relaxed.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return make_uint2(unsigned(v), unsigned(v >> 32));
}

__device__ __forceinline__ unsigned load_acquire_sys(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ unsigned e4m3x4(float a, float b, float c, float d) {
  unsigned r;
  asm("{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1; cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3; "
      "mov.b32 %0, {lo, hi}; }" : "=r"(r) : "f"(a), "f"(b), "f"(c), "f"(d));
  return r;
}

__device__ __forceinline__ float lo_f(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_f(unsigned w) { return __uint_as_float(w & 0xFFFF0000u); }

// Polls stop after this many rounds and raise the error word (a broken run reports itself instead of hanging).
constexpr long long kMaxPolls = 1ll << 24;

// The sequence guard's arrival (kGuard): a barrier, then thread 0's atomic; returns the old count.
template <int F>
__device__ __forceinline__ unsigned arrive(unsigned* counter) {
  if (!(F & kNoBarrier)) __syncthreads();
  unsigned old = 0;
  if (threadIdx.x == 0) old = atomicInc(counter, gridDim.x - 1);
  return old;
}

// The peer-written regions of a side (`peer_mem`) and its own arrays. Offsets in bytes inside `peer_mem`.
constexpr size_t kRowAt = 0, kIdsAt = 8 * 5120, kWAt = kIdsAt + 8 * 128, kHdrAt = kWAt + 8 * 128,
                 kSlotAt = kHdrAt + 8 * 128, kPeerMemBytes = kSlotAt + (kSlotWords + 4) * 16;

struct DataSide {
  uint4 *x, *out, *gamma, *result;
  unsigned *ids, *weights;                                          // inputs: [16] each
  unsigned char* peer_mem;                                          // written by the peer
  unsigned *recv, *recv_ids, *recv_weights, *recv_src, *mirror;    // outputs: 8 rows
  unsigned* ctrl;
  unsigned long long* table;  // [2]: rank d's peer_mem (kTable)
};

// Timer helpers (kTimer): the kernels read %globaltimer before a poll loop and every 32 unanswered polls.
__device__ __forceinline__ unsigned long long global_timer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
constexpr unsigned long long kTimeoutNs = 10000000000ull;

template <int F>
__device__ __forceinline__ bool expired(unsigned long long start, long long polls) {
  if (F & kTimer) return (polls & 31) == 0 && global_timer() - start > kTimeoutNs;
  return false;
}

// The peer's peer_mem: a kernel parameter, or (kTable) lane `peer` of the table entry each lane loaded at the
// kernel's start (`table_entry`, in the first wave of loads, as the kernels do), shuffled.
template <int F>
__device__ __forceinline__ unsigned long long table_entry(const DataSide& me) {
  if (F & kTable) {
    int lane = threadIdx.x % 32;
    return me.table[lane < 2 ? lane : 0];
  }
  return 0;
}

template <int F>
__device__ __forceinline__ unsigned char* peer_base(unsigned long long entry, const DataSide& peer, int peer_rank) {
  if (F & kTable) return reinterpret_cast<unsigned char*>(__shfl_sync(0xFFFFFFFFu, entry, peer_rank));
  return peer.peer_mem;
}

// Both data kernels' entry: griddepcontrol.wait, then the thread's place, the rows it covers and (kTable) its lane's
// peer-table entry.
struct Entry {
  int tid, lane, cta, rows;
  unsigned long long entry;
};

template <int F>
__device__ __forceinline__ Entry enter(const DataSide& me) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const int tid = threadIdx.x;
  return {tid, tid % 32, int(blockIdx.x), (F & kRows) ? kRows8 : 1, table_entry<F>(me)};
}

template <int F>
__global__ void __launch_bounds__(kThreads) data_dispatch(DataSide me, DataSide peer, int rank) {
  __shared__ unsigned stage[3 * kRowWords];
  __shared__ unsigned shared_mask;
  const auto [tid, lane, cta, rows, entry] = enter<F>(me);
  unsigned* ctrl = me.ctrl;
  const unsigned epoch = load_relaxed_sys(ctrl + kEpochD) + 1;
  unsigned expert = 0, weight = 0;
  uint4 a = make_uint4(0, 0, 0, 0), b = a;
  if (cta == 0) {
    if (F & kRoute) {
      expert = me.ids[tid < kTopk ? tid : 0];
      weight = me.weights[tid < kTopk ? tid : 0];
    }
    a = me.x[2 * tid];
    b = me.x[2 * tid + 1];
  }
  if (F & kGuard) {
    if (load_relaxed_sys(ctrl + kEpochC) == epoch) {
      ctrl[kError] = 3;
      asm volatile("trap;");
    }
  }
  if ((F & kReady) && cta < rows && tid == 0) {
    long long polls = 0;
    unsigned long long start = (F & kTimer) ? global_timer() : 0;
    while ((int)(((F & kReadyRelaxed) ? load_relaxed_sys(ctrl + kReadyLine) : load_acquire_sys(ctrl + kReadyLine)) -
                 (epoch - 1)) < 0 &&
           ++polls < kMaxPolls) {
      if (expired<F>(start, polls)) ctrl[kError] = 9;
    }
    if (polls >= kMaxPolls) ctrl[kError] = 4;
  }
  const unsigned source = (unsigned(rank) << 16) | 0u;
  unsigned char* peer_mem = peer_base<F>(entry, peer, 1 - rank);
  if (cta == 0) {
    if (F & kRoute) {
      if (tid < 32) {
        unsigned bit = lane < kTopk ? 1u << (expert / 448) : 0u;
        unsigned mask = __reduce_or_sync(0xFFFFFFFFu, bit);
        if (lane == 0) shared_mask = mask;
      }
    }
    unsigned words[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    unsigned top = 0;
    for (int w = 0; w < 8; ++w) top = max(top, max(words[w] & 0x7FFFu, (words[w] >> 16) & 0x7FFFu));
    top = max(top, __shfl_xor_sync(0xFFFFFFFFu, top, 1));
    unsigned e = 0, packed[4];
    if (F & kQuant) {
      unsigned s_bits = __float_as_uint(__fmul_rz(__uint_as_float(top << 16), 1.0f / 448.0f));
      if (s_bits & 0x7FFFFFFFu) {
        e = (s_bits >> 23) & 0xFF;
        if (s_bits & 0x7FFFFF) e += 1;
        e = min(e, 254u);
      }
      unsigned inv_bits = e ? (254u - e) << 23 : 0u;
      if (top >= 0x7F80u) { e = 255; inv_bits = 0; }
      float inv = __uint_as_float(inv_bits);
      for (int j = 0; j < 4; ++j)
        packed[j] = e4m3x4(lo_f(words[2 * j]) * inv, hi_f(words[2 * j]) * inv, lo_f(words[2 * j + 1]) * inv,
                           hi_f(words[2 * j + 1]) * inv);
    } else {
      e = top >> 7;
      for (int j = 0; j < 4; ++j) packed[j] = __byte_perm(words[2 * j], words[2 * j + 1], 0x7531);
    }
    for (int j = 0; j < 4; ++j) stage[4 * tid + j] = packed[j];
    unsigned sf = e;
    for (int k = 1; k < 4; ++k) sf |= __shfl_sync(0xFFFFFFFFu, e, (lane + 2 * k) % 32) << (8 * k);
    if (tid % 8 == 0) stage[896 + tid / 8] = sf;
    __syncthreads();
    const unsigned mask = (F & kRoute) ? shared_mask : 3u;
    if (mask & (1u << (1 - rank))) {
      uint4* row = reinterpret_cast<uint4*>(peer_mem + kRowAt);
      for (int w = tid; w < kRowWords; w += kThreads)
        store_wide(row + w, stage[3 * w], stage[3 * w + 1], stage[3 * w + 2], epoch);
      if ((F & kRoute) && tid < kTopk) {
        store_ll(peer_mem + kIdsAt + 8 * tid, expert, epoch);
        store_ll(peer_mem + kWAt + 8 * tid, weight, epoch);
      }
    }
    if ((F & (kRoute | kRows)) && tid == 0)
      store_ll(peer_mem + kHdrAt, (mask & (1u << (1 - rank))) ? source : kEmpty, epoch);
    if (F & kRoute) {  // the own row's outputs (row `rank * 8`), from the registers
      unsigned own = rank * rows;
      reinterpret_cast<uint4*>(me.recv + own * 924)[tid] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      if (tid % 8 == 0) me.recv[own * 924 + 896 + tid / 8] = sf;
      if (tid < kTopk) {
        me.recv_ids[own * kTopk + tid] = expert;
        me.recv_weights[own * kTopk + tid] = weight;
      }
      if (tid == 0) {
        me.recv_src[own] = source;
        me.mirror[own] = source;
      }
    }
  } else if ((F & kRows) && cta < rows && tid == 0) {  // an empty row j = cta: header and own constants
    store_ll(peer_mem + kHdrAt + 128 * cta, kEmpty, epoch);
    me.recv_src[rank * rows + cta] = kEmpty;
    me.mirror[rank * rows + cta] = kEmpty;
  }
  unsigned old = 0;
  if (F & (kGuard | kArriveOnly)) old = arrive<F>(ctrl + kCountD);
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  // Copy-out: peer row r (r < rows) by CTA G - 1 - r.
  const int r = gridDim.x - 1 - cta;
  if (r < rows) {
    const unsigned q = (1 - rank) * rows + r;  // the peer's row r in this rank's outputs
    const bool headers = (F & (kRoute | kRows)) != 0;
    const uint2* hdr = reinterpret_cast<const uint2*>(me.peer_mem + kHdrAt + 128 * r);
    const uint4* row = reinterpret_cast<const uint4*>(me.peer_mem + kRowAt);
    long long polls = 0;
    bool pending = true;
    unsigned long long start = (F & kTimer) ? global_timer() : 0;
    while (pending && polls < kMaxPolls) {
      ++polls;
      if (expired<F>(start, polls)) ctrl[kError] = 9;
      uint2 h = headers ? load_ll(hdr) : make_uint2(0, epoch);
      uint4 w0 = make_uint4(0, 0, 0, 0), w1 = w0;
      if (r == 0) {
        w0 = load_wide(row + tid);
        if (tid + kThreads < kRowWords) w1 = load_wide(row + tid + kThreads);
      }
      uint2 id = make_uint2(0, epoch), wt = id;
      if ((F & kRoute) && tid < kTopk && r == 0) {
        id = load_ll(me.peer_mem + kIdsAt + 8 * tid);
        wt = load_ll(me.peer_mem + kWAt + 8 * tid);
      }
      if (h.y != epoch) continue;
      if (h.x == kEmpty) {
        pending = false;
        if (tid == 0) {
          me.recv_src[q] = kEmpty;
          me.mirror[q] = kEmpty;
        }
        break;
      }
      bool ok = w0.w == epoch && (tid + kThreads >= kRowWords || w1.w == epoch) && id.y == epoch && wt.y == epoch;
      if (!ok) continue;
      pending = false;
      unsigned* out = me.recv + q * 924;
      out[3 * tid] = w0.x;
      out[3 * tid + 1] = w0.y;
      out[3 * tid + 2] = w0.z;
      if (tid + kThreads < kRowWords) {
        out[3 * (tid + kThreads)] = w1.x;
        out[3 * (tid + kThreads) + 1] = w1.y;
        out[3 * (tid + kThreads) + 2] = w1.z;
      }
      if ((F & kRoute) && tid < kTopk) {
        me.recv_ids[q * kTopk + tid] = id.x;
        me.recv_weights[q * kTopk + tid] = wt.x;
      }
      if (tid == 0 && headers) {
        me.recv_src[q] = h.x;
        me.mirror[q] = h.x;
      }
    }
    if (pending) ctrl[kError] = 1;
  }
  if ((F & (kGuard | kArriveOnly)) && tid == 0 && old == gridDim.x - 1) store_relaxed_sys(ctrl + kEpochC, epoch);
}

template <int F>
__global__ void __launch_bounds__(kThreads) data_combine(DataSide me, DataSide peer, int rank) {
  __shared__ float stash[kThreads / 32];
  __shared__ unsigned shared_mask;
  const auto [tid, lane, cta, rows, entry] = enter<F>(me);
  unsigned* ctrl = me.ctrl;
  unsigned epoch;
  if (F & kGuard) {
    epoch = load_relaxed_sys(ctrl + kEpochC);
    if (load_relaxed_sys(ctrl + kEpochD) + 1 != epoch) {
      ctrl[kError] = 5;
      asm volatile("trap;");
    }
  } else {
    epoch = load_relaxed_sys(ctrl + kEpochD) + 1;
  }
  if ((F & kReady) && cta == 0 && tid == 0) store_relaxed_sys(peer.ctrl + kReadyLine, epoch);
  // Send the peer's row r = cta (if it holds a token): its output goes back to the peer's slot.
  const bool sends = cta < rows;
  unsigned source = 0;
  if (sends && (F & (kRoute | kRows))) source = me.mirror[(1 - rank) * rows + cta];
  unsigned pieces[9];
  const unsigned* out = reinterpret_cast<const unsigned*>(me.out);
  for (int k = 0; k < 3; ++k)
    for (int c = 0; c < 3; ++c) {
      int index = (tid + k * kThreads) * 3 + c;
      pieces[3 * k + c] = (sends && index < 1792) ? out[index] : 0;
    }
  if ((F & kRoute) && cta == 0 && tid >= 32 && tid < 64) {
    unsigned bit = lane < kTopk ? 1u << (me.ids[lane] / 448) : 0u;
    unsigned mask = __reduce_or_sync(0xFFFFFFFFu, bit);
    if (lane == 0) shared_mask = mask;
  }
  if (sends && source != kEmpty) {
    uint4* slot = reinterpret_cast<uint4*>(peer_base<F>(entry, peer, 1 - rank) + kSlotAt);
    for (int k = 0; k < 3; ++k) {
      int w = tid + k * kThreads;
      if (w < kSlotWords) store_wide(slot + w, pieces[3 * k], pieces[3 * k + 1], pieces[3 * k + 2], epoch);
    }
  }
  unsigned old = 0;
  if (F & (kGuard | kArriveOnly)) old = arrive<F>(ctrl + kCountC);
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (cta == 0) {  // reduce own token 0: elements [16 tid, 16 tid + 16) = pieces 8 tid .. 8 tid + 7
    unsigned mask = 3u;
    if (F & kRoute) {
      __syncthreads();
      mask = shared_mask;
    }
    const uint4* own = reinterpret_cast<const uint4*>(me.out) + 2 * tid;
    uint4 o0 = own[0], o1 = own[1], g0 = me.gamma[2 * tid], g1 = me.gamma[2 * tid + 1];
    const int first = (8 * tid) / 3, offset = (8 * tid) % 3;
    const uint4* slot = reinterpret_cast<const uint4*>(me.peer_mem + kSlotAt);
    unsigned loaded[12] = {};
    if (mask & (1u << (1 - rank))) {
      long long polls = 0;
      unsigned long long start = (F & kTimer) ? global_timer() : 0;
      for (;;) {
        if (expired<F>(start, polls)) ctrl[kError] = 9;
        uint4 a = load_wide(slot + first), b = load_wide(slot + first + 1), c = load_wide(slot + first + 2),
              d = load_wide(slot + first + 3);
        if ((a.w == epoch && b.w == epoch && c.w == epoch && (offset != 2 || d.w == epoch)) || ++polls >= kMaxPolls) {
          unsigned l[12] = {a.x, a.y, a.z, b.x, b.y, b.z, c.x, c.y, c.z, d.x, d.y, d.z};
          for (int i = 0; i < 12; ++i) loaded[i] = l[i];
          break;
        }
      }
      if (polls >= kMaxPolls) ctrl[kError] = 2;
    }
    unsigned mine[8] = {o0.x, o0.y, o0.z, o0.w, o1.x, o1.y, o1.z, o1.w};
    unsigned gam[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
    float v[16];
    float ss = 0.f;
    for (int j = 0; j < 8; ++j) {
      unsigned p = offset == 0 ? loaded[j] : offset == 1 ? loaded[j + 1] : loaded[j + 2];
      v[2 * j] = __bfloat162float(__float2bfloat16_rn(__fadd_rn(lo_f(mine[j]), lo_f(p))));
      v[2 * j + 1] = __bfloat162float(__float2bfloat16_rn(__fadd_rn(hi_f(mine[j]), hi_f(p))));
      ss = __fadd_rn(ss, __fmul_rn(v[2 * j], v[2 * j]));
      ss = __fadd_rn(ss, __fmul_rn(v[2 * j + 1], v[2 * j + 1]));
    }
    for (int k = 1; k < 32; k <<= 1) ss += __shfl_xor_sync(0xFFFFFFFFu, ss, k);
    if (lane == 0) stash[tid / 32] = ss;
    __syncthreads();
    float total = 0.f;
    for (int w = 0; w < kThreads / 32; ++w) total += stash[w];
    float rstd = (F & kQuant) ? rsqrtf(__fadd_rn(__fdiv_rn(total, 3584.f), 1e-5f)) : rsqrtf(total / 3584.f + 1e-5f);
    unsigned normed[8];
    for (int j = 0; j < 8; ++j) {
      __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * j] * rstd * lo_f(gam[j]), v[2 * j + 1] * rstd * hi_f(gam[j]));
      normed[j] = *reinterpret_cast<unsigned*>(&h);
    }
    me.result[2 * tid] = make_uint4(normed[0], normed[1], normed[2], normed[3]);
    me.result[2 * tid + 1] = make_uint4(normed[4], normed[5], normed[6], normed[7]);
  }
  if (F & (kGuard | kArriveOnly)) {
    if (tid == 0 && old == gridDim.x - 1) store_relaxed_sys(ctrl + kEpochD, epoch);
  } else if (cta == 0 && tid == 0) {
    store_relaxed_sys(ctrl + kEpochD, epoch);
  }
}

template <int F>
static double data_skeleton_us(DataSide side[2], int grid, int layers, int replays, unsigned* error) {
  for (int d = 0; d < 2; ++d) {
    // The ready line starts at the last completed layer (a variant without kReady leaves it behind).
    CHECK(cudaSetDevice(d));
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(side[d].ctrl + kReadyLine, side[d].ctrl + kEpochD, 4, cudaMemcpyDeviceToDevice));
    CHECK(cudaDeviceSynchronize());
  }
  double us = graph_us(layers, replays, [&](int d, cudaStream_t stream, int n) {
    for (int l = 0; l < n; ++l) {
      launch(data_dispatch<F>, grid, stream, true, side[d], side[1 - d], d);
      launch(data_combine<F>, grid, stream, true, side[d], side[1 - d], d);
    }
  });
  *error = 0;
  for (int d = 0; d < 2; ++d) {
    CHECK(cudaSetDevice(d));
    unsigned e = 0;
    CHECK(cudaMemcpy(&e, side[d].ctrl + kError, 4, cudaMemcpyDeviceToHost));
    *error |= e;
  }
  return us;
}

// Checks the last layer's outputs of the data skeleton on the host: every GPU's normed row matches a host
// computation (within 2 %: the host sums in another order), and without kQuant its copied-out row is the peer's
// packed token (the peer's rows come after its own: row (1 - d) * rows).
static bool data_skeleton_ok(DataSide side[2], const std::vector<unsigned short> inputs[2][3], int features) {
  auto f = [](unsigned short h) { unsigned u = unsigned(h) << 16; float r; std::memcpy(&r, &u, 4); return r; };
  const int rows = (features & kRows) ? kRows8 : 1;
  bool ok = true;
  for (int d = 0; d < 2; ++d) {
    CHECK(cudaSetDevice(d));
    std::vector<unsigned char> recv(3696);
    std::vector<unsigned short> result(3584);
    CHECK(cudaMemcpy(recv.data(), side[d].recv + (1 - d) * rows * 924, 3696, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(result.data(), side[d].result, 7168, cudaMemcpyDeviceToHost));
    const std::vector<unsigned short>& px = inputs[1 - d][0];
    if (!(features & kQuant))
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

template <int F>
static void data_skeleton_row(DataSide side[2], const std::vector<unsigned short> inputs[2][3], FILE* csv) {
  unsigned error = 0;
  double us = data_skeleton_us<F>(side, 16, 50, 30, &error);
  bool ok = error == 0 && data_skeleton_ok(side, inputs, F);
  std::printf("data_skeleton_layer_us T=1 grid=16 features=%s%s%s%s%s%s%s%s%s%s%s %.3f (%s)\n", F ? "" : "bare",
              F & kQuant ? "+quant" : "", F & kRoute ? "+route" : "", F & kGuard ? "+guard" : "",
              F & kReady ? "+ready" : "", F & kRows ? "+rows" : "", F & kTimer ? "+timer" : "", F & kTable ? "+table" : "",
              F & kNoBarrier ? "-barrier" : "", F & kArriveOnly ? "+arrive" : "",
              F & kReadyRelaxed ? "+ready_relaxed" : "", us, ok ? "outputs checked" : "OUTPUTS WRONG");
  if (csv) std::fprintf(csv, "data_skeleton_layer_us_t1_g16_f%d%s,0,%.4f\n", F, ok ? "" : "_WRONG", us);
}

// The skeleton layer's time (`graph_us`): `stages` kernels per layer (see `exchange`), with or without programmatic
// launch.
static double skeleton_us(unsigned* lines[2], int stages, bool pdl, int grid, int layers, int replays) {
  return graph_us(layers, replays, [&](int d, cudaStream_t stream, int n) {
    unsigned* own = lines[d];
    unsigned* peer = lines[1 - d];
    // Words (4 bytes) at 128-byte lines: 0 the dispatch flag, 32 the combine flag, 64 the completed layer.
    for (int l = 0; l < n; ++l) {
      launch(exchange, grid, stream, pdl, peer, own, own + 64, 0);
      if (stages == 3) launch(idle, grid, stream, pdl);
      launch(exchange, grid, stream, pdl, peer + 32, own + 32, own + 64, 1);
    }
  });
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

  // Both directions at once (each GPU storing into the other's memory, as both ranks do in a layer): GB/s of each
  // direction, the slower of the two; CSV rows `peer_store_bidir_GBps` (not part of the floor, which the issue
  // defines with the one-way figure above).
  {
    uint4* bufs[2] = {local_buf, peer_buf};  // bufs[d] lives on GPU d
    const size_t bidir_sizes[] = {size_t(1) << 20, size_t(2) << 20, size_t(256) << 20};
    for (size_t bytes : bidir_sizes) {
      size_t words = bytes / 16;
      int blocks = (int)std::min<size_t>((words + 255) / 256, (size_t)prop.multiProcessorCount * 8);
      int reps = bytes >= (size_t(256) << 20) ? 5 : 50;
      cudaEvent_t ev[2][2];
      for (int d = 0; d < 2; ++d) {
        CHECK(cudaSetDevice(d));
        CHECK(cudaEventCreate(&ev[d][0]));
        CHECK(cudaEventCreate(&ev[d][1]));
        store16<<<blocks, 256>>>(bufs[1 - d], words, 1);  // warm up
        CHECK(cudaGetLastError());
        CHECK(cudaDeviceSynchronize());
      }
      std::vector<double> gbps;
      for (int r = 0; r < 9; ++r) {
        for (int d = 0; d < 2; ++d) {
          CHECK(cudaSetDevice(d));
          CHECK(cudaEventRecord(ev[d][0]));
          for (int k = 0; k < reps; ++k) store16<<<blocks, 256>>>(bufs[1 - d], words, r + k);
          CHECK(cudaEventRecord(ev[d][1]));
        }
        double slowest = 1e30;
        for (int d = 0; d < 2; ++d) {
          CHECK(cudaSetDevice(d));
          CHECK(cudaEventSynchronize(ev[d][1]));
          float ms = 0;
          CHECK(cudaEventElapsedTime(&ms, ev[d][0], ev[d][1]));
          slowest = std::min(slowest, double(bytes) * reps / (ms * 1e-3) / 1e9);
        }
        gbps.push_back(slowest);
      }
      double bw = median(gbps);
      std::printf("peer_store_bidir_GBps bytes=%zu %.1f\n", bytes, bw);
      if (csv) std::fprintf(csv, "peer_store_bidir_GBps,%zu,%.2f\n", bytes, bw);
    }
    CHECK(cudaSetDevice(0));
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

  // The data skeleton of a T = 1 layer (see `data_dispatch`), grids of 16 as the real kernels' at T = 1: bare, each
  // feature alone, every feature, and every feature but one.
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
      // Token 0's 16 experts: 8 on each rank (448 experts per rank), so it goes to both.
      std::vector<unsigned> ids(kTopk), weights(kTopk);
      for (int k = 0; k < kTopk; ++k) {
        ids[k] = (k % 2) * 448 + 17 * k + d;
        float w = 1.0f / (k + 1);
        std::memcpy(&weights[k], &w, 4);
      }
      DataSide& s = side[d];
      CHECK(cudaMalloc(&s.x, 7168));
      CHECK(cudaMalloc(&s.out, 7168));
      CHECK(cudaMalloc(&s.gamma, 7168));
      CHECK(cudaMemcpy(s.x, inputs[d][0].data(), 7168, cudaMemcpyHostToDevice));
      CHECK(cudaMemcpy(s.out, inputs[d][1].data(), 7168, cudaMemcpyHostToDevice));
      CHECK(cudaMemcpy(s.gamma, inputs[d][2].data(), 7168, cudaMemcpyHostToDevice));
      CHECK(cudaMalloc(&s.ids, 4 * kTopk));
      CHECK(cudaMalloc(&s.weights, 4 * kTopk));
      CHECK(cudaMemcpy(s.ids, ids.data(), 4 * kTopk, cudaMemcpyHostToDevice));
      CHECK(cudaMemcpy(s.weights, weights.data(), 4 * kTopk, cudaMemcpyHostToDevice));
      CHECK(cudaMalloc(&s.result, 7168));
      CHECK(cudaMalloc(&s.peer_mem, kPeerMemBytes));
      CHECK(cudaMemset(s.peer_mem, 0, kPeerMemBytes));
      CHECK(cudaMalloc(&s.recv, 2 * kRows8 * 924 * 4));
      CHECK(cudaMalloc(&s.recv_ids, 2 * kRows8 * kTopk * 4));
      CHECK(cudaMalloc(&s.recv_weights, 2 * kRows8 * kTopk * 4));
      CHECK(cudaMalloc(&s.recv_src, 2 * kRows8 * 4));
      CHECK(cudaMalloc(&s.mirror, 2 * kRows8 * 4));
      CHECK(cudaMalloc(&s.ctrl, 4 * 256));
      CHECK(cudaMalloc(&s.table, 16));
      CHECK(cudaMemset(s.ctrl, 0, 4 * 256));
      CHECK(cudaDeviceSynchronize());
    }
    for (int d = 0; d < 2; ++d) {
      unsigned long long bases[2] = {(unsigned long long)side[0].peer_mem, (unsigned long long)side[1].peer_mem};
      CHECK(cudaSetDevice(d));
      CHECK(cudaMemcpy(side[d].table, bases, 16, cudaMemcpyHostToDevice));
    }
    // Every variant continues the same epochs: the control words persist, so the ladder runs in one sequence.
    data_skeleton_row<0>(side, inputs, csv);
    data_skeleton_row<kQuant>(side, inputs, csv);
    data_skeleton_row<kRoute>(side, inputs, csv);
    data_skeleton_row<kGuard>(side, inputs, csv);
    data_skeleton_row<kReady>(side, inputs, csv);
    data_skeleton_row<kRows>(side, inputs, csv);
    data_skeleton_row<31>(side, inputs, csv);
    data_skeleton_row<31 - kQuant>(side, inputs, csv);
    data_skeleton_row<31 - kRoute>(side, inputs, csv);
    data_skeleton_row<31 - kGuard>(side, inputs, csv);
    data_skeleton_row<31 - kReady>(side, inputs, csv);
    data_skeleton_row<31 - kRows>(side, inputs, csv);
    for (int again = 0; again < 2; ++again) {
      data_skeleton_row<31 | kTimer>(side, inputs, csv);
      data_skeleton_row<31 | kTable>(side, inputs, csv);
      data_skeleton_row<31 - kGuard + kArriveOnly>(side, inputs, csv);
      data_skeleton_row<31 | kReadyRelaxed>(side, inputs, csv);
      data_skeleton_row<31 | kNoBarrier>(side, inputs, csv);
      data_skeleton_row<31>(side, inputs, csv);
    }
    data_skeleton_row<0>(side, inputs, csv);
  }
  if (csv) std::fclose(csv);
  return 0;
}
