/* SPDX-License-Identifier: MIT */
/* fcomm.c: the entry points of mha_mpi.h that take a communicator by its Fortran handle
 * (MPI_Comm_c2f, mpi4py's Comm.py2f()), for callers that cannot name an MPI_Comm: an MPI_Comm is
 * a pointer in Open MPI and an int in MPICH, so a foreign-function binding (Python's ctypes)
 * cannot pass one portably, while the Fortran handle is an integer in every MPI. The handle is
 * turned back into the C communicator with MPI_Comm_f2c (MPI's own, portable conversion) and the
 * call is the C entry point's, unchanged. */
#include "mha_mpi.h"

#include <stdio.h>

/* The communicator of Fortran handle comm_f, or MPI_COMM_NULL (err set) when the handle is out
 * of MPI_Fint's range, MPI is not initialized, or the handle is MPI_COMM_NULL's. The checks are
 * local: with no communicator there is no one to agree with. */
static MPI_Comm comm_from_f(int64_t comm_f, const char *fn, mha_error *err) {
    int up = 0, down = 0;
    MPI_Initialized(&up);
    MPI_Finalized(&down);
    const char *why = NULL;
    MPI_Comm comm = MPI_COMM_NULL;
    if (!up || down)
        why = "MPI is not initialized (or already finalized)";
    else if ((int64_t)(MPI_Fint)comm_f != comm_f)
        why = "the handle does not fit MPI_Fint";
    else if ((comm = MPI_Comm_f2c((MPI_Fint)comm_f)) == MPI_COMM_NULL)
        why = "the handle is MPI_COMM_NULL";
    if (why && err) {
        err->status = MHA_STATUS_INVALID_ARG;
        snprintf(err->message, sizeof err->message, "%s: comm_f=%lld: %s", fn, (long long)comm_f,
                 why);
    }
    return why ? MPI_COMM_NULL : comm;
}

mha_status mha_ring_attention_fcomm(int64_t comm_f,
                                    const mha_ring_config *cfg,
                                    const mha_attention_args *local,
                                    const mha_exec *exec,
                                    mha_error *err) {
    const MPI_Comm comm = comm_from_f(comm_f, "mha_ring_attention_fcomm", err);
    if (comm == MPI_COMM_NULL)
        return MHA_STATUS_INVALID_ARG;
    return mha_ring_attention(comm, cfg, local, exec, err);
}

mha_status mha_ring_attention_backward_fcomm(int64_t comm_f,
                                             const mha_ring_config *cfg,
                                             const mha_attention_args *local,
                                             const mha_attention_grads *grads,
                                             const mha_exec *exec,
                                             mha_error *err) {
    const MPI_Comm comm = comm_from_f(comm_f, "mha_ring_attention_backward_fcomm", err);
    if (comm == MPI_COMM_NULL)
        return MHA_STATUS_INVALID_ARG;
    return mha_ring_attention_backward(comm, cfg, local, grads, exec, err);
}

mha_status mha_ring_layer_forward_fcomm(int64_t comm_f,
                                        const mha_ring_config *cfg,
                                        const mha_layer *layer,
                                        const mha_forward_args *local,
                                        const mha_exec *exec,
                                        mha_error *err) {
    const MPI_Comm comm = comm_from_f(comm_f, "mha_ring_layer_forward_fcomm", err);
    if (comm == MPI_COMM_NULL)
        return MHA_STATUS_INVALID_ARG;
    return mha_ring_layer_forward(comm, cfg, layer, local, exec, err);
}

mha_status mha_ring_layer_backward_fcomm(int64_t comm_f,
                                         const mha_ring_config *cfg,
                                         const mha_layer *layer,
                                         const mha_forward_args *local,
                                         const float *dy,
                                         const mha_layer_grads *grads,
                                         const mha_exec *exec,
                                         mha_error *err) {
    const MPI_Comm comm = comm_from_f(comm_f, "mha_ring_layer_backward_fcomm", err);
    if (comm == MPI_COMM_NULL)
        return MHA_STATUS_INVALID_ARG;
    return mha_ring_layer_backward(comm, cfg, layer, local, dy, grads, exec, err);
}
