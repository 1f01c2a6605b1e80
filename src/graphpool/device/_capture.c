/* graphpool.device._capture: the CUDA calls the allocator makes on every allocation, in C.
 *
 * Three things, all through the CUDA driver API loaded with dlopen (no CUDA headers or
 * toolkit are needed to build this, so it builds wherever Python extensions do):
 *
 *   capture_id(stream)           the id of the capture `stream` takes part in, 0 if none
 *                                (one cuStreamGetCaptureInfo; the legacy stream 0 never
 *                                captures and costs no call)
 *   attach_release(stream, tok)  a CUDA user object moved into the graph being captured on
 *                                `stream`; its destructor, which runs when that graph and
 *                                every exec made from it are destroyed, queues `tok`
 *   take_released()              the queued tokens, drained
 *   stream_idle(stream)          whether `stream` is not capturing and has finished all its
 *                                work (cuStreamGetCaptureInfo, then cuStreamQuery under the
 *                                relaxed capture mode); the caller passes only live streams
 *   graph_launch(exec, stream, ctx)  cuGraphLaunch, if `ctx` is the thread's current context
 *                                (True); False, launching nothing, if it is not (the caller
 *                                then makes its device current and launches the slow way)
 *   current_context()            the thread's current context (cuCtxGetCurrent), 0 if none
 *   query_address()              the address of a C function answering capture_id without
 *                                the GIL (the PyTorch shim's lane calls it)
 *
 * The destructor may run on a driver thread, or at process exit after the interpreter is
 * gone: it touches no Python object, only a mutex-protected array of integers.
 *
 * Errors: a failing driver call raises the exception built by the Python callable given to
 * load(): factory(call_name, CUresult) (graphpool.errors.CUDAError through device/cuda.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#ifdef _WIN32
#include <windows.h>
#else
#include <dlfcn.h>
#include <pthread.h>
#endif

#include <stdint.h>
#include <stdlib.h>

typedef int CUresult;
typedef void *CUstream;
typedef void *CUgraph;
typedef void *CUgraphNode;
typedef void *CUuserObject;
typedef void (*CUhostFn)(void *);

enum { CU_STREAM_CAPTURE_STATUS_NONE = 0, CU_STREAM_CAPTURE_STATUS_ACTIVE = 1 };
enum { CU_USER_OBJECT_NO_DESTRUCTOR_SYNC = 1, CU_GRAPH_USER_OBJECT_MOVE = 1 };

/* cuStreamGetCaptureInfo as of CUDA 12.0 (the "_v2" signature). */
typedef CUresult (*get_capture_info_t)(CUstream, int *, unsigned long long *, CUgraph *,
                                       const CUgraphNode **, size_t *);
typedef CUresult (*user_object_create_t)(CUuserObject *, void *, CUhostFn, unsigned int, unsigned int);
typedef CUresult (*user_object_release_t)(CUuserObject, unsigned int);
typedef CUresult (*graph_retain_user_object_t)(CUgraph, CUuserObject, unsigned int, unsigned int);
typedef CUresult (*stream_query_t)(CUstream);
typedef CUresult (*exchange_mode_t)(int *);
typedef CUresult (*init_t)(unsigned int);
typedef void *CUgraphExec;
typedef void *CUcontext;
typedef CUresult (*graph_launch_t)(CUgraphExec, CUstream);
typedef CUresult (*ctx_get_current_t)(CUcontext *);
typedef CUresult (*get_proc_address_v2_t)(const char *, void **, int, unsigned long long, int *);
typedef CUresult (*get_proc_address_t)(const char *, void **, int, unsigned long long);

static get_capture_info_t p_get_capture_info = NULL;
static user_object_create_t p_user_object_create = NULL;
static user_object_release_t p_user_object_release = NULL;
static graph_retain_user_object_t p_graph_retain_user_object = NULL;
static stream_query_t p_stream_query = NULL;
static exchange_mode_t p_exchange_mode = NULL;
static graph_launch_t p_graph_launch = NULL;        /* optional: NULL keeps the slow launch */
static ctx_get_current_t p_ctx_get_current = NULL;
static PyObject *error_factory = NULL; /* factory(call, code) -> exception instance */

/* ------------------------------------------------------------ released tokens */
#ifdef _WIN32
static CRITICAL_SECTION released_lock;
static int released_lock_ready = 0;
#define LOCK() EnterCriticalSection(&released_lock)
#define UNLOCK() LeaveCriticalSection(&released_lock)
#else
static pthread_mutex_t released_lock = PTHREAD_MUTEX_INITIALIZER;
#define LOCK() pthread_mutex_lock(&released_lock)
#define UNLOCK() pthread_mutex_unlock(&released_lock)
#endif
static uint64_t *released = NULL;
static size_t released_len = 0, released_cap = 0;
static size_t released_lost = 0; /* tokens dropped for want of memory (reported, never silent) */

