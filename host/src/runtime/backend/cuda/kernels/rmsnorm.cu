// RMSNorm over the `c` channels of `n` rows, with rstd cached for backward
// (the CPU backend's rmsnorm.rs): a block of BLOCK threads per row for the
// forward and the input gradient; the weight gradient as a column sum in two
// stages (elementwise.cu's `col_finish`).

// out = inp * rstd * weight, rstd = 1 / sqrt(mean(inp^2) + eps)
extern "C" __global__ void rmsnorm_forward(float* out, float* rstd, const float* inp,
                                           const float* weight, int n, int c, float eps) {
    int row = blockIdx.x;
    if (row >= n) return;
    const float* x = inp + (i64)row * c;
    float q = 0.0f;
    for (int j = threadIdx.x; j < c; j += BLOCK) q += x[j] * x[j];
    float r = 1.0f / sqrtf(block_sum(q) / (float)c + eps);
    if (threadIdx.x == 0) rstd[row] = r;
    float* o = out + (i64)row * c;
    for (int j = threadIdx.x; j < c; j += BLOCK) o[j] = x[j] * r * weight[j];
}

// dinp += rstd * (g - norm * mean(g * norm)), g = dout * weight, norm = inp * rstd
extern "C" __global__ void rmsnorm_backward_input(float* dinp, const float* dout, const float* inp,
                                                  const float* weight, const float* rstd, int n,
                                                  int c) {
    int row = blockIdx.x;
    if (row >= n) return;
    const float* x = inp + (i64)row * c;
    const float* dy = dout + (i64)row * c;
    float r = rstd[row];
    float a = 0.0f;
    for (int j = threadIdx.x; j < c; j += BLOCK) a += weight[j] * dy[j] * (x[j] * r);
    float g_norm_mean = block_sum(a) / (float)c;
    float* dx = dinp + (i64)row * c;
    for (int j = threadIdx.x; j < c; j += BLOCK) {
        float norm = x[j] * r;
        dx[j] += (weight[j] * dy[j] - norm * g_norm_mean) * r;
    }
}

// dweight += sum over the rows of norm * dout. The first of two stages (see `col_finish`): block (x, p) sums chunk p of
// the rows into pw[p, j].
extern "C" __global__ void rmsnorm_backward_weight(float* pw, const float* dout,
                                                   const float* inp, const float* rstd, int n,
                                                   int c, int chunk) {
    int j = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (j >= c) return;
    float dw = 0.0f;
    int end = min(n, ((int)blockIdx.y + 1) * chunk);
    for (int i = (int)blockIdx.y * chunk; i < end; i++) {
        i64 at = (i64)i * c + j;
        dw += inp[at] * rstd[i] * dout[at];
    }
    pw[(i64)blockIdx.y * c + j] = dw;
}
