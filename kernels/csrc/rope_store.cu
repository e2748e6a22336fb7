// rope_store: one pass over a layer's fused qkv projection output, between the qkv GEMM and
// attention. Per (token, head):
//   q heads: optional per-head RMSNorm (Qwen3's q_norm), rotary  -> q_out [T, Hq, D]
//   k heads: optional per-head RMSNorm (k_norm), rotary          -> the token's K cache slot
//   v heads: copied                                               -> the token's V cache slot
// An fp8 (e4m3) cache stores K * inv_k_scale and V * inv_v_scale, saturated to +-448.
// It replaces the norm, rotary, contiguous-copy and store launches of each layer with one.
//
// qkv:        [T, (Hq + 2 Hk) * D], rows may be strided, each row contiguous.
// caches:     [num_pages, page_size, Hk, D] layer views with any page stride (page-first layout).
// positions:  [T] int64; loc: [T] int64 slot ids, slot = page * page_size + offset.
// cos_sin:    [max_pos, D] float32, cos of the D/2 frequencies then their sin (rotate-half).
// A warp per token and two heads; lane l holds elements [l*E, (l+1)*E) of a head with E = D/32,
// so the rotate-half partner of lane l is lane l ^ 16.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>

#include <cstdint>

namespace {

using tvm::ffi::TensorView;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __nv_fp8_e4m3 from_float<__nv_fp8_e4m3>(float x) { return __nv_fp8_e4m3(x); }  // satfinite

template <typename T, int E>
struct alignas(sizeof(T) * E) Pack {
  T v[E];
};

struct Geometry {
  int64_t num_tokens, qkv_stride;           // tokens, elements between qkv rows
  int64_t page_stride, slot_stride, page_size;  // elements, elements, slots
  int num_q_heads, num_kv_heads;
  float eps, inv_k_scale, inv_v_scale;
};

// Heads per warp. Two, their loads in flight together, against one (H100, bf16 qkv, fp8 cache, us):
// 8B heads 256 tokens 3.96 -> 3.86, 1024 tokens 10.5 -> 9.3, 8192 97.9 -> 85.2; Qwen3-0.6B heads
// 256 tokens 3.28 -> 2.88 (benchmarks/results/rope_store_heads_per_warp_h100.json).
constexpr int kHeadsPerWarp = 2;

// One head of one token: q normed (optional), rotated, written to q_out; k the same into the
// cache; v copied into the cache.
template <typename T, typename C, int E>
__device__ __forceinline__ void rope_store_head(const Pack<T, E>& in, int64_t token, int head, int lane,
                                                T* __restrict__ q_out, C* __restrict__ k_cache,
                                                C* __restrict__ v_cache, const float* __restrict__ cs,
                                                int64_t slot, const T* __restrict__ q_weight,
                                                const T* __restrict__ k_weight, const Geometry& g) {
  constexpr int D = 32 * E;
  const bool is_q = head < g.num_q_heads;
  const bool is_v = head >= g.num_q_heads + g.num_kv_heads;
  float x[E];
#pragma unroll
  for (int i = 0; i < E; ++i) x[i] = to_float(in.v[i]);
  if (!is_v) {
    const T* weight = is_q ? q_weight : k_weight;
    if (weight != nullptr) {
      // Like the reference: normalize in float, round to T, then scale by the weight.
      float sq = 0.f;
#pragma unroll
      for (int i = 0; i < E; ++i) sq += x[i] * x[i];
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) sq += __shfl_xor_sync(0xffffffff, sq, offset);
      const float scale = rsqrtf(sq / D + g.eps);
#pragma unroll
      for (int i = 0; i < E; ++i) {
        x[i] = to_float(from_float<T>(x[i] * scale)) * to_float(weight[lane * E + i]);
      }
    }
    const int freq = (lane % 16) * E;
#pragma unroll
    for (int i = 0; i < E; ++i) {
      const float other = __shfl_xor_sync(0xffffffff, x[i], 16);
      const float c = cs[freq + i], s = cs[D / 2 + freq + i];
      // First half: x1 cos - x2 sin; second half: x2 cos + x1 sin. Rounded to T as q is.
      x[i] = to_float(from_float<T>(lane < 16 ? x[i] * c - other * s : x[i] * c + other * s));
    }
  }
  if (is_q) {
    Pack<T, E> out;
#pragma unroll
    for (int i = 0; i < E; ++i) out.v[i] = from_float<T>(x[i]);
    *reinterpret_cast<Pack<T, E>*>(q_out + (token * g.num_q_heads + head) * D + lane * E) = out;
    return;
  }
  const int kv_head = head - g.num_q_heads - (is_v ? g.num_kv_heads : 0);
  C* dst = (is_v ? v_cache : k_cache) + (slot / g.page_size) * g.page_stride + (slot % g.page_size) * g.slot_stride +
           kv_head * D;
  const float inv = is_v ? g.inv_v_scale : g.inv_k_scale;
  Pack<C, E> out;
#pragma unroll
  for (int i = 0; i < E; ++i) out.v[i] = from_float<C>(x[i] * inv);
  *reinterpret_cast<Pack<C, E>*>(dst + lane * E) = out;
}

