// page_copy: move whole KV pages between the device pool and the host pool of the hierarchical
// cache. The device pool is layer-first ([2, layers, pages, block]); the host pool page-first
// ([pages, layers, 2, block]), so one host page holds every layer's K and V. A block is one
// page of one layer's K (or V): page_size * kv_heads * head_dim elements, a multiple of 16 bytes.
//
// Every address is base + page * page_stride + layer * layer_stride + kv * kv_stride (bytes),
// which describes both layouts. `pairs` holds (source page, destination page) int64 pairs.
//
// copy_pages: a kernel; its threads read and write pinned host memory directly (mapped, so the
//   host pointer is valid on the device), 16 bytes at a time, four loads in flight per thread.
//   A CTA moves one (pair, K or V) block at a time and strides over the launch's blocks: a few
//   CTAs keep the bus busy (a copy is bound by PCIe latency, not by SMs), so the forward it runs
//   beside keeps the other SMs; one CTA per block would fill the GPU and the forward would wait
//   behind the copy. Layers [layer_begin, layer_end) in one launch.
// copy_pages_direct: the DMA engines instead, one cudaMemcpy2DAsync per (pair, K or V) moving
//   that page's block of every layer (rows = layers).
// host_register: page-lock a host buffer for both (mapped), returning its device address.
#include <cuda_runtime.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>

#include <algorithm>
#include <cstdint>

namespace {

using tvm::ffi::TensorView;

struct Strides {
  int64_t page, layer, kv;
};

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

__global__ void copy_pages_kernel(const char* __restrict__ src, char* __restrict__ dst,
                                  const int64_t* __restrict__ pairs, int64_t num_pairs, Strides s, Strides d,
                                  int64_t layer_begin, int64_t block_bytes) {
  const int64_t layer = layer_begin + blockIdx.y;
  const int64_t n = block_bytes / 16;
  for (int64_t item = blockIdx.x; item < 2 * num_pairs; item += gridDim.x) {
    const int64_t pair = item >> 1;
    const int kv = item & 1;
    const int4* from = reinterpret_cast<const int4*>(src + pairs[2 * pair] * s.page + layer * s.layer + kv * s.kv);
    int4* to = reinterpret_cast<int4*>(dst + pairs[2 * pair + 1] * d.page + layer * d.layer + kv * d.kv);
    int64_t i = threadIdx.x;
    for (; i + (kUnroll - 1) * kThreads < n; i += kUnroll * kThreads) {
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = from[i + u * kThreads];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) to[i + u * kThreads] = v[u];
    }
    for (; i < n; i += kThreads) to[i] = from[i];
  }
}

Strides strides(int64_t page, int64_t layer, int64_t kv) { return Strides{page, layer, kv}; }

void copy_pages(int64_t src, int64_t dst, TensorView pairs, int64_t src_page, int64_t src_layer, int64_t src_kv,
                int64_t dst_page, int64_t dst_layer, int64_t dst_kv, int64_t layer_begin, int64_t layer_end,
                int64_t block_bytes, int64_t ctas, int64_t stream) {
  TVM_FFI_CHECK(block_bytes % 16 == 0, ValueError) << "page_copy needs blocks of a multiple of 16 bytes";
  TVM_FFI_CHECK(pairs.ndim() == 1 && pairs.size(0) % 2 == 0 && pairs.dtype().bits == 64, ValueError)
      << "pairs must be a flat int64 tensor of (source, destination) pages";
  const int64_t n = pairs.size(0) / 2;
  if (n == 0 || layer_end <= layer_begin) return;
  TVM_FFI_CHECK(ctas > 0, ValueError) << "page_copy needs at least one CTA";
  dim3 grid(static_cast<unsigned>(std::min(2 * n, ctas)), static_cast<unsigned>(layer_end - layer_begin));
  const int64_t* p = reinterpret_cast<const int64_t*>(static_cast<char*>(pairs.data_ptr()) + pairs.byte_offset());
  copy_pages_kernel<<<grid, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const char*>(src), reinterpret_cast<char*>(dst), p, n, strides(src_page, src_layer, src_kv),
      strides(dst_page, dst_layer, dst_kv), layer_begin, block_bytes);
  cudaError_t err = cudaGetLastError();
  TVM_FFI_CHECK(err == cudaSuccess, RuntimeError) << "page_copy launch failed: " << cudaGetErrorString(err);
}

void copy_pages_direct(int64_t src, int64_t dst, TensorView pairs, int64_t src_page, int64_t src_layer,
                       int64_t src_kv, int64_t dst_page, int64_t dst_layer, int64_t dst_kv, int64_t num_layers,
                       int64_t block_bytes, int64_t stream) {
  TVM_FFI_CHECK(pairs.ndim() == 1 && pairs.size(0) % 2 == 0 && pairs.dtype().bits == 64, ValueError)
      << "pairs must be a flat int64 tensor of (source, destination) pages, in host memory";
  const int64_t* p = reinterpret_cast<const int64_t*>(static_cast<char*>(pairs.data_ptr()) + pairs.byte_offset());
  auto s = reinterpret_cast<cudaStream_t>(stream);
  for (int64_t i = 0; i < pairs.size(0); i += 2) {
    for (int kv = 0; kv < 2; ++kv) {
      const char* from = reinterpret_cast<const char*>(src) + p[i] * src_page + kv * src_kv;
      char* to = reinterpret_cast<char*>(dst) + p[i + 1] * dst_page + kv * dst_kv;
      cudaError_t err = cudaMemcpy2DAsync(to, dst_layer, from, src_layer, block_bytes, num_layers,
                                          cudaMemcpyDefault, s);
      TVM_FFI_CHECK(err == cudaSuccess, RuntimeError) << "page copy failed: " << cudaGetErrorString(err);
    }
  }
}

int64_t host_register(int64_t ptr, int64_t bytes) {
  void* host = reinterpret_cast<void*>(ptr);
  cudaError_t err = cudaHostRegister(host, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
  TVM_FFI_CHECK(err == cudaSuccess, RuntimeError) << "cudaHostRegister failed: " << cudaGetErrorString(err);
  void* device = nullptr;
  err = cudaHostGetDevicePointer(&device, host, 0);
  TVM_FFI_CHECK(err == cudaSuccess, RuntimeError) << "cudaHostGetDevicePointer failed: " << cudaGetErrorString(err);
  return reinterpret_cast<int64_t>(device);
}

void host_unregister(int64_t ptr) { cudaHostUnregister(reinterpret_cast<void*>(ptr)); }

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(copy_pages, copy_pages);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(copy_pages_direct, copy_pages_direct);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(host_register, host_register);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(host_unregister, host_unregister);
