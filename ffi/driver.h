// The CUDA driver API subset the handlers use, without a CUDA toolkit: ABI-compatible declarations from cuda.h
// (CUDA 12.x and 13.x agree on these), resolved from libcuda.so.1 with dlopen at run time.
#pragma once

#include <cstddef>
#include <string>

extern "C" {
typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st* CUcontext;
typedef struct CUmod_st* CUmodule;
typedef struct CUfunc_st* CUfunction;
typedef struct CUstream_st* CUstream;
typedef CUstream cudaStream_t;  // the runtime's cudaStream_t is the same `struct CUstream_st*`

typedef union CUlaunchAttributeValue_union {
  char pad[64];
  int programmaticStreamSerializationAllowed;
} CUlaunchAttributeValue;

typedef struct CUlaunchAttribute_st {
  int id;  // CUlaunchAttributeID (an enum: 4 bytes)
  char pad[8 - sizeof(int)];
  CUlaunchAttributeValue value;
} CUlaunchAttribute;

typedef struct CUlaunchConfig_st {
  unsigned int gridDimX, gridDimY, gridDimZ;
  unsigned int blockDimX, blockDimY, blockDimZ;
  unsigned int sharedMemBytes;
  CUstream hStream;
  CUlaunchAttribute* attrs;
  unsigned int numAttrs;
} CUlaunchConfig;
}  // extern "C"

static_assert(sizeof(CUlaunchAttributeValue) == 64, "CUlaunchAttributeValue must be 64 bytes");
static_assert(sizeof(CUlaunchAttribute) == 72, "CUlaunchAttribute must be 72 bytes");

namespace jax_latent_ep {

constexpr CUresult kCudaSuccess = 0;
constexpr int kLaunchAttributeProgrammaticStreamSerialization = 6;  // CU_LAUNCH_ATTRIBUTE_...
constexpr int kFuncAttributeMaxDynamicSharedSizeBytes = 8;           // CU_FUNC_ATTRIBUTE_...
constexpr int kDeviceAttributeMultiprocessorCount = 16;              // CU_DEVICE_ATTRIBUTE_...
constexpr unsigned kDefaultMaxSmem = 48 * 1024;                      // above this: opt in per function

// Driver entry points, resolved once from libcuda.so.1.
struct Driver {
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuCtxPushCurrent)(CUcontext);
  CUresult (*cuCtxPopCurrent)(CUcontext*);
  CUresult (*cuCtxGetDevice)(CUdevice*);
  CUresult (*cuModuleLoadData)(CUmodule*, const void*);
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*cuFuncSetAttribute)(CUfunction, int, int);
  CUresult (*cuDeviceGetAttribute)(int*, int, CUdevice);
  CUresult (*cuOccupancyMaxActiveBlocksPerMultiprocessor)(int*, CUfunction, int, size_t);
  CUresult (*cuLaunchKernelEx)(const CUlaunchConfig*, CUfunction, void**, void**);
  CUresult (*cuGetErrorName)(CUresult, const char**);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  std::string error;  // empty once every symbol resolved
};

// The driver, loaded on first use (check `error` before calling through it).
const Driver& driver();

// "NAME (rc): description" of a driver error code.
std::string cu_error(CUresult rc);

}  // namespace jax_latent_ep
