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