// T: the activations' type; C: the cache's (T, or fp8). One warp per token and kHeadsPerWarp
// consecutive heads, whose inputs it loads before working on either.
template <typename T, typename C, int E>
__global__ void rope_store_kernel(const T* __restrict__ qkv, T* __restrict__ q_out, C* __restrict__ k_cache,
                                  C* __restrict__ v_cache, const int64_t* __restrict__ positions,
                                  const int64_t* __restrict__ loc, const float* __restrict__ cos_sin,
                                  const T* __restrict__ q_weight, const T* __restrict__ k_weight, Geometry g) {
  constexpr int D = 32 * E;
  const int heads = g.num_q_heads + 2 * g.num_kv_heads;
  const int groups = (heads + kHeadsPerWarp - 1) / kHeadsPerWarp;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= g.num_tokens * groups) return;
  const int64_t token = warp / groups;
  const int first = static_cast<int>(warp % groups) * kHeadsPerWarp;
  Pack<T, E> in[kHeadsPerWarp];
#pragma unroll
  for (int h = 0; h < kHeadsPerWarp; ++h) {
    if (first + h < heads) {
      in[h] = *reinterpret_cast<const Pack<T, E>*>(qkv + token * g.qkv_stride + (first + h) * D + lane * E);
    }
  }
  const float* cs = cos_sin + positions[token] * D;
  const int64_t slot = first + kHeadsPerWarp > g.num_q_heads ? loc[token] : 0;  // q heads need no slot
#pragma unroll
  for (int h = 0; h < kHeadsPerWarp; ++h) {
    if (first + h < heads) {
      rope_store_head<T, C, E>(in[h], token, first + h, lane, q_out, k_cache, v_cache, cs, slot, q_weight, k_weight, g);
    }
  }
}

template <typename T>
T* ptr(const TensorView& t) {
  return reinterpret_cast<T*>(static_cast<char*>(t.data_ptr()) + t.byte_offset());
}

