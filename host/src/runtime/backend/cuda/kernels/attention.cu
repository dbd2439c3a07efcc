// Causal multi-head self-attention around cuBLAS's batched products (the
// host side is in blas.rs): the packed qkv[B,T,3,NH,HS] is split into
// q, k, v of [B,NH,T,HS]; preatt = q·kᵀ and y = att·v are strided batched
// GEMMs; the softmax here is the CPU's (attention.rs): scale, subtract the
// row's max, e^x with the same polynomial, normalise; zero above the
// diagonal.

// q, k, v [B,NH,T,HS] from qkv [B,T,3,NH,HS]
extern "C" __global__ void attention_split(float* q, float* k, float* v, const float* qkv,
                                           int b, int t, int nh, int hs) {
    i64 n = (i64)b * nh * t * hs;
    int c = nh * hs;
    for (i64 i = gid(); i < n; i += gsize()) {
        int d = (int)(i % hs);
        i64 r = i / hs;
        int ti = (int)(r % t);
        r /= t;
        int h = (int)(r % nh);
        int bi = (int)(r / nh);
        i64 src = ((i64)bi * t + ti) * 3 * c + (i64)h * hs + d;
        q[i] = qkv[src];
        k[i] = qkv[src + c];
        v[i] = qkv[src + 2 * c];
    }
}

// out [B,T,NH*HS] from y [B,NH,T,HS]
extern "C" __global__ void attention_merge(float* out, const float* y, int b, int t, int nh, int hs) {
    i64 n = (i64)b * nh * t * hs;
    for (i64 i = gid(); i < n; i += gsize()) {
        int d = (int)(i % hs);
        i64 r = i / hs;
        int ti = (int)(r % t);
        r /= t;
        int h = (int)(r % nh);
        int bi = (int)(r / nh);
        out[((i64)bi * t + ti) * nh * hs + (i64)h * hs + d] = y[i];
    }
}

// dy [B,NH,T,HS] from dout [B,T,NH*HS] (the merge's backward)
extern "C" __global__ void attention_merge_backward(float* dy, const float* dout, int b, int t, int nh, int hs) {
    i64 n = (i64)b * nh * t * hs;
    for (i64 i = gid(); i < n; i += gsize()) {
        int d = (int)(i % hs);
        i64 r = i / hs;
        int ti = (int)(r % t);
        r /= t;
        int h = (int)(r % nh);
        int bi = (int)(r / nh);
        dy[i] = dout[((i64)bi * t + ti) * nh * hs + (i64)h * hs + d];
    }
}

// dqkv += dq, dk, dv (the split's backward, accumulating)
extern "C" __global__ void attention_split_backward(float* dqkv, const float* dq, const float* dk,
                                                    const float* dv, int b, int t, int nh, int hs) {
    i64 n = (i64)b * nh * t * hs;
    int c = nh * hs;
    for (i64 i = gid(); i < n; i += gsize()) {
        int d = (int)(i % hs);
        i64 r = i / hs;
        int ti = (int)(r % t);
        r /= t;
        int h = (int)(r % nh);
        int bi = (int)(r / nh);
        i64 dst = ((i64)bi * t + ti) * 3 * c + (i64)h * hs + d;
        dqkv[dst] += dq[i];
        dqkv[dst + c] += dk[i];
        dqkv[dst + 2 * c] += dv[i];
    }
}

// att = causal softmax of scale * preatt, a block per row of every [T,T]
// matrix (rows = B*NH*T); zero above the diagonal.
extern "C" __global__ void causal_softmax(float* att, const float* preatt, float scale, i64 rows, int t) {
    i64 row = blockIdx.x;
    if (row >= rows) return;
    int ti = (int)(row % t);
    const float* x = preatt + row * t;
    float* a = att + row * t;
    float mx = NEG_INF;
    for (int j = threadIdx.x; j <= ti; j += BLOCK) mx = fmaxf(mx, x[j] * scale);
    mx = block_max(mx);
    float s = 0.0f;
    for (int j = threadIdx.x; j <= ti; j += BLOCK) {
        float e = exp_small(fmaxf(x[j] * scale - mx, -80.0f));
        a[j] = e;
        s += e;
    }
    float inv = 1.0f / block_sum(s);
    for (int j = threadIdx.x; j < t; j += BLOCK) a[j] = j <= ti ? a[j] * inv : 0.0f;
}

