// Token + position embedding (the CPU backend's embedding.rs). The input
// has no gradient: the backward is a backward-for-weights only, a thread per
// channel adding the tokens in order (so tokens that repeat add up the same
// way every run).

// out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:]
extern "C" __global__ void embedding_forward(float* out, const u32* tokens, const float* wte,
                                             const float* wpe, int bt, int t, int c) {
    i64 n = (i64)bt * c;
    for (i64 i = gid(); i < n; i += gsize()) {
        int row = (int)(i / c), j = (int)(i % c);
        out[i] = wte[(i64)tokens[row] * c + j] + wpe[(i64)(row % t) * c + j];
    }
}

// dwte[token] += dout, dwpe[t] += dout
extern "C" __global__ void embedding_backward_weight(float* dwte, float* dwpe, const float* dout,
                                                     const u32* tokens, int bt, int t, int c) {
    int j = (int)gid();
    if (j >= c) return;
    for (int row = 0; row < bt; row++) {
        float g = dout[(i64)row * c + j];
        dwte[(i64)tokens[row] * c + j] += g;
        dwpe[(i64)(row % t) * c + j] += g;
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

// dwte[token] += dout
extern "C" __global__ void token_embedding_backward_weight(float* dwte, const float* dout,
                                                           const u32* tokens, int bt, int c) {
    int j = (int)gid();
    if (j >= c) return;
    for (int row = 0; row < bt; row++) dwte[(i64)tokens[row] * c + j] += dout[(i64)row * c + j];
}