template <typename T, typename C, int E>
void launch(const TensorView& qkv, const TensorView& q_out, const TensorView& k_cache, const TensorView& v_cache,
            const TensorView& positions, const TensorView& loc, const TensorView& cos_sin,
            const T* q_weight, const T* k_weight, const Geometry& g, cudaStream_t stream) {
  const int groups = (g.num_q_heads + 2 * g.num_kv_heads + kHeadsPerWarp - 1) / kHeadsPerWarp;
  const int threads = 256;
  const int64_t blocks = (g.num_tokens * groups * 32 + threads - 1) / threads;
  if (blocks == 0) return;
  constexpr uintptr_t align = sizeof(Pack<T, E>), cache_align = sizeof(Pack<C, E>);
  const uintptr_t bits = reinterpret_cast<uintptr_t>(ptr<T>(qkv)) | reinterpret_cast<uintptr_t>(ptr<T>(q_out)) |
                         static_cast<uintptr_t>(g.qkv_stride * sizeof(T));
  const uintptr_t cache_bits = reinterpret_cast<uintptr_t>(ptr<C>(k_cache)) | reinterpret_cast<uintptr_t>(ptr<C>(v_cache));
  TVM_FFI_CHECK(bits % align == 0 && cache_bits % cache_align == 0, ValueError)
      << "rope_store needs " << align << "-byte aligned rows";
  rope_store_kernel<T, C, E><<<blocks, threads, 0, stream>>>(
      ptr<T>(qkv), ptr<T>(q_out), ptr<C>(k_cache), ptr<C>(v_cache), ptr<int64_t>(positions), ptr<int64_t>(loc),
      ptr<float>(cos_sin), q_weight, k_weight, g);
  cudaError_t err = cudaGetLastError();
  TVM_FFI_CHECK(err == cudaSuccess, RuntimeError) << "rope_store launch failed: " << cudaGetErrorString(err);
}

template <typename T, typename C>
void dispatch(const TensorView& qkv, const TensorView& q_out, const TensorView& k_cache, const TensorView& v_cache,
              const TensorView& positions, const TensorView& loc, const TensorView& cos_sin,
              const TensorView& q_weight, const TensorView& k_weight, Geometry g, int64_t head_dim,
              cudaStream_t stream) {
  const bool norm = q_weight.numel() > 0;
  const T* qw = norm ? ptr<T>(q_weight) : nullptr;
  const T* kw = norm ? ptr<T>(k_weight) : nullptr;
  switch (head_dim) {
    case 32: return launch<T, C, 1>(qkv, q_out, k_cache, v_cache, positions, loc, cos_sin, qw, kw, g, stream);
    case 64: return launch<T, C, 2>(qkv, q_out, k_cache, v_cache, positions, loc, cos_sin, qw, kw, g, stream);
    case 128: return launch<T, C, 4>(qkv, q_out, k_cache, v_cache, positions, loc, cos_sin, qw, kw, g, stream);
    case 256: return launch<T, C, 8>(qkv, q_out, k_cache, v_cache, positions, loc, cos_sin, qw, kw, g, stream);
    default: TVM_FFI_THROW(ValueError) << "rope_store supports head_dim 32, 64, 128 or 256, got " << head_dim;
  }
}

bool is_dtype(const TensorView& t, int code, int bits) {
  return t.dtype().code == code && t.dtype().bits == bits && t.dtype().lanes == 1;
}

bool same_dtype(const TensorView& a, const TensorView& b) { return is_dtype(a, b.dtype().code, b.dtype().bits); }

