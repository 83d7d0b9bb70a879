/* SPDX-License-Identifier: MIT */
/* An out-of-tree user of an installed libmha_mpi (tests/install/run.sh builds it through
 * pkg-config mha_mpi and find_package(mha COMPONENTS mpi), then runs it under mpirun): every rank
 * attends causally to the whole sequence alone (mha_attention), then its zig-zag shard through
 * the ring (mha_ring_attention); its rows must agree within 1e-5 max|o| (the core's tolerance). */
#include <mha_mpi.h>

#include <math.h>
#include <stdio.h>

enum { N = 13, H = 2, D = 4 };

/* [1, heads, rows, D] row-major: element strides {batch, head, row}. */
static void contiguous(int64_t heads, int64_t rows, int64_t s[3]) {
    s[0] = heads * rows * D, s[1] = rows * D, s[2] = D;
}

/* Rank's share: 0 = its rows agree with the single-process output, 1 = not, 2 = an error. */
static int check(int p, int rank) {
    static float q[H * N * D], kv[N * D], o[H * N * D];
    static float lq[H * N * D], lkv[N * D], lo[H * N * D];
    for (int i = 0; i < H * N * D; ++i)
        q[i] = (float)((i * 7) % 11 - 5) * 0.2f;
    for (int i = 0; i < N * D; ++i)
        kv[i] = (float)((i * 5) % 9 - 4) * 0.25f;
    mha_attention_args a = {0}; /* K = V = kv, one kv head (MQA): causal self-attention */
    a.batch = 1, a.num_heads = H, a.num_kv_heads = 1, a.q_len = a.kv_len = N, a.head_dim = D;
    a.q = q, a.k = kv, a.v = kv, a.out = o;
    contiguous(H, N, a.q_strides), contiguous(1, N, a.k_strides), contiguous(1, N, a.v_strides);
    contiguous(H, N, a.out_strides);
    a.mask.causal = 1;
    mha_error err;
    const mha_ring_config cfg = {N, MHA_SHARD_ZIGZAG};
    int32_t nc = 0;
    int64_t start[2], len[2], rows[N], n = 0;
    if (mha_attention(&a, NULL, &err) != MHA_STATUS_OK ||
        mha_ring_shard(&cfg, p, rank, &nc, start, len, &err) != MHA_STATUS_OK) {
        fprintf(stderr, "consumer_mpi: %s\n", err.message);
        return 2;
    }
    for (int32_t c = 0; c < nc; ++c) /* the rank's rows: its chunks one after the other */
        for (int64_t i = start[c]; i < start[c] + len[c]; ++i)
            rows[n++] = i;
    for (int64_t i = 0; i < n; ++i)
        for (int64_t x = 0; x < D; ++x) {
            lkv[i * D + x] = kv[rows[i] * D + x];
            for (int64_t hh = 0; hh < H; ++hh)
                lq[(hh * n + i) * D + x] = q[(hh * N + rows[i]) * D + x];
        }
    mha_attention_args l = a;
    l.q_len = l.kv_len = n;
    l.q = lq, l.k = lkv, l.v = lkv, l.out = lo;
    contiguous(H, n, l.q_strides), contiguous(1, n, l.k_strides), contiguous(1, n, l.v_strides);
    contiguous(H, n, l.out_strides);
    if (mha_ring_attention(MPI_COMM_WORLD, &cfg, &l, NULL, &err) != MHA_STATUS_OK) {
        fprintf(stderr, "consumer_mpi: %s\n", err.message);
        return 2;
    }
    double diff = 0.0, big = 0.0;
    for (int64_t hh = 0; hh < H; ++hh)
        for (int64_t i = 0; i < n; ++i)
            for (int64_t x = 0; x < D; ++x) {
                const double ref = o[(hh * N + rows[i]) * D + x];
                diff = fmax(diff, fabs(lo[(hh * n + i) * D + x] - ref));
                big = fmax(big, fabs(ref));
            }
    return diff <= 1e-5 * big ? 0 : 1;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int p = 1, rank = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &p);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    const int mine = check(p, rank);
    int worst = 0;
    MPI_Allreduce(&mine, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (rank == 0)
        printf("consumer_mpi: libmha %s, ring attention on %d ranks: %s\n", mha_version(), p,
               worst == 0 ? "equals the single-process output" : "FAILED");
    MPI_Finalize();
    return worst;
}