// dpreatt = scale * att * (datt - sum(att * datt)) on and below the
// diagonal, zero above (the softmax's backward, a block per row).
extern "C" __global__ void causal_softmax_backward(float* dpreatt, const float* datt, const float* att,
                                                   float scale, i64 rows, int t) {
    i64 row = blockIdx.x;
    if (row >= rows) return;
    int ti = (int)(row % t);
    const float* a = att + row * t;
    const float* da = datt + row * t;
    float s = 0.0f;
    for (int j = threadIdx.x; j <= ti; j += BLOCK) s += a[j] * da[j];
    float dot = block_sum(s);
    float* d = dpreatt + row * t;
    for (int j = threadIdx.x; j < t; j += BLOCK) d[j] = j <= ti ? a[j] * (da[j] - dot) * scale : 0.0f;
}

// Grouped-query attention's packed input: qkv[n, 3 nh hd] from q[n, nh hd]
// and k, v[n, kvh hd], query head h reading kv head h / (nh / kvh)
extern "C" __global__ void qkv_pack(float* qkv, const float* q, const float* k, const float* v,
                                    int n, int nh, int kvh, int hd) {
    int qw = nh * hd, kvw = kvh * hd, rep = nh / kvh;
    i64 total = (i64)n * 3 * qw;
    for (i64 i = gid(); i < total; i += gsize()) {
        i64 row = i / (3 * qw);
        int col = (int)(i % (3 * qw));
        float val;
        if (col < qw) {
            val = q[row * qw + col];
        } else {
            int part = col / qw, rest = col % qw;
            int g = (rest / hd) / rep, j = rest % hd;
            const float* src = part == 1 ? k : v;
            val = src[row * kvw + g * hd + j];
        }
        qkv[i] = val;
    }
}

// dq += the queries' part of dqkv; dk, dv += each kv head's query heads'
// parts, summed in head order
extern "C" __global__ void qkv_unpack_backward(float* dq, float* dk, float* dv, const float* dqkv,
                                               int n, int nh, int kvh, int hd) {
    int qw = nh * hd, kvw = kvh * hd, rep = nh / kvh;
    i64 total = (i64)n * (qw + 2 * kvw);
    for (i64 i = gid(); i < total; i += gsize()) {
        i64 row = i / (qw + 2 * kvw);
        int col = (int)(i % (qw + 2 * kvw));
        const float* src = dqkv + row * 3 * qw;
        if (col < qw) {
            dq[row * qw + col] += src[col];
        } else {
            int part = col < qw + kvw ? 1 : 2;
            int rest = col - qw - (part - 1) * kvw;
            int g = rest / hd, j = rest % hd;
            float acc = part == 1 ? dk[row * kvw + rest] : dv[row * kvw + rest];
            for (int h = g * rep; h < (g + 1) * rep; h++) acc += src[part * qw + h * hd + j];
            if (part == 1) dk[row * kvw + rest] = acc; else dv[row * kvw + rest] = acc;
        }
    }
}

// Memory-efficient causal attention (the CPU's `cpu::flash`, as a row per
// block): nothing T x T is stored. Each kernel takes one row (a query, or
// a key) of one (sequence, head) per block of BLOCK threads; the other
// side's rows go by in chunks of BLOCK, a thread per row computing its
// score from q and k in global memory, the chunk's probabilities (and
// their gradients) in shared memory, then a thread per channel (hs <=
// BLOCK, checked by the caller) adding the chunk into its sum. Sums run in
// a fixed order: the same bits every run.