static void on_destroy(void *token) {
    LOCK();
    if (released_len == released_cap) {
        size_t cap = released_cap ? released_cap * 2 : 64;
        uint64_t *grown = (uint64_t *)realloc(released, cap * sizeof(uint64_t));
        if (grown == NULL) {
            released_lost++;
            UNLOCK();
            return;
        }
        released = grown;
        released_cap = cap;
    }
    released[released_len++] = (uint64_t)(uintptr_t)token;
    UNLOCK();
}

/* ------------------------------------------------------------ helpers */
static PyObject *raise_cuda(const char *call, CUresult code) {
    if (error_factory != NULL) {
        PyObject *exc = PyObject_CallFunction(error_factory, "si", call, (int)code);
        if (exc != NULL) {
            PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
            Py_DECREF(exc);
        }
        return NULL;
    }
    PyErr_Format(PyExc_RuntimeError, "%s failed: CUresult %d", call, (int)code);
    return NULL;
}

static int not_loaded(void) {
    if (p_get_capture_info == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "graphpool.device._capture: call load() first");
        return 1;
    }
    return 0;
}

/* A stream handle from Python: an int in [0, 2**64). Anything else is a TypeError or an
 * OverflowError, never a crash. */
static int stream_arg(PyObject *arg, CUstream *out) {
    if (!PyLong_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "stream must be an int handle, not %.100s", Py_TYPE(arg)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(arg);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = (CUstream)(uintptr_t)v;
    return 0;
}

static void *find(void *lib, const char *name) {
#ifdef _WIN32
    return (void *)GetProcAddress((HMODULE)lib, name);
#else
    return dlsym(lib, name);
#endif
}

/* ------------------------------------------------------------ module functions */
static PyObject *load(PyObject *self, PyObject *factory) {
    if (p_get_capture_info != NULL)
        Py_RETURN_NONE;
    if (factory != Py_None) {
        PyObject *old = error_factory;
        Py_INCREF(factory);
        error_factory = factory;
        Py_XDECREF(old);
    }
#ifdef _WIN32
    if (!released_lock_ready) {
        InitializeCriticalSection(&released_lock);
        released_lock_ready = 1;
    }
    void *lib = (void *)LoadLibraryA("nvcuda.dll");
#else
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
#endif
    if (lib == NULL)
        return PyUnicode_FromString("the CUDA driver library (libcuda.so.1) could not be loaded");
    init_t p_init = (init_t)find(lib, "cuInit");
    if (p_init == NULL)
        return PyUnicode_FromString("cuInit not found in the CUDA driver");
    CUresult rc = p_init(0);
    if (rc != 0)
        return PyUnicode_FromFormat("cuInit failed: CUresult %d", (int)rc);
    void *fn = NULL;
    get_proc_address_v2_t gpa2 = (get_proc_address_v2_t)find(lib, "cuGetProcAddress_v2");
    if (gpa2 != NULL) {
        int status = 0;
        if (gpa2("cuStreamGetCaptureInfo", &fn, 12000, 0, &status) != 0)
            fn = NULL;
    }
    if (fn == NULL) {
        get_proc_address_t gpa = (get_proc_address_t)find(lib, "cuGetProcAddress");
        if (gpa != NULL && gpa("cuStreamGetCaptureInfo", &fn, 12000, 0) != 0)
            fn = NULL;
    }
    if (fn == NULL)
        fn = find(lib, "cuStreamGetCaptureInfo_v2");
    p_user_object_create = (user_object_create_t)find(lib, "cuUserObjectCreate");
    p_user_object_release = (user_object_release_t)find(lib, "cuUserObjectRelease");
    p_graph_retain_user_object = (graph_retain_user_object_t)find(lib, "cuGraphRetainUserObject");
    p_stream_query = (stream_query_t)find(lib, "cuStreamQuery");
    p_exchange_mode = (exchange_mode_t)find(lib, "cuThreadExchangeStreamCaptureMode");
    p_graph_launch = (graph_launch_t)find(lib, "cuGraphLaunch");
    p_ctx_get_current = (ctx_get_current_t)find(lib, "cuCtxGetCurrent");
    if (p_graph_launch == NULL || p_ctx_get_current == NULL)
        p_graph_launch = NULL, p_ctx_get_current = NULL;
    if (fn == NULL || p_user_object_create == NULL || p_user_object_release == NULL ||
        p_graph_retain_user_object == NULL || p_stream_query == NULL || p_exchange_mode == NULL)
        return PyUnicode_FromString("the CUDA driver lacks capture info or user objects (CUDA >= 11.3)");
    p_get_capture_info = (get_capture_info_t)fn;
    Py_RETURN_NONE;
}

/* capture_id for C callers without the GIL (the PyTorch shim's lane, _torch_shim.cpp):
 * 0 and *id (0: not capturing), or nonzero when the query fails or the driver is not loaded. */
static int query_capture(void *stream, unsigned long long *id) {
    if (p_get_capture_info == NULL)
        return -1;
    *id = 0;
    if (stream == NULL)
        return 0;
    int status = 0;
    unsigned long long cid = 0;
    CUresult rc = p_get_capture_info((CUstream)stream, &status, &cid, NULL, NULL, NULL);
    if (rc != 0)
        return (int)rc;
    *id = status == CU_STREAM_CAPTURE_STATUS_NONE ? 0ULL : (cid != 0 ? cid : 1ULL);
    return 0;
}

static PyObject *query_address(PyObject *self, PyObject *unused) {
    if (not_loaded())
        return NULL;
    return PyLong_FromVoidPtr((void *)&query_capture);
}

static PyObject *capture_id(PyObject *self, PyObject *arg) {
    CUstream s;
    if (stream_arg(arg, &s) < 0 || not_loaded())
        return NULL;
    if (s == NULL)
        return PyLong_FromLong(0); /* the legacy stream never captures */
    int status = 0;
    unsigned long long id = 0;
    CUresult rc = p_get_capture_info(s, &status, &id, NULL, NULL, NULL);
    if (rc != 0)
        return raise_cuda("cuStreamGetCaptureInfo", rc);
    return PyLong_FromUnsignedLongLong(status == CU_STREAM_CAPTURE_STATUS_NONE ? 0ULL : id);
}

enum { CU_STREAM_CAPTURE_MODE_RELAXED = 2, CUDA_ERROR_NOT_READY = 600 };

static PyObject *stream_idle(PyObject *self, PyObject *arg) {
    CUstream s;
    if (stream_arg(arg, &s) < 0 || not_loaded())
        return NULL;
    if (s == NULL)
        Py_RETURN_FALSE; /* the legacy stream's status would cover other streams' captures */
    int status = 0;
    unsigned long long id = 0;
    CUresult rc = p_get_capture_info(s, &status, &id, NULL, NULL, NULL);
    if (rc != 0)
        return raise_cuda("cuStreamGetCaptureInfo", rc);
    if (status != CU_STREAM_CAPTURE_STATUS_NONE)
        Py_RETURN_FALSE; /* a query would invalidate the capture */
    int mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    rc = p_exchange_mode(&mode);
    if (rc != 0)
        return raise_cuda("cuThreadExchangeStreamCaptureMode", rc);
    CUresult q = p_stream_query(s);
    rc = p_exchange_mode(&mode); /* the thread's own mode back, whatever the query gave */
    if (rc != 0)
        return raise_cuda("cuThreadExchangeStreamCaptureMode", rc);
    if (q == 0)
        Py_RETURN_TRUE;
    if (q == CUDA_ERROR_NOT_READY)
        Py_RETURN_FALSE;
    return raise_cuda("cuStreamQuery", q);
}

static PyObject *attach_release(PyObject *self, PyObject *args) {
    PyObject *stream_obj;
    unsigned long long token;
    if (!PyArg_ParseTuple(args, "OK:attach_release", &stream_obj, &token))
        return NULL;
    CUstream s;
    if (stream_arg(stream_obj, &s) < 0 || not_loaded())
        return NULL;
    if (token == 0) {
        PyErr_SetString(PyExc_ValueError, "token must be a positive int");
        return NULL;
    }
    int status = 0;
    unsigned long long id = 0;
    CUgraph graph = NULL;
    CUresult rc = p_get_capture_info(s, &status, &id, &graph, NULL, NULL);
    if (rc != 0)
        return raise_cuda("cuStreamGetCaptureInfo", rc);
    if (status != CU_STREAM_CAPTURE_STATUS_ACTIVE || graph == NULL)
        return raise_cuda("cuGraphRetainUserObject", 401 /* CUDA_ERROR_ILLEGAL_STATE */);
    CUuserObject obj = NULL;
    rc = p_user_object_create(&obj, (void *)(uintptr_t)token, on_destroy, 1,
                              CU_USER_OBJECT_NO_DESTRUCTOR_SYNC);
    if (rc != 0)
        return raise_cuda("cuUserObjectCreate", rc);
    rc = p_graph_retain_user_object(graph, obj, 1, CU_GRAPH_USER_OBJECT_MOVE);
    if (rc != 0) {
        /* not moved into the graph: drop our reference (the token is then reported, and the
           caller, which registered nothing under it, ignores it) */
        p_user_object_release(obj, 1);
        return raise_cuda("cuGraphRetainUserObject", rc);
    }
    Py_RETURN_NONE;
}

static PyObject *take_released(PyObject *self, PyObject *unused) {
    LOCK();
    size_t n = released_len;
    uint64_t *copy = NULL;
    if (n) {
        copy = (uint64_t *)malloc(n * sizeof(uint64_t));
        if (copy != NULL) {
            for (size_t i = 0; i < n; i++)
                copy[i] = released[i];
            released_len = 0;
        }
    }
    UNLOCK();
    if (n && copy == NULL)
        return PyErr_NoMemory();
    PyObject *out = PyList_New((Py_ssize_t)n);
    if (out == NULL) {
        free(copy);
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(copy[i]);
        if (v == NULL) {
            free(copy);
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, v);
    }
    free(copy);
    return out;
}

static PyObject *lost(PyObject *self, PyObject *unused) {
    LOCK();
    size_t n = released_lost;
    UNLOCK();
    return PyLong_FromSize_t(n);
}

/* An int argument in [0, 2**64) as a pointer-sized value; -1 with an exception otherwise. */
static int handle_arg(PyObject *arg, const char *what, uintptr_t *out) {
    if (!PyLong_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int handle, not %.100s", what, Py_TYPE(arg)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(arg);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = (uintptr_t)v;
    return 0;
}

static PyObject *graph_launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "graph_launch(exec, stream, ctx) takes 3 arguments");
        return NULL;
    }
    uintptr_t exec, stream, ctx;
    if (handle_arg(args[0], "exec", &exec) < 0 || handle_arg(args[1], "stream", &stream) < 0 ||
        handle_arg(args[2], "ctx", &ctx) < 0 || not_loaded())
        return NULL;
    if (p_graph_launch == NULL || exec == 0 || ctx == 0)
        Py_RETURN_FALSE;
    CUcontext cur = NULL;
    CUresult rc = p_ctx_get_current(&cur);
    if (rc != 0)
        return raise_cuda("cuCtxGetCurrent", rc);
    if ((uintptr_t)cur != ctx)
        Py_RETURN_FALSE; /* another device (or context) is current: the caller switches */
    rc = p_graph_launch((CUgraphExec)exec, (CUstream)stream);
    if (rc != 0)
        return raise_cuda("cuGraphLaunch", rc);
    Py_RETURN_TRUE;
}

