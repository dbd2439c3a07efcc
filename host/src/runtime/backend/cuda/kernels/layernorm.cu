// LayerNorm over the `c` channels of `n` rows, with mean and rstd cached for
// backward (the CPU backend's layernorm.rs): a block of BLOCK threads per row
// for the forward and the input gradient; the weight gradients as column sums
// in two stages (elementwise.cu's `col_finish`).

#define LN_EPS 1e-5f

// out = (inp - mean) * rstd * weight + bias
extern "C" __global__ void layernorm_forward(float* out, float* mean, float* rstd, const float* inp,
                                             const float* weight, const float* bias, int n, int c) {
    int row = blockIdx.x;
    if (row >= n) return;
    const float* x = inp + (i64)row * c;
    float s = 0.0f;
    for (int j = threadIdx.x; j < c; j += BLOCK) s += x[j];
    float m = block_sum(s) / (float)c;
    float q = 0.0f;
    for (int j = threadIdx.x; j < c; j += BLOCK) {
        float d = x[j] - m;
        q += d * d;
    }
    float var = block_sum(q) / (float)c;
    float r = 1.0f / sqrtf(var + LN_EPS);
    if (threadIdx.x == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
    float* o = out + (i64)row * c;
    for (int j = threadIdx.x; j < c; j += BLOCK) o[j] = (x[j] - m) * r * weight[j] + bias[j];
}

// dinp += rstd * (dnorm - mean(dnorm) - norm * mean(dnorm * norm)), dnorm = dout * weight
extern "C" __global__ void layernorm_backward_input(float* dinp, const float* dout, const float* inp,
                                                    const float* weight, const float* mean,
                                                    const float* rstd, int n, int c) {
    int row = blockIdx.x;
    if (row >= n) return;
    const float* x = inp + (i64)row * c;
    const float* dy = dout + (i64)row * c;
    float m = mean[row], r = rstd[row];
    float a = 0.0f, b = 0.0f;
    for (int j = threadIdx.x; j < c; j += BLOCK) {
        float norm = (x[j] - m) * r;
        float dnorm = weight[j] * dy[j];
        a += dnorm;
        b += dnorm * norm;
    }
    float dnorm_mean = block_sum(a) / (float)c;
    float dnorm_norm_mean = block_sum(b) / (float)c;
    float* dx = dinp + (i64)row * c;
    for (int j = threadIdx.x; j < c; j += BLOCK) {
        float norm = (x[j] - m) * r;
        float dnorm = weight[j] * dy[j];
        dx[j] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * r;
    }
}

// dweight += sum of norm * dout, dbias += sum of dout, over the rows. The first of two stages (see `col_finish`): block (x, p) sums chunk p of
// the rows into pw[p, j] and pb[p, j].
extern "C" __global__ void layernorm_backward_weight(float* pw, float* pb, const float* dout,
                                                     const float* inp, const float* mean,
                                                     const float* rstd, int n, int c, int chunk) {
    int j = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (j >= c) return;
    float dw = 0.0f, db = 0.0f;
    int end = min(n, ((int)blockIdx.y + 1) * chunk);
    for (int i = (int)blockIdx.y * chunk; i < end; i++) {
        i64 at = (i64)i * c + j;
        float norm = (inp[at] - mean[i]) * rstd[i];
        dw += norm * dout[at];
        db += dout[at];
    }
    pw[(i64)blockIdx.y * c + j] = dw;
    pb[(i64)blockIdx.y * c + j] = db;
}
