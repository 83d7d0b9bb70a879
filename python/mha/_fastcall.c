/* SPDX-License-Identifier: MIT */
/* mha._fastcall: the hot calls of the Python package without ctypes (docs/PYTHON.md, "Binding").
 *
 * ctypes serves the whole API (python/mha/_lib.py); this extension serves only the calls whose
 * Python overhead matters at small sizes: a layer's forward on a float32 C-contiguous input
 * without options (the NumPy API, on a buffer) and the PyTorch drop-in's inference forward (on
 * data pointers). Each entry point fills the C structs on the stack, releases the GIL for the
 * library call, and turns a non-OK status into mha.MhaError with the library's message, as
 * _lib.check does.
 *
 * It does not link libmha: bind() hands it the addresses of the functions of the library that
 * _lib.py loaded with ctypes, so there is one libmha in the process whatever MHA_LIBRARY says,
 * and a layer made through ctypes is run by the same code. mha.h is included for the types only.
 *
 * Arrays are read through the buffer protocol (no NumPy headers, no NumPy build dependency):
 * anything that is not a float32 C-contiguous buffer of the expected shape makes layer_forward
 * return NotImplemented, and the caller takes the general Python path (which converts or raises
 * the package's usual ValueError/TypeError). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <stdint.h>
#include <string.h>

#include "mha.h"

typedef mha_status (*layer_forward_fn)(const mha_layer *,
                                       const mha_forward_args *,
                                       const mha_exec *,
                                       mha_error *);
typedef const mha_config *(*layer_config_fn)(const mha_layer *);
typedef const char *(*status_string_fn)(mha_status);

/* Set once by bind() (module state would be the multi-interpreter way; the package binds once). */
static layer_forward_fn g_forward;
static layer_config_fn g_config;
static status_string_fn g_status_string;
static PyObject *g_error_type; /* mha.MhaError */
static PyObject *g_empty;      /* numpy.empty */
static PyObject *g_float32;    /* numpy.dtype("float32") */

/* A function address from Python (an int, as ctypes.cast(f, c_void_p).value gives). memcpy,
 * not a cast: ISO C has no conversion between object and function pointers. */
static int get_fn(PyObject *addr, void *fn, size_t fn_size) {
    void *p = PyLong_AsVoidPtr(addr);
    if (p == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "mha._fastcall.bind: NULL function address");
        }
        return -1;
    }
    if (fn_size != sizeof p) {
        PyErr_SetString(PyExc_RuntimeError, "mha._fastcall: function pointers differ in size");
        return -1;
    }
    memcpy(fn, &p, sizeof p);
    return 0;
}

/* The preamble of an entry point: `want` arguments (else TypeError with its usage line) and
 * bind() called. 0, or -1 with the exception set. */
static int entry(Py_ssize_t nargs, Py_ssize_t want, const char *usage) {
    if (nargs != want) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    if (g_forward == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "mha._fastcall: bind() was not called");
        return -1;
    }
    return 0;
}