static PyObject *current_context(PyObject *self, PyObject *unused) {
    if (not_loaded())
        return NULL;
    if (p_ctx_get_current == NULL)
        return PyLong_FromLong(0);
    CUcontext cur = NULL;
    CUresult rc = p_ctx_get_current(&cur);
    if (rc != 0)
        return raise_cuda("cuCtxGetCurrent", rc);
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)cur);
}

static PyMethodDef methods[] = {
    {"load", load, METH_O,
     "load(error_factory) -> None or str: open the CUDA driver; a str says why it could not."},
    {"capture_id", capture_id, METH_O,
     "capture_id(stream) -> int: the id of the capture the stream takes part in, 0 if none."},
    {"attach_release", attach_release, METH_VARARGS,
     "attach_release(stream, token): a user object in the graph being captured on stream; "
     "take_released() reports token once that graph and its execs are destroyed."},
    {"take_released", take_released, METH_NOARGS,
     "take_released() -> list[int]: tokens whose graphs were destroyed since the last call."},
    {"lost", lost, METH_NOARGS, "lost() -> int: tokens dropped for want of memory (should be 0)."},
    {"stream_idle", stream_idle, METH_O,
     "stream_idle(stream) -> bool: not capturing and all its work done (a live stream only)."},
    {"graph_launch", (PyCFunction)(void (*)(void))graph_launch, METH_FASTCALL,
     "graph_launch(exec, stream, ctx) -> bool: cuGraphLaunch if ctx is the current context; "
     "False (nothing launched) if it is not."},
    {"query_address", query_address, METH_NOARGS,
     "query_address() -> int: the address of int query(void *stream, unsigned long long *id), "
     "capture_id for C callers without the GIL (0 on success; *id 0: not capturing)."},
    {"current_context", current_context, METH_NOARGS,
     "current_context() -> int: the thread's current CUDA context (0: none)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "graphpool.device._capture",
    "The allocator's per-allocation CUDA calls, in C: capture query and graph user objects.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__capture(void) { return PyModule_Create(&module); }