// q_weight/k_weight: [D] norm weights, or empty tensors for models without q/k norm.
void rope_store(TensorView qkv, TensorView q_out, TensorView k_cache, TensorView v_cache, TensorView positions,
                TensorView loc, TensorView cos_sin, TensorView q_weight, TensorView k_weight, double eps,
                double inv_k_scale, double inv_v_scale, int64_t stream) {
  TVM_FFI_CHECK(k_cache.ndim() == 4 && v_cache.ndim() == 4, ValueError)
      << "caches must be [pages, page_size, heads, head_dim]";
  const int64_t hk = k_cache.size(2), d = k_cache.size(3);
  TVM_FFI_CHECK(q_out.ndim() == 3 && q_out.size(2) == d && q_out.stride(2) == 1 && q_out.stride(1) == d &&
                    q_out.stride(0) == q_out.size(1) * d,
                ValueError)
      << "q_out must be a contiguous [tokens, q_heads, head_dim]";
  const int64_t hq = q_out.size(1), t = q_out.size(0);
  TVM_FFI_CHECK(qkv.ndim() == 2 && qkv.size(0) == t && qkv.size(1) == (hq + 2 * hk) * d && qkv.stride(1) == 1,
                ValueError)
      << "qkv must be [tokens, (q_heads + 2 kv_heads) * head_dim] with contiguous rows";
  for (int i = 0; i < 4; ++i) {
    TVM_FFI_CHECK(k_cache.size(i) == v_cache.size(i) && k_cache.stride(i) == v_cache.stride(i), ValueError)
        << "k and v caches must have the same shape and strides";
  }
  TVM_FFI_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == d, ValueError) << "cache heads must be contiguous";
  const bool fp8_cache = is_dtype(k_cache, kDLFloat8_e4m3fn, 8) && is_dtype(v_cache, kDLFloat8_e4m3fn, 8);
  TVM_FFI_CHECK(same_dtype(qkv, q_out) && (fp8_cache || (same_dtype(qkv, k_cache) && same_dtype(qkv, v_cache))),
                ValueError)
      << "qkv, q_out and the caches must share one dtype (or the caches be float8_e4m3fn)";
  TVM_FFI_CHECK(positions.ndim() == 1 && loc.ndim() == 1 && positions.size(0) == t && loc.size(0) == t, ValueError)
      << "positions and loc must have one entry per token";
  TVM_FFI_CHECK(t == 0 || (positions.stride(0) == 1 && loc.stride(0) == 1), ValueError)
      << "positions and loc must be contiguous";
  TVM_FFI_CHECK(is_dtype(positions, kDLInt, 64) && is_dtype(loc, kDLInt, 64), ValueError) << "positions and loc must be int64";
  TVM_FFI_CHECK(cos_sin.ndim() == 2 && cos_sin.size(1) == d && cos_sin.stride(1) == 1 && cos_sin.stride(0) == d &&
                    is_dtype(cos_sin, kDLFloat, 32),
                ValueError)
      << "cos_sin must be a contiguous float32 [max_positions, head_dim]";
  if (q_weight.numel() > 0) {
    TVM_FFI_CHECK(q_weight.numel() == d && k_weight.numel() == d && same_dtype(q_weight, qkv) &&
                      same_dtype(k_weight, qkv),
                  ValueError)
        << "q/k norm weights must be [head_dim] in the qkv dtype";
  }
  Geometry g{};
  g.num_tokens = t;
  g.qkv_stride = qkv.stride(0);
  g.page_stride = k_cache.stride(0);
  g.slot_stride = k_cache.stride(1);
  g.page_size = k_cache.size(1);
  g.num_q_heads = static_cast<int>(hq);
  g.num_kv_heads = static_cast<int>(hk);
  g.eps = static_cast<float>(eps);
  g.inv_k_scale = static_cast<float>(inv_k_scale);
  g.inv_v_scale = static_cast<float>(inv_v_scale);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  if (is_dtype(qkv, kDLBfloat, 16)) {
    if (fp8_cache) return dispatch<__nv_bfloat16, __nv_fp8_e4m3>(qkv, q_out, k_cache, v_cache, positions, loc, cos_sin, q_weight, k_weight, g, d, s);
    dispatch<__nv_bfloat16, __nv_bfloat16>(qkv, q_out, k_cache, v_cache, positions, loc, cos_sin, q_weight, k_weight, g, d, s);
  } else if (is_dtype(qkv, kDLFloat, 16)) {
    if (fp8_cache) return dispatch<__half, __nv_fp8_e4m3>(qkv, q_out, k_cache, v_cache, positions, loc, cos_sin, q_weight, k_weight, g, d, s);
    dispatch<__half, __half>(qkv, q_out, k_cache, v_cache, positions, loc, cos_sin, q_weight, k_weight, g, d, s);
  } else if (is_dtype(qkv, kDLFloat, 32)) {
    if (fp8_cache) return dispatch<float, __nv_fp8_e4m3>(qkv, q_out, k_cache, v_cache, positions, loc, cos_sin, q_weight, k_weight, g, d, s);
    dispatch<float, float>(qkv, q_out, k_cache, v_cache, positions, loc, cos_sin, q_weight, k_weight, g, d, s);
  } else {
    TVM_FFI_THROW(ValueError) << "rope_store supports float32, float16 and bfloat16";
  }
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(rope_store, rope_store);
