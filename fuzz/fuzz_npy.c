/* SPDX-License-Identifier: MIT */
/* fuzz_npy.c: libFuzzer harness for the .npy reader. The input is a whole .npy image given to
 * mha__npy_parse(). Invariants: no crash, leak or out-of-bounds access (ASan/UBSan); an error
 * fills mha_error consistently and leaves the result empty; a success describes exactly the bytes
 * after the header (shape product = count, every element readable), and float arrays convert.
 */
#include "fuzz_common.h"
#include "npy.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    mha__npy a;
    mha_error err;
    memset(&err, 0, sizeof err);
    mha_status st = mha__npy_parse(data, size, "fuzz.npy", &a, &err);
    if (st != MHA_STATUS_OK) {
        fuzz_check_error(st, &err);
        FUZZ_REQUIRE(a.data == NULL && a.count == 0 && a.ndim == 0, "result not empty on error");
        return 0;
    }
    FUZZ_REQUIRE(err.status == MHA_STATUS_OK, "err not reset on success");
    FUZZ_REQUIRE(a.ndim >= 0 && a.ndim <= MHA_NPY_MAX_DIMS, "ndim %d", (int)a.ndim);
    int64_t count = 1;
    for (int32_t i = 0; i < a.ndim; i++) {
        FUZZ_REQUIRE(a.shape[i] >= 0, "negative dim");
        count *= a.shape[i]; /* cannot overflow: the data exist in `data` */
    }
    FUZZ_REQUIRE(count == a.count, "count %lld != shape product %lld", (long long)a.count,
                 (long long)count);
    const size_t es = mha_dtype_size(a.dtype);
    FUZZ_REQUIRE(es > 0 && (size_t)a.count * es <= size, "data larger than the input");
    FUZZ_REQUIRE(a.data != NULL, "no data buffer");
    /* Touch every byte (ASan checks the allocation is as large as claimed). */
    const unsigned char *b = a.data;
    unsigned sum = 0;
    for (size_t i = 0; i < (size_t)a.count * es; i++)
        sum += b[i];
    (void)sum;
    if (a.dtype == MHA_DTYPE_F32 || a.dtype == MHA_DTYPE_F64 || a.dtype == MHA_DTYPE_F16 ||
        a.dtype == MHA_DTYPE_BF16) {
        float *f = NULL;
        st = mha__npy_to_f32(&a, "fuzz.npy", &f, &err);
        FUZZ_REQUIRE(st == MHA_STATUS_OK, "to_f32 failed: %s", err.message);
        if (a.count > 0)
            FUZZ_REQUIRE(f != NULL, "to_f32 gave NULL");
        free(f);
        /* and to each half (mha run --dtype): any bit pattern converts, NaN and Inf included */
        for (int h = 0; h < 2; h++) {
            void *d = NULL;
            st = mha__npy_to_dtype(&a, h ? MHA_DTYPE_F16 : MHA_DTYPE_BF16, "fuzz.npy", &d, &err);
            FUZZ_REQUIRE(st == MHA_STATUS_OK, "to_dtype failed: %s", err.message);
            free(d);
        }
    }
    mha__npy_free(&a);
    return 0;
}
