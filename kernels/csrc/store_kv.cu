// store_kv: copy each new token's K and V row into its slot of a paged, page-first KV cache.
//
// k, v:       [T, H, D], rows may be strided (they are views of the fused qkv output),
//             each row's H*D elements contiguous.
// caches:     [num_pages, page_size, H, D] layer views; the page stride is arbitrary
//             (page-first layout), the slot stride is H*D.
// loc:        [T] int32 or int64 slot ids, slot = page * page_size + offset.
// One warp copies one token's K and V rows with the widest aligned vector type.
#include <cuda_runtime.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>

#include <cstdint>

namespace {

using tvm::ffi::TensorView;

struct Geometry {
  int64_t num_tokens, k_row_stride, v_row_stride;  // bytes
  int64_t page_stride, slot_stride, page_size;     // bytes, bytes, slots
  int64_t vecs_per_row;
};

template <typename Vec, typename Idx>
__global__ void store_kv_kernel(const char* __restrict__ k, const char* __restrict__ v,
                                char* __restrict__ k_cache, char* __restrict__ v_cache,
                                const Idx* __restrict__ loc, Geometry g) {
  const int64_t token = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (token >= g.num_tokens) return;
  const int64_t slot = static_cast<int64_t>(loc[token]);
  const int64_t dst = (slot / g.page_size) * g.page_stride + (slot % g.page_size) * g.slot_stride;
  const Vec* ks = reinterpret_cast<const Vec*>(k + token * g.k_row_stride);
  const Vec* vs = reinterpret_cast<const Vec*>(v + token * g.v_row_stride);
  Vec* kd = reinterpret_cast<Vec*>(k_cache + dst);
  Vec* vd = reinterpret_cast<Vec*>(v_cache + dst);
  for (int64_t i = lane; i < g.vecs_per_row; i += 32) {
    kd[i] = ks[i];
    vd[i] = vs[i];
  }
}

char* base(const TensorView& t) { return static_cast<char*>(t.data_ptr()) + t.byte_offset(); }

template <typename Idx>
void launch(const TensorView& k_cache, const TensorView& v_cache, const TensorView& k,
            const TensorView& v, const TensorView& loc, Geometry g, int64_t row_bytes,
            cudaStream_t stream) {
  const int threads = 256;
  const int64_t blocks = (g.num_tokens * 32 + threads - 1) / threads;
  if (blocks == 0) return;
  // The widest vector that divides every row start and length.
  uintptr_t align = row_bytes | g.k_row_stride | g.v_row_stride | g.page_stride | g.slot_stride |
                    reinterpret_cast<uintptr_t>(base(k)) | reinterpret_cast<uintptr_t>(base(v)) |
                    reinterpret_cast<uintptr_t>(base(k_cache)) |
                    reinterpret_cast<uintptr_t>(base(v_cache));
  const Idx* idx = reinterpret_cast<const Idx*>(base(loc));
#define MINISGL_LAUNCH(VEC)                                                                    \
  g.vecs_per_row = row_bytes / sizeof(VEC);                                                    \
  store_kv_kernel<VEC, Idx><<<blocks, threads, 0, stream>>>(base(k), base(v), base(k_cache),   \
                                                            base(v_cache), idx, g);
  if (align % 16 == 0) {
    MINISGL_LAUNCH(uint4)
  } else if (align % 8 == 0) {
    MINISGL_LAUNCH(uint2)
  } else if (align % 4 == 0) {
    MINISGL_LAUNCH(uint32_t)
  } else {
    MINISGL_LAUNCH(uint16_t)
  }
#undef MINISGL_LAUNCH
  cudaError_t err = cudaGetLastError();
  TVM_FFI_CHECK(err == cudaSuccess, RuntimeError) << "store_kv launch failed: " << cudaGetErrorString(err);
}

void store_kv(TensorView k_cache, TensorView v_cache, TensorView k, TensorView v, TensorView loc,
              int64_t stream) {
  TVM_FFI_CHECK(k_cache.ndim() == 4 && v_cache.ndim() == 4, ValueError)
      << "caches must be [pages, page_size, heads, head_dim]";
  TVM_FFI_CHECK(k.ndim() == 3 && v.ndim() == 3, ValueError) << "k and v must be [tokens, heads, head_dim]";
  TVM_FFI_CHECK(loc.ndim() == 1 && loc.size(0) == k.size(0) && v.size(0) == k.size(0), ValueError)
      << "loc, k and v must have one row per token";
  TVM_FFI_CHECK(loc.size(0) == 0 || loc.stride(0) == 1, ValueError) << "loc must be contiguous";
  TVM_FFI_CHECK(k.dtype() == k_cache.dtype() && v.dtype() == k_cache.dtype() &&
                    v_cache.dtype() == k_cache.dtype(),
                ValueError)
      << "k, v and the caches must share one dtype";
  for (int d = 0; d < 4; ++d) {
    TVM_FFI_CHECK(k_cache.size(d) == v_cache.size(d) && k_cache.stride(d) == v_cache.stride(d), ValueError)
        << "k and v caches must have the same shape and strides";
  }
  const int64_t heads = k_cache.size(2), head_dim = k_cache.size(3);
  TVM_FFI_CHECK(k.size(1) == heads && k.size(2) == head_dim && v.size(1) == heads && v.size(2) == head_dim,
                ValueError)
      << "k/v head layout does not match the cache";
  TVM_FFI_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == head_dim && k_cache.stride(1) == heads * head_dim,
                ValueError)
      << "each cache slot must hold heads*head_dim contiguous elements";
  TVM_FFI_CHECK(k.stride(2) == 1 && k.stride(1) == head_dim && v.stride(2) == 1 && v.stride(1) == head_dim,
                ValueError)
      << "each k/v row must be contiguous";
  const int64_t elem = (k.dtype().bits * k.dtype().lanes + 7) / 8;
  Geometry g{};
  g.num_tokens = k.size(0);
  g.k_row_stride = k.stride(0) * elem;
  g.v_row_stride = v.stride(0) * elem;
  g.page_stride = k_cache.stride(0) * elem;
  g.slot_stride = k_cache.stride(1) * elem;
  g.page_size = k_cache.size(1);
  const int64_t row_bytes = heads * head_dim * elem;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  DLDataType it = loc.dtype();
  TVM_FFI_CHECK(it.code == kDLInt && (it.bits == 32 || it.bits == 64), ValueError) << "loc must be int32 or int64";
  if (it.bits == 32) {
    launch<int32_t>(k_cache, v_cache, k, v, loc, g, row_bytes, s);
  } else {
    launch<int64_t>(k_cache, v_cache, k, v, loc, g, row_bytes, s);
  }
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(store_kv, store_kv);
