// Prepended to every kernel source of the CUDA backend before NVRTC compiles
// it (NVRTC has no system headers: what the kernels need is defined here).

typedef unsigned int u32;
typedef long long i64;

#define NEG_INF (-__int_as_float(0x7f800000))
// An assignment dropped for capacity (the MoE routing's slot).
#define DROPPED 0xffffffffu
// Threads per block of every kernel that reduces over a block.
#define BLOCK 256

// This thread's index in a 1-D grid, and the grid's size (grid-stride loops).
__device__ __forceinline__ i64 gid() { return (i64)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ i64 gsize() { return (i64)gridDim.x * blockDim.x; }

// The sum over a block of BLOCK threads of one value each, in a fixed tree
// order (the same bits every run); every thread gets it.
__device__ float block_sum(float v) {
    __shared__ float s[BLOCK];
    s[threadIdx.x] = v;
    __syncthreads();
    for (int k = BLOCK / 2; k > 0; k >>= 1) {
        if (threadIdx.x < k) s[threadIdx.x] += s[threadIdx.x + k];
        __syncthreads();
    }
    float r = s[0];
    __syncthreads();
    return r;
}

__device__ double block_sum_f64(double v) {
    __shared__ double s[BLOCK];
    s[threadIdx.x] = v;
    __syncthreads();
    for (int k = BLOCK / 2; k > 0; k >>= 1) {
        if (threadIdx.x < k) s[threadIdx.x] += s[threadIdx.x + k];
        __syncthreads();
    }
    double r = s[0];
    __syncthreads();
    return r;
}

__device__ float block_max(float v) {
    __shared__ float s[BLOCK];
    s[threadIdx.x] = v;
    __syncthreads();
    for (int k = BLOCK / 2; k > 0; k >>= 1) {
        if (threadIdx.x < k) s[threadIdx.x] = fmaxf(s[threadIdx.x], s[threadIdx.x + k]);
        __syncthreads();
    }
    float r = s[0];
    __syncthreads();
    return r;
}

// e^x for |x| <= 20 by range reduction x = k ln2 + r and a degree-6
// polynomial for e^r: the CPU backend's `exp_small`, operation for operation.
__device__ float exp_small(float x) {
    const float LOG2E = 1.44269504088896341f;
    const float LN2_HI = 0.693359375f;
    const float LN2_LO = -2.12194440e-4f;
    const float ROUND = 12582912.0f;
    float k = (x * LOG2E + ROUND) - ROUND;
    float r = x - k * LN2_HI - k * LN2_LO;
    float p = 1.9875691e-4f;
    p = p * r + 1.3981999e-3f;
    p = p * r + 8.333452e-3f;
    p = p * r + 4.1665796e-2f;
    p = p * r + 1.6666665e-1f;
    p = p * r + 0.5f;
    float er = p * r * r + r + 1.0f;
    return er * __int_as_float(((int)k + 127) << 23);
}

// tanh(u) = 1 - 2 / (1 + e^{2u}), exactly +-1 past |u| = 10 (the CPU's).
__device__ float tanh_small(float u) {
    float e = exp_small(2.0f * fminf(fmaxf(u, -10.0f), 10.0f));
    return 1.0f - 2.0f / (1.0f + e);
}