// scale * q_r . k_jj of head h of sequence bi, q and k in their own tensors.
__device__ float ring_score(const float* q, const float* kv, int bi, int h, int r, int jj, int tr,
                            int tk, int c, int hs, float scale) {
    const float* qr = q + ((i64)bi * tr + r) * 3 * c + h * hs;
    const float* kj = kv + ((i64)bi * tk + jj) * 3 * c + c + h * hs;
    float s = 0.0f;
    for (int d = 0; d < hs; d++) s += qr[d] * kj[d];
    return s * scale;
}

// scale * q_i . k_j of head h of sequence bi, both in qkv.
__device__ float flash_score(const float* qkv, int bi, int h, int i, int j, int t, int c, int hs,
                             float scale) {
    return ring_score(qkv, qkv, bi, h, i, j, t, t, c, hs, scale);
}

// dO_i . v_j, or dO_i . O_i with `v` = out.
__device__ float flash_dot(const float* a, const float* b, int hs) {
    float s = 0.0f;
    for (int d = 0; d < hs; d++) s += a[d] * b[d];
    return s;
}

// The position of held query row r: context parallelism holds two chunks
// of `chunk` rows starting at s0 and s1 (the whole sequence: one, chunk =
// t, s0 = 0).
__device__ int flash_pos(int r, int chunk, int s0, int s1) {
    return r < chunk ? s0 + r : s1 + r - chunk;
}

// out[b,tr,c] and lse[b,nh,tr] of the held rows (tr of each t-long
// sequence): a block per (sequence, head, held query).
extern "C" __global__ void flash_forward(float* out, float* lse, const float* qkv, int t, int nh,
                                         int hs, int tr, int chunk, int s0, int s1) {
    __shared__ float p[BLOCK];
    i64 row = blockIdx.x;
    int r = (int)(row % tr), bh = (int)(row / tr), bi = bh / nh, h = bh % nh, c = nh * hs;
    int i = flash_pos(r, chunk, s0, s1);
    float scale = 1.0f / sqrtf((float)hs);
    float mx = NEG_INF;
    for (int j = threadIdx.x; j <= i; j += BLOCK)
        mx = fmaxf(mx, flash_score(qkv, bi, h, i, j, t, c, hs, scale));
    mx = block_max(mx);
    float s = 0.0f;
    for (int j = threadIdx.x; j <= i; j += BLOCK)
        s += exp_small(fmaxf(flash_score(qkv, bi, h, i, j, t, c, hs, scale) - mx, -80.0f));
    float l = mx + logf(block_sum(s));
    float acc = 0.0f;
    for (int j0 = 0; j0 <= i; j0 += BLOCK) {
        int j = j0 + threadIdx.x;
        p[threadIdx.x] =
            j <= i ? exp_small(fmaxf(flash_score(qkv, bi, h, i, j, t, c, hs, scale) - l, -80.0f))
                   : 0.0f;
        __syncthreads();
        if (threadIdx.x < hs) {
            int n = min(BLOCK, i + 1 - j0);
            for (int jj = 0; jj < n; jj++)
                acc += p[jj] * qkv[((i64)bi * t + j0 + jj) * 3 * c + 2 * c + h * hs + threadIdx.x];
        }
        __syncthreads();
    }
    if (threadIdx.x < hs) out[((i64)bi * tr + r) * c + h * hs + threadIdx.x] = acc;
    if (threadIdx.x == 0) lse[row] = l;
}

