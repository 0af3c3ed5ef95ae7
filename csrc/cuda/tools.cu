// Kernels of the cuda device's own (not shaders: nothing here runs on a Mac). They give the
// timing tools their references (docs/gpu.md, "Timing"): an empty kernel for the cost of a graph
// of the same levels, and a read-only streaming kernel for the bandwidth a kernel touching the
// same bytes could reach. Compiled by nvrtc_build.py into tools.cubin.
extern "C" __global__ void lily_cuda_empty() {}

// Reads n16 16-byte words, four loads in flight per thread; writes one word only when the XOR of
// everything read equals `never` (it does not for the data used), so the loads are not elided.
extern "C" __global__ void lily_cuda_stream_read(const uint4* p, unsigned long long n16, unsigned int never,
                                                 unsigned int* sink) {
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  unsigned int acc = 0;
  for (; i + 3 * stride < n16; i += 4 * stride) {
    const uint4 a = p[i], b = p[i + stride], c = p[i + 2 * stride], d = p[i + 3 * stride];
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < n16; i += stride) {
    const uint4 a = p[i];
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == never) sink[0] = acc;
}
