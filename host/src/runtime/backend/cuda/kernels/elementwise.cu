// Elementwise kernels: GELU (tanh approximation, GPT-2's), the residual
// add, accumulation, biases by rows. Grid-stride loops over `n` elements;
// the arithmetic is the CPU backend's (elementwise.rs), operation for
// operation.

#define GELU_SCALE 0.7978846f

// out = a + b
extern "C" __global__ void residual_forward(float* out, const float* a, const float* b, i64 n) {
    for (i64 i = gid(); i < n; i += gsize()) out[i] = a[i] + b[i];
}

// dst += src
extern "C" __global__ void add_into(float* dst, const float* src, i64 n) {
    for (i64 i = gid(); i < n; i += gsize()) dst[i] += src[i];
}

// out[row] += bias, rows of `width`
extern "C" __global__ void add_bias_rows(float* out, const float* bias, i64 n, int width) {
    for (i64 i = gid(); i < n; i += gsize()) out[i] += bias[i % width];
}

// out = res + bias by rows (the start of a linear layer onto the residual)
extern "C" __global__ void residual_bias(float* out, const float* res, const float* bias, i64 n, int width) {
    for (i64 i = gid(); i < n; i += gsize()) out[i] = res[i] + bias[i % width];
}

__device__ __forceinline__ float gelu(float x) {
    float cube = 0.044715f * x * x * x;
    return 0.5f * x * (1.0f + tanh_small(GELU_SCALE * (x + cube)));
}

// out = gelu(inp)
extern "C" __global__ void gelu_forward(float* out, const float* inp, i64 n) {
    for (i64 i = gid(); i < n; i += gsize()) out[i] = gelu(inp[i]);
}

// By rows of `width`: pre += bias, out = gelu(pre)
extern "C" __global__ void bias_gelu_forward(float* pre, float* out, const float* bias, i64 n, int width) {
    for (i64 i = gid(); i < n; i += gsize()) {
        float x = pre[i] + bias[i % width];
        pre[i] = x;
        out[i] = gelu(x);
    }
}

// dinp += gelu'(inp) * dout
extern "C" __global__ void gelu_backward(float* dinp, const float* inp, const float* dout, i64 n) {
    for (i64 i = gid(); i < n; i += gsize()) {
        float x = inp[i];
        float cube = 0.044715f * x * x * x;
        float arg = GELU_SCALE * (x + cube);
        float th = tanh_small(arg);
        float sech2 = 1.0f - th * th;
        float local = 0.5f * (1.0f + th) + x * 0.5f * sech2 * GELU_SCALE * (1.0f + 3.0f * 0.044715f * x * x);
        dinp[i] += local * dout[i];
    }
}

// Column sums (a linear layer's bias gradient, a norm's weight and bias
// gradients) in two deterministic stages: block (x, p) of a 2-D grid sums
// rows [p·chunk, (p+1)·chunk) of its columns into partial[p, j], then
// `col_finish` adds the chunks onto the gradient in chunk order. Every
// column's sum has as many threads as chunks, and the same order every run.

// partial[p, j] = sum over chunk p's rows of dout[row, j]
extern "C" __global__ void bias_backward(float* partial, const float* dout, int rows, int oc, int chunk) {
    int j = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (j >= oc) return;
    float acc = 0.0f;
    int end = min(rows, ((int)blockIdx.y + 1) * chunk);
    for (int i = (int)blockIdx.y * chunk; i < end; i++) acc += dout[(i64)i * oc + j];
    partial[(i64)blockIdx.y * oc + j] = acc;
}

// dst[j] += partial[0, j] + partial[1, j] + ... (chunks in order)
extern "C" __global__ void col_finish(float* dst, const float* partial, int parts, int c) {
    int j = (int)gid();
    if (j >= c) return;
    float acc = 0.0f;
    for (int p = 0; p < parts; p++) acc += partial[(i64)p * c + j];
    dst[j] += acc;
}

// One AdamW step on n elements (decoupled weight decay `wd`), with the
// gradient scaled by the clipping factor and the bias corrections given.
extern "C" __global__ void adamw(float* param, const float* grad, float* m, float* v, i64 n,
                                 float lr, float beta1, float beta2, float bc1, float bc2,
                                 float eps, float wd, float grad_scale) {
    for (i64 i = gid(); i < n; i += gsize()) {
        float g = grad[i] * grad_scale;
        float mi = beta1 * m[i] + (1.0f - beta1) * g;
        float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
        m[i] = mi;
        v[i] = vi;
        float mhat = mi / bc1;
        float vhat = vi / bc2;
        param[i] -= lr * (mhat / (sqrtf(vhat) + eps) + wd * param[i]);
    }
}

// Per block, the f64 sum of x^2 over a contiguous share of n elements (the
// gradient norm); the host adds the blocks' sums in order.
extern "C" __global__ void sum_squares(double* partial, const float* x, i64 n) {
    i64 per = (n + gridDim.x - 1) / gridDim.x;
    i64 lo = (i64)blockIdx.x * per;
    i64 hi = lo + per < n ? lo + per : n;
    double acc = 0.0;
    for (i64 i = lo + threadIdx.x; i < hi; i += BLOCK) {
        double xi = (double)x[i];
        acc += xi * xi;
    }
    double s = block_sum_f64(acc);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// sigma(x) = 1 / (1 + e^-x) through exp_small, the argument clamped to +-20
// (the CPU backend's `sigmoid`)
__device__ __forceinline__ float sigmoid_small(float x) {
    return 1.0f / (1.0f + exp_small(fminf(fmaxf(-x, -20.0f), 20.0f)));
}

// out = silu(gate) * up
extern "C" __global__ void swiglu_forward(float* out, const float* gate, const float* up, i64 n) {
    for (i64 i = gid(); i < n; i += gsize()) {
        float g = gate[i];
        out[i] = g * sigmoid_small(g) * up[i];
    }
}

// dgate += dout * up * s(1 + g(1 - s)), dup += dout * silu(g)
extern "C" __global__ void swiglu_backward(float* dgate, float* dup, const float* gate,
                                           const float* up, const float* dout, i64 n) {
    for (i64 i = gid(); i < n; i += gsize()) {
        float g = gate[i], u = up[i], d = dout[i];
        float s = sigmoid_small(g);
        dgate[i] += d * u * (s * (1.0f + g * (1.0f - s)));
        dup[i] += d * (g * s);
    }
}

// bf16 storage. A bf16 value is the high half of an fp32's bits.

// out[i] = in[i] widened to fp32 (exact)
extern "C" __global__ void bf16_widen(float* out, const unsigned short* in, i64 n) {
    for (i64 i = gid(); i < n; i += gsize()) out[i] = __uint_as_float(((u32)in[i]) << 16);
}

// out[i] = in[i] rounded to the nearest bf16, ties to even; a NaN stays a
// (quiet) NaN. The `half` crate's conversion, bit for bit, as the CPU
// backend rounds.
extern "C" __global__ void bf16_narrow(unsigned short* out, const float* in, i64 n) {
    for (i64 i = gid(); i < n; i += gsize()) {
        u32 x = __float_as_uint(in[i]);
        if ((x & 0x7fffffffu) > 0x7f800000u) {
            out[i] = (unsigned short)((x >> 16) | 0x0040u);
        } else if ((x & 0x8000u) != 0 && (x & 0x17fffu) != 0) {
            out[i] = (unsigned short)((x >> 16) + 1);
        } else {
            out[i] = (unsigned short)(x >> 16);
        }
    }
}