// dqkv's query part += dq_i: a block per (sequence, head, held query).
extern "C" __global__ void flash_backward_dq(float* dqkv, const float* dout, const float* qkv,
                                             const float* out, const float* lse, int t, int nh,
                                             int hs, int tr, int chunk, int s0, int s1) {
    __shared__ float ds[BLOCK];
    i64 row = blockIdx.x;
    int r = (int)(row % tr), bh = (int)(row / tr), bi = bh / nh, h = bh % nh, c = nh * hs;
    int i = flash_pos(r, chunk, s0, s1);
    float scale = 1.0f / sqrtf((float)hs);
    const float* g = dout + ((i64)bi * tr + r) * c + h * hs;
    float dd = flash_dot(g, out + ((i64)bi * tr + r) * c + h * hs, hs);
    float l = lse[row];
    float acc = 0.0f;
    for (int j0 = 0; j0 <= i; j0 += BLOCK) {
        int j = j0 + threadIdx.x;
        float v = 0.0f;
        if (j <= i) {
            float pj = exp_small(fmaxf(flash_score(qkv, bi, h, i, j, t, c, hs, scale) - l, -80.0f));
            float dp = flash_dot(g, qkv + ((i64)bi * t + j) * 3 * c + 2 * c + h * hs, hs);
            v = pj * (dp - dd) * scale;
        }
        ds[threadIdx.x] = v;
        __syncthreads();
        if (threadIdx.x < hs) {
            int n = min(BLOCK, i + 1 - j0);
            for (int jj = 0; jj < n; jj++)
                acc += ds[jj] * qkv[((i64)bi * t + j0 + jj) * 3 * c + c + h * hs + threadIdx.x];
        }
        __syncthreads();
    }
    if (threadIdx.x < hs) dqkv[((i64)bi * t + i) * 3 * c + h * hs + threadIdx.x] += acc;
}

// dqkv's key and value parts += dk_j, dv_j from the held queries at or
// after position j: a block per (sequence, head, key).
extern "C" __global__ void flash_backward_dkv(float* dqkv, const float* dout, const float* qkv,
                                              const float* out, const float* lse, int t, int nh,
                                              int hs, int tr, int chunk, int s0, int s1) {
    __shared__ float p[BLOCK];
    __shared__ float ds[BLOCK];
    i64 row = blockIdx.x;
    int j = (int)(row % t), bh = (int)(row / t), bi = bh / nh, h = bh % nh, c = nh * hs;
    float scale = 1.0f / sqrtf((float)hs);
    const float* vj = qkv + ((i64)bi * t + j) * 3 * c + 2 * c + h * hs;
    float dk = 0.0f, dv = 0.0f;
    // Held rows before this key's position never see it: the whole
    // sequence starts at j, two chunks at the first live row.
    int first = chunk >= tr ? max(0, j - s0) : 0;
    for (int r0 = first; r0 < tr; r0 += BLOCK) {
        int r = r0 + threadIdx.x;
        float pi = 0.0f, dsi = 0.0f;
        if (r < tr) {
            int i = flash_pos(r, chunk, s0, s1);
            if (i >= j) {
                const float* g = dout + ((i64)bi * tr + r) * c + h * hs;
                float dd = flash_dot(g, out + ((i64)bi * tr + r) * c + h * hs, hs);
                pi = exp_small(fmaxf(flash_score(qkv, bi, h, i, j, t, c, hs, scale) -
                                         lse[(i64)bh * tr + r],
                                     -80.0f));
                dsi = pi * (flash_dot(g, vj, hs) - dd) * scale;
            }
        }
        p[threadIdx.x] = pi;
        ds[threadIdx.x] = dsi;
        __syncthreads();
        if (threadIdx.x < hs) {
            int n = min(BLOCK, tr - r0);
            for (int ii = 0; ii < n; ii++) {
                int i = flash_pos(r0 + ii, chunk, s0, s1);
                dk += ds[ii] * qkv[((i64)bi * t + i) * 3 * c + h * hs + threadIdx.x];
                dv += p[ii] * dout[((i64)bi * tr + r0 + ii) * c + h * hs + threadIdx.x];
            }
        }
        __syncthreads();
    }
    if (threadIdx.x < hs) {
        i64 at = ((i64)bi * t + j) * 3 * c + h * hs + threadIdx.x;
        dqkv[at + c] += dk;
        dqkv[at + 2 * c] += dv;
    }
}

