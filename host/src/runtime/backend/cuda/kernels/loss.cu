// Softmax cross-entropy over the vocabulary (the CPU backend's loss.rs): a
// block per row for the softmax, each row's loss term -ln p(target) in f64
// (the host adds the rows in order when it reads the step's loss).

// probs = softmax(logits) by rows of v; losses[row] = -ln(max(p[target], 1e-30)), NaN kept
extern "C" __global__ void crossentropy_forward(float* probs, double* losses, const float* logits,
                                                const u32* targets, int n, int v) {
    int row = blockIdx.x;
    if (row >= n) return;
    const float* l = logits + (i64)row * v;
    float* p = probs + (i64)row * v;
    float mx = NEG_INF;
    for (int j = threadIdx.x; j < v; j += BLOCK) mx = fmaxf(mx, l[j]);
    mx = block_max(mx);
    float s = 0.0f;
    for (int j = threadIdx.x; j < v; j += BLOCK) {
        float e = expf(l[j] - mx);
        p[j] = e;
        s += e;
    }
    float inv = 1.0f / block_sum(s);
    for (int j = threadIdx.x; j < v; j += BLOCK) p[j] *= inv;
    __syncthreads();
    if (threadIdx.x == 0) {
        // Clamped away from 0, but a NaN stays NaN (fmaxf would hide it).
        float pt = p[targets[row]];
        pt = isnan(pt) ? pt : fmaxf(pt, 1e-30f);
        losses[row] = -log((double)pt);
    }
}

// dlogits = (probs - onehot(target)) * scale
extern "C" __global__ void crossentropy_backward(float* dlogits, const float* probs, const u32* targets,
                                                 int n, int v, float scale) {
    i64 total = (i64)n * v;
    for (i64 i = gid(); i < total; i += gsize()) {
        int row = (int)(i / v), j = (int)(i % v);
        float d = probs[i] * scale;
        if ((u32)j == targets[row]) d -= scale;
        dlogits[i] = d;
    }
}