/* Raises MhaError(status, message) as _lib.check does; returns NULL. */
static PyObject *raise_status(mha_status status, mha_error *err) {
    err->message[sizeof err->message - 1] = '\0';
    const char *msg = err->message[0] ? err->message : g_status_string(status);
    PyObject *text = PyUnicode_DecodeUTF8(msg, (Py_ssize_t)strlen(msg), "replace");
    if (text == NULL) {
        return NULL;
    }
    PyObject *exc = PyObject_CallFunction(g_error_type, "iO", (int)status, text);
    Py_DECREF(text);
    if (exc != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    return NULL;
}

/* An integer argument that is a pointer (int; None or 0 = NULL). */
static int get_ptr(PyObject *o, void **p) {
    if (o == Py_None) {
        *p = NULL;
        return 0;
    }
    *p = PyLong_AsVoidPtr(o);
    return (*p == NULL && PyErr_Occurred()) ? -1 : 0;
}

static int get_i64(PyObject *o, int64_t *v) {
    long long x = PyLong_AsLongLong(o);
    if (x == -1 && PyErr_Occurred()) {
        return -1;
    }
    *v = (int64_t)x;
    return 0;
}

/* The layer address argument of entry point `fn`: an int, not 0 (ValueError). */
static int get_layer(PyObject *o, const char *fn, const mha_layer **layer) {
    void *p;
    if (get_ptr(o, &p)) {
        return -1;
    }
    if (p == NULL) {
        PyErr_Format(PyExc_ValueError, "%s: NULL layer", fn);
        return -1;
    }
    *layer = p;
    return 0;
}

/* threads: passed to the library as it is (an int32, as the ctypes path passes it). */
static int get_threads(PyObject *o, int32_t *threads) {
    long long t = PyLong_AsLongLong(o);
    if (t == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (t < INT32_MIN || t > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "threads=%lld does not fit in an int32", t);
        return -1;
    }
    *threads = (int32_t)t;
    return 0;
}

/* Inputs of at least this many floats run with the allocator they are given (the process's
 * mha_block_cache): their workspace (4-8x the input, 39 MB at (2048, 1024, 16)) is then reused
 * instead of being faulted in fresh every call, which glibc's malloc does for blocks beyond its
 * mmap threshold (at most 32 MiB): (2048, 1024, 16) ran 1.01-1.13x faster on 1 thread on AMD
 * Zen 4. Smaller calls keep malloc, which serves them from its heap; the cache's lock and search
 * would cost them ~0.5 us a call. */
#define FAST_CACHE_MIN_FLOATS ((int64_t)1 << 18)

/* The one entry both calls share: self-attention mha_layer_forward without masks, positions or
 * dropout, query [batch, n, q_dim] -> out [batch, n, out_dim] and, unless NULL, probs
 * [batch, h, n, n] ([batch, n, n] if average), with the GIL released. The structs are filled as
 * the general path's python/mha/_marshal.py fills them (forward_args, exec_struct): zero, then
 * the window (-1, -1), the sizes and pointers, impl, threads, the pool and, for inputs of
 * FAST_CACHE_MIN_FLOATS or more, the allocator (addresses from _marshal.pool_for and
 * _marshal.block_cache_allocator, or None). c is the layer's mha_layer_config (the caller has it
 * already), or NULL. dtype is the storage of query and out (mha_forward_args.x_dtype and
 * out_dtype; the library checks the value). 0, or -1 with MhaError set. */
static int self_forward(const mha_layer *layer,
                        const mha_config *c,
                        int64_t batch,
                        int64_t n,
                        mha_dtype dtype,
                        const void *query,
                        void *out,
                        float *probs,
                        int average,
                        mha_impl impl,
                        int32_t threads,
                        mha_threadpool *pool,
                        const mha_allocator *allocator) {
    mha_forward_args a;
    memset(&a, 0, sizeof a);
    a.mask.window_left = -1;
    a.mask.window_right = -1;
    a.batch = batch;
    a.q_len = n;
    a.kv_len = n;
    a.query = query;
    a.out = out;
    a.x_dtype = dtype;
    a.out_dtype = dtype;
    a.probs = probs;
    a.average_probs = average;
    mha_exec ex;
    memset(&ex, 0, sizeof ex); /* every field after these two: its default */
    ex.impl = impl;
    ex.n_threads = threads;
    ex.pool = pool;
    const double floats = (double)batch * (double)n * (double)(c ? c->q_dim : 0);
    ex.allocator = floats >= (double)FAST_CACHE_MIN_FLOATS ? allocator : NULL;
    mha_error err;
    err.message[0] = '\0';
    PyThreadState *ts = PyEval_SaveThread(); /* Py_BEGIN_ALLOW_THREADS */
    mha_status st = g_forward(layer, &a, &ex, &err);
    PyEval_RestoreThread(ts); /* Py_END_ALLOW_THREADS */
    if (st != MHA_STATUS_OK) {
        raise_status(st, &err);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(bind_doc,
             "bind(functions, error_type, empty, float32)\n--\n\n"
             "functions: addresses of mha_layer_forward, mha_layer_config and\n"
             "mha_status_string in the library loaded by mha._lib (ints);\n"
             "error_type: mha.MhaError; empty and float32:\n"
             "numpy.empty and numpy.dtype('float32') for layer_forward's output.");

static PyObject *bind(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4 || !PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) != 3) {
        PyErr_SetString(PyExc_TypeError,
                        "bind(functions: tuple of 3 addresses, error_type, empty, float32)");
        return NULL;
    }
    PyObject *const *f = &PyTuple_GET_ITEM(args[0], 0);
    layer_forward_fn fwd;
    layer_config_fn config;
    status_string_fn status_string;
    if (get_fn(f[0], &fwd, sizeof fwd) || get_fn(f[1], &config, sizeof config) ||
        get_fn(f[2], &status_string, sizeof status_string)) {
        return NULL;
    }
    if (!PyCallable_Check(args[1]) || !PyCallable_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "bind: error_type and empty must be callable");
        return NULL;
    }
    Py_INCREF(args[1]);
    Py_INCREF(args[2]);
    Py_INCREF(args[3]);
    Py_XSETREF(g_error_type, args[1]);
    Py_XSETREF(g_empty, args[2]);
    Py_XSETREF(g_float32, args[3]);
    g_forward = fwd;
    g_config = config;
    g_status_string = status_string;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(layer_forward_doc,
             "layer_forward(layer, x, impl, threads, pool, allocator)\n--\n\n"
             "Self-attention forward of the layer at address `layer` on x, a float32\n"
             "C-contiguous buffer [B, n, q_dim] or [n, q_dim], without masks, positions or\n"
             "dropout (mha_layer_forward). Returns a new float32 array [B, n, out_dim] (or\n"
             "[n, out_dim]), or NotImplemented when x is not such a buffer, the layer is not a\n"
             "self-attention layer, or threads is not an int >= 0: the caller then takes the\n"
             "general path. pool and allocator: addresses (or None) for mha_exec. Raises\n"
             "MhaError for a library error.");

static PyObject *layer_forward(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    const mha_layer *layer;
    void *pool, *allocator;
    if (entry(nargs, 6, "layer_forward(layer, x, impl, threads, pool, allocator)") ||
        get_layer(args[0], "layer_forward", &layer) || get_ptr(args[4], &pool) ||
        get_ptr(args[5], &allocator)) {
        return NULL;
    }
    int overflow_impl = 0, overflow_threads = 0; /* on overflow the value read is -1 */
    long impl = PyLong_Check(args[2]) ? PyLong_AsLongAndOverflow(args[2], &overflow_impl) : -1;
    long long threads =
        PyLong_CheckExact(args[3]) ? PyLong_AsLongLongAndOverflow(args[3], &overflow_threads) : -1;
    if (impl < 0 || impl > INT_MAX || threads < 0 || threads > INT32_MAX) {
        Py_RETURN_NOTIMPLEMENTED; /* the general path validates (and raises) */
    }
    const mha_config *c = g_config(layer);
    if (c == NULL || c->k_dim != c->q_dim || c->v_dim != c->q_dim) {
        Py_RETURN_NOTIMPLEMENTED;
    }
    Py_buffer x;
    if (PyObject_GetBuffer(args[1], &x, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
        PyErr_Clear(); /* not a buffer, or not C-contiguous: the general path converts */
        Py_RETURN_NOTIMPLEMENTED;
    }
    PyObject *out = NULL;
    if (x.itemsize != 4 || x.format == NULL || strcmp(x.format, "f") != 0 ||
        (x.ndim != 2 && x.ndim != 3) || x.shape[x.ndim - 1] != c->q_dim) {
        PyBuffer_Release(&x);
        Py_RETURN_NOTIMPLEMENTED;
    }
    PyObject *shape = x.ndim == 3
                          ? Py_BuildValue("(nnL)", x.shape[0], x.shape[1], (long long)c->out_dim)
                          : Py_BuildValue("(nL)", x.shape[0], (long long)c->out_dim);
    if (shape != NULL) {
        PyObject *call_args[2] = {shape, g_float32};
        out = PyObject_Vectorcall(g_empty, call_args, 2, NULL);
        Py_DECREF(shape);
    }
    if (out == NULL) {
        PyBuffer_Release(&x);
        return NULL;
    }
    Py_buffer o;
    if (PyObject_GetBuffer(out, &o, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0) {
        PyBuffer_Release(&x);
        Py_DECREF(out);
        return NULL;
    }
    const int failed =
        self_forward(layer, c, x.ndim == 3 ? x.shape[0] : 1, x.shape[x.ndim - 2], MHA_DTYPE_F32,
                     x.buf, o.buf, NULL, 0, (mha_impl)impl, (int32_t)threads, pool, allocator);
    PyBuffer_Release(&o);
    PyBuffer_Release(&x);
    if (failed) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

PyDoc_STRVAR(
    layer_call_doc,
    "layer_call(layer, batch, n, query, out, probs, average, threads, pool, allocator, dtype)\n"
    "--\n\n"
    "Self-attention mha_layer_forward on data pointers (ints; probs may be None), without\n"
    "masks, positions or dropout: query [batch, n, q_dim], out [batch, n, out_dim] in the\n"
    "storage dtype `dtype` (an mha_dtype code: float32, bfloat16, float16), float32 probs\n"
    "[batch, h, n, n] (or [batch, n, n] if average). The caller guarantees the buffers\n"
    "(the PyTorch drop-in, which checks its input and allocates the outputs). Returns\n"
    "None; raises MhaError for a library error.");

static PyObject *layer_call(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (entry(nargs, 11,
              "layer_call(layer, batch, n, query, out, probs, average, threads, pool, allocator, "
              "dtype)")) {
        return NULL;
    }
    const mha_layer *layer;
    void *query, *out, *probs, *pool, *allocator;
    int64_t batch, n, dtype;
    int32_t threads;
    int average = PyObject_IsTrue(args[6]);
    if (average < 0 || get_layer(args[0], "layer_call", &layer) || get_i64(args[1], &batch) ||
        get_i64(args[2], &n) || get_ptr(args[3], &query) || get_ptr(args[4], &out) ||
        get_ptr(args[5], &probs) || get_threads(args[7], &threads) || get_ptr(args[8], &pool) ||
        get_ptr(args[9], &allocator) || get_i64(args[10], &dtype)) {
        return NULL;
    }
    if (self_forward(layer, g_config(layer), batch, n, (mha_dtype)dtype, query, out, probs, average,
                     MHA_IMPL_AUTO, threads, pool, allocator)) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL, bind_doc},
    {"layer_forward", (PyCFunction)(void (*)(void))layer_forward, METH_FASTCALL, layer_forward_doc},
    {"layer_call", (PyCFunction)(void (*)(void))layer_call, METH_FASTCALL, layer_call_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "mha._fastcall",
    "The hot calls of mha without ctypes (see python/mha/_fastcall.c).",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__fastcall(void);

PyMODINIT_FUNC PyInit__fastcall(void) {
    return PyModule_Create(&module);
}