// Context parallelism's ring (the CPU's `cpu::ring`): the held query rows of
// q[b,tr,3c] meet one block of keys and values kv[b,tk,3c] at a time, each
// side's rows at their positions in the whole sequence (one or two chunks:
// `flash_pos`); a key counts for a query at or after it. A block per
// (sequence, head, row), as the kernels above.


// One forward step: the block's attention merged into out[b,tr,c] and
// lse[b,nh,tr] by log-sum-exp (`first`: nothing merged yet, so the old
// output weighs nothing). A row that sees no key of the block is left as
// it was (zero and -inf on the first step).
extern "C" __global__ void ring_forward(float* out, float* lse, const float* q, const float* kv,
                                        int nh, int hs, int tr, int qchunk, int q0, int q1, int tk,
                                        int kchunk, int k0, int k1, int first) {
    __shared__ float p[BLOCK];
    i64 row = blockIdx.x;
    int r = (int)(row % tr), bh = (int)(row / tr), bi = bh / nh, h = bh % nh, c = nh * hs;
    int i = flash_pos(r, qchunk, q0, q1);
    float scale = 1.0f / sqrtf((float)hs);
    i64 o = ((i64)bi * tr + r) * c + h * hs;
    float mx = NEG_INF;
    for (int jj = threadIdx.x; jj < tk; jj += BLOCK)
        if (flash_pos(jj, kchunk, k0, k1) <= i)
            mx = fmaxf(mx, ring_score(q, kv, bi, h, r, jj, tr, tk, c, hs, scale));
    mx = block_max(mx);
    if (mx == NEG_INF) {
        if (first) {
            if (threadIdx.x < hs) out[o + threadIdx.x] = 0.0f;
            if (threadIdx.x == 0) lse[row] = NEG_INF;
        }
        return;
    }
    float m_old = first ? NEG_INF : lse[row];
    float m = fmaxf(m_old, mx);
    float s = 0.0f;
    for (int jj = threadIdx.x; jj < tk; jj += BLOCK)
        if (flash_pos(jj, kchunk, k0, k1) <= i)
            s += exp_small(fmaxf(ring_score(q, kv, bi, h, r, jj, tr, tk, c, hs, scale) - m, -80.0f));
    s = block_sum(s);
    float alpha = m_old == NEG_INF ? 0.0f : exp_small(fmaxf(m_old - m, -80.0f));
    float total = alpha + s;
    float acc = 0.0f;
    for (int j0 = 0; j0 < tk; j0 += BLOCK) {
        int jj = j0 + threadIdx.x;
        p[threadIdx.x] = jj < tk && flash_pos(jj, kchunk, k0, k1) <= i
                             ? exp_small(fmaxf(ring_score(q, kv, bi, h, r, jj, tr, tk, c, hs, scale) - m, -80.0f))
                             : 0.0f;
        __syncthreads();
        if (threadIdx.x < hs) {
            int n = min(BLOCK, tk - j0);
            for (int jq = 0; jq < n; jq++)
                acc += p[jq] * kv[((i64)bi * tk + j0 + jq) * 3 * c + 2 * c + h * hs + threadIdx.x];
        }
        __syncthreads();
    }
    if (threadIdx.x < hs) {
        float old = first ? 0.0f : out[o + threadIdx.x];
        out[o + threadIdx.x] = (old * alpha + acc) / total;
    }
    if (threadIdx.x == 0) lse[row] = m + logf(total);
}

