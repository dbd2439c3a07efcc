// The mixture-of-experts kernels (the CPU backend's moe.rs; the arithmetic
// is documented in runtime/model/moe.rs). Routing arrays come from the host: the
// routing is a host decision.

// Softmax of each row of logits[n,e] (the router), a thread per row.
extern "C" __global__ void moe_softmax_rows(float* probs, const float* logits, int n, int e) {
    int row = (int)gid();
    if (row >= n) return;
    const float* l = logits + (i64)row * e;
    float* p = probs + (i64)row * e;
    float m = NEG_INF;
    for (int x = 0; x < e; x++) m = fmaxf(m, l[x]);
    float s = 0.0f;
    for (int x = 0; x < e; x++) {
        p[x] = expf(l[x] - m);
        s += p[x];
    }
    float inv = 1.0f / s;
    for (int x = 0; x < e; x++) p[x] *= inv;
}

// out[at + i*c ..] = src[token(assignments[i]) * c ..]
extern "C" __global__ void moe_gather_rows(float* out, i64 at, const float* src, const u32* assignments,
                                           int rows, int k, int c) {
    i64 n = (i64)rows * c;
    for (i64 i = gid(); i < n; i += gsize()) {
        int r = (int)(i / c), j = (int)(i % c);
        out[at + i] = src[(i64)(assignments[r] / k) * c + j];
    }
}

// dst[token(assignments[i]) * c ..] += src[at + i*c ..], a thread per channel
// adding the rows in order (a token's choices add up the same way every run)
extern "C" __global__ void moe_scatter_add_rows(float* dst, const float* src, i64 at, const u32* assignments,
                                                int rows, int k, int c) {
    int j = (int)gid();
    if (j >= c) return;
    for (int r = 0; r < rows; r++) dst[(i64)(assignments[r] / k) * c + j] += src[at + (i64)r * c + j];
}

// The same when no token appears twice among the rows (one expert's rows: a
// token's choices are distinct experts): a thread per element, each element
// added to once, so the sum is the ordered one.
extern "C" __global__ void moe_scatter_add_distinct(float* dst, const float* src, i64 at, const u32* assignments,
                                                    int rows, int k, int c) {
    i64 n = (i64)rows * c;
    for (i64 i = gid(); i < n; i += gsize()) {
        int r = (int)(i / c), j = (int)(i % c);
        dst[(i64)(assignments[r] / k) * c + j] += src[at + i];
    }
}

// out[token] += weight * ys[expert][slot] over the token's kept choices in
// order; `ys` holds each expert's output rows (device pointers).
extern "C" __global__ void moe_combine(float* out, const float* const* ys, const u32* choice, const u32* slot,
                                       const float* weight, int n, int k, int c) {
    i64 total = (i64)n * c;
    for (i64 i = gid(); i < total; i += gsize()) {
        int tok = (int)(i / c), j = (int)(i % c);
        float o = out[i];
        for (int jj = 0; jj < k; jj++) {
            int a = tok * k + jj;
            u32 s = slot[a];
            if (s == DROPPED) continue;
            o += weight[a] * ys[choice[a]][(i64)s * c + j];
        }
        out[i] = o;
    }
}

// For one expert's rows: dweight[a] = dout[token] · y[row], a block per row
extern "C" __global__ void moe_combine_dweight(float* dweight, const float* dout, const float* y,
                                               const u32* assignments, int rows, int k, int c) {
    int r = blockIdx.x;
    if (r >= rows) return;
    u32 a = assignments[r];
    const float* g = dout + (i64)(a / k) * c;
    const float* yr = y + (i64)r * c;
    float s = 0.0f;
    for (int j = threadIdx.x; j < c; j += BLOCK) s += g[j] * yr[j];
    s = block_sum(s);
    if (threadIdx.x == 0) dweight[a] = s;
}

// For one expert's rows: dy[row] = weight[a] * dout[token]
extern "C" __global__ void moe_combine_dy(float* dy, const float* dout, const float* weight,
                                          const u32* assignments, int rows, int k, int c) {
    i64 n = (i64)rows * c;
    for (i64 i = gid(); i < n; i += gsize()) {
        int r = (int)(i / c), j = (int)(i % c);
        u32 a = assignments[r];
        dy[i] = weight[a] * dout[(i64)(a / k) * c + j];
    }
}

// The router logits' gradient, a thread per token: each choice's weight
// gradient through the renormalisation w_j = p_j / sum p, plus the balance
// loss's aux * f[sequence, x], then through the softmax. dlogits' row holds
// dp while it is made.
extern "C" __global__ void moe_router_backward(float* dlogits, const float* probs, const float* dweight,
                                               const float* shares, const u32* choice, const float* weight,
                                               float aux, int n, int t, int e, int k) {
    int tok = (int)gid();
    if (tok >= n) return;
    const float* p = probs + (i64)tok * e;
    float* dp = dlogits + (i64)tok * e;
    const float* f = shares + (i64)(tok / t) * e;
    for (int x = 0; x < e; x++) dp[x] = aux * f[x];
    const u32* ch = choice + (i64)tok * k;
    const float* w = weight + (i64)tok * k;
    const float* dw = dweight + (i64)tok * k;
    float sum = 0.0f, wdw = 0.0f;
    for (int j = 0; j < k; j++) sum += p[ch[j]];
    for (int j = 0; j < k; j++) wdw += w[j] * dw[j];
    for (int j = 0; j < k; j++) dp[ch[j]] += (dw[j] - wdw) / sum;
    float pdp = 0.0f;
    for (int x = 0; x < e; x++) pdp += p[x] * dp[x];
    for (int x = 0; x < e; x++) dp[x] = p[x] * (dp[x] - pdp);
}
