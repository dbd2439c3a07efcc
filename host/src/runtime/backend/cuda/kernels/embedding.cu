// Token + position embedding (the CPU backend's embedding.rs). The input
// has no gradient: the backward is a backward-for-weights only, a thread per
// (token, channel) and per (position, channel) adding its rows in order (so
// tokens that repeat add up the same way every run, and as the CPU adds them).

// out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:]
extern "C" __global__ void embedding_forward(float* out, const u32* tokens, const float* wte,
                                             const float* wpe, int bt, int t, int c) {
    i64 n = (i64)bt * c;
    for (i64 i = gid(); i < n; i += gsize()) {
        int row = (int)(i / c), j = (int)(i % c);
        out[i] = wte[(i64)tokens[row] * c + j] + wpe[(i64)(row % t) * c + j];
    }
}

// The Llama family's embedding, without positions: out[b,t,:] = wte[tokens[b,t],:]
extern "C" __global__ void token_embedding_forward(float* out, const u32* tokens, const float* wte,
                                                   int bt, int c) {
    i64 n = (i64)bt * c;
    for (i64 i = gid(); i < n; i += gsize()) {
        int row = (int)(i / c), j = (int)(i % c);
        out[i] = wte[(i64)tokens[row] * c + j];
    }
}

// dwte[token] += the rows of that token: a thread per (distinct token,
// channel) adds its rows in ascending order (`starts`/`rows`: the rows
// grouped by token; rows at or past `bt` are not this call's) — the CPU's
// additions in the CPU's order, and no two threads write one value.
extern "C" __global__ void embedding_backward_tokens(float* dwte, const float* dout, const u32* uniq,
                                                     const u32* starts, const u32* rows, int nu,
                                                     int bt, int c) {
    i64 n = (i64)nu * c;
    for (i64 i = gid(); i < n; i += gsize()) {
        int u = (int)(i / c), j = (int)(i % c);
        i64 at = (i64)uniq[u] * c + j;
        float acc = dwte[at];
        for (u32 r = starts[u]; r < starts[u + 1]; r++) {
            if ((int)rows[r] < bt) acc += dout[(i64)rows[r] * c + j];
        }
        dwte[at] = acc;
    }
}

// dwpe[p] += the rows at position p (p, p + t, ...): a thread per
// (position, channel), the sequences in order.
extern "C" __global__ void embedding_backward_positions(float* dwpe, const float* dout, int bt,
                                                        int t, int c) {
    i64 n = (i64)t * c;
    for (i64 i = gid(); i < n; i += gsize()) {
        int p = (int)(i / c), j = (int)(i % c);
        float acc = dwpe[i];
        for (int row = p; row < bt; row += t) acc += dout[(i64)row * c + j];
        dwpe[i] = acc;
    }
}