// One backward step, queries: dq[b,tr,3c] (its q part) += the block's share,
// from the rows' final out and lse.
extern "C" __global__ void ring_backward_dq(float* dq, const float* dout, const float* q,
                                            const float* kv, const float* out, const float* lse,
                                            int nh, int hs, int tr, int qchunk, int q0, int q1,
                                            int tk, int kchunk, int k0, int k1) {
    __shared__ float ds[BLOCK];
    i64 row = blockIdx.x;
    int r = (int)(row % tr), bh = (int)(row / tr), bi = bh / nh, h = bh % nh, c = nh * hs;
    int i = flash_pos(r, qchunk, q0, q1);
    float scale = 1.0f / sqrtf((float)hs);
    const float* g = dout + ((i64)bi * tr + r) * c + h * hs;
    float dd = flash_dot(g, out + ((i64)bi * tr + r) * c + h * hs, hs);
    float l = lse[row];
    float acc = 0.0f;
    for (int j0 = 0; j0 < tk; j0 += BLOCK) {
        int jj = j0 + threadIdx.x;
        float v = 0.0f;
        if (jj < tk && flash_pos(jj, kchunk, k0, k1) <= i) {
            float pj = exp_small(fmaxf(ring_score(q, kv, bi, h, r, jj, tr, tk, c, hs, scale) - l, -80.0f));
            float dp = flash_dot(g, kv + ((i64)bi * tk + jj) * 3 * c + 2 * c + h * hs, hs);
            v = pj * (dp - dd) * scale;
        }
        ds[threadIdx.x] = v;
        __syncthreads();
        if (threadIdx.x < hs) {
            int n = min(BLOCK, tk - j0);
            for (int jq = 0; jq < n; jq++)
                acc += ds[jq] * kv[((i64)bi * tk + j0 + jq) * 3 * c + c + h * hs + threadIdx.x];
        }
        __syncthreads();
    }
    if (threadIdx.x < hs) dq[((i64)bi * tr + r) * 3 * c + h * hs + threadIdx.x] += acc;
}

// One backward step, keys and values: dkv[b,tk,3c] (its k and v parts) +=
// the gradients through the block's keys, a block per (sequence, head, key).
extern "C" __global__ void ring_backward_dkv(float* dkv, const float* dout, const float* q,
                                             const float* kv, const float* out, const float* lse,
                                             int nh, int hs, int tr, int qchunk, int q0, int q1,
                                             int tk, int kchunk, int k0, int k1) {
    __shared__ float p[BLOCK];
    __shared__ float ds[BLOCK];
    i64 row = blockIdx.x;
    int jj = (int)(row % tk), bh = (int)(row / tk), bi = bh / nh, h = bh % nh, c = nh * hs;
    int j = flash_pos(jj, kchunk, k0, k1);
    float scale = 1.0f / sqrtf((float)hs);
    const float* vj = kv + ((i64)bi * tk + jj) * 3 * c + 2 * c + h * hs;
    float dk = 0.0f, dv = 0.0f;
    for (int r0 = 0; r0 < tr; r0 += BLOCK) {
        int r = r0 + threadIdx.x;
        float pi = 0.0f, dsi = 0.0f;
        if (r < tr && flash_pos(r, qchunk, q0, q1) >= j) {
            const float* g = dout + ((i64)bi * tr + r) * c + h * hs;
            float dd = flash_dot(g, out + ((i64)bi * tr + r) * c + h * hs, hs);
            pi = exp_small(fmaxf(ring_score(q, kv, bi, h, r, jj, tr, tk, c, hs, scale) -
                                     lse[(i64)bh * tr + r],
                                 -80.0f));
            dsi = pi * (flash_dot(g, vj, hs) - dd) * scale;
        }
        p[threadIdx.x] = pi;
        ds[threadIdx.x] = dsi;
        __syncthreads();
        if (threadIdx.x < hs) {
            int n = min(BLOCK, tr - r0);
            for (int ii = 0; ii < n; ii++) {
                dk += ds[ii] * q[((i64)bi * tr + r0 + ii) * 3 * c + h * hs + threadIdx.x];
                dv += p[ii] * dout[((i64)bi * tr + r0 + ii) * c + h * hs + threadIdx.x];
            }
        }
        __syncthreads();
    }
    if (threadIdx.x < hs) {
        i64 at = ((i64)bi * tk + jj) * 3 * c + h * hs + threadIdx.x;
        dkv[at + c] += dk;
        dkv[at + 2 * c] += dv;
    }
}
