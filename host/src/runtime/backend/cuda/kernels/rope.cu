// Rotary position embeddings (the CPU backend's rope.rs): in each head of
// `hd` channels, channels i and i + hd/2 rotate by t * theta^(-2i/hd) at
// position t (the negative angle for the backward), angles in double
// rounded once to float cos/sin. A thread per (row, head, pair).

// x[b, t, heads, hd] rotated in place; sign = -1 for the inverse
extern "C" __global__ void rope(float* x, i64 rows, int t, int heads, int hd, double theta,
                                float sign) {
    int half = hd / 2;
    i64 n = rows * heads * half;
    for (i64 i = gid(); i < n; i += gsize()) {
        int pair = (int)(i % half);
        i64 head_row = i / half;  // (row, head)
        i64 row = head_row / heads;
        int pos = (int)(row % t);
        double freq = pow(theta, -(double)(2 * pair) / (double)hd);
        double angle = (double)pos * freq;
        float c = (float)cos(angle), s = sign * (float)sin(angle);
        float* h = x + head_row * hd;
        float a = h[pair], b = h[pair + half];
        h[pair] = a * c - b * s;
        h[pair + half] = b * c + a * s;
    }
}
