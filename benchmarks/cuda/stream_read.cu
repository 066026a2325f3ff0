// A plain streaming read, the weight-read floor of a kernel launch: every thread reads UNROLL 16-byte
// vectors per iteration (ld.global.nc, no L1 allocation), grid-stride over n16 vectors, XORs them into
// one word it stores. Timed by benchmarks/bench_cuda_decode.py --stream against an NVFP4 weight's bytes.
// The grid-stride tail reads one word per leftover vector (timing only: the result is not a checksum).
typedef unsigned int u32;
struct __align__(16) u32x4 { u32 x, y, z, w; };
__device__ __forceinline__ u32x4 ldg_stream(const void* p) {
  u32x4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
extern "C" __global__ void stream_read(const u32x4* src, int n16_, u32* out) {
  const long long n16 = n16_;
  u32 acc = 0;
  long long i = (long long)blockIdx.x * blockDim.x * UNROLL + threadIdx.x;
  const long long stride = (long long)gridDim.x * blockDim.x * UNROLL;
  for (; i + (UNROLL - 1) * (long long)blockDim.x < n16; i += stride) {
    u32x4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) v[u] = ldg_stream(src + i + u * blockDim.x);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n16; i += blockDim.x) acc ^= ldg_stream(src + i).x;  // tail (not exact coverage; timing only)
  out[(size_t)blockIdx.x * blockDim.x + threadIdx.x] = acc;
}
