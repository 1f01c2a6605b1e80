/* graphpool._torch_shim: the C entry points the frameworks' allocator hooks call: PyTorch's
 * CUDAPluggableAllocator (below) and CuPy's CFunctionAllocator (the end of this comment).
 *
 * PyTorch loads an allocator as two C functions of a shared library:
 *
 *   void *graphpool_torch_malloc(size_t size, int device, cudaStream_t stream)
 *   void  graphpool_torch_free(void *ptr, size_t size, int device, cudaStream_t stream)
 *
 * Each takes the GIL and calls the hook that graphpool.torch registered with
 * set_hooks(malloc, free) (graphpool.hooks.TorchHooks' methods, compiled): malloc(size,
 * device, stream_handle) -> int address, and free(ptr, size, device, stream_handle), by
 * vectorcall. This file is C++ for one reason: PyTorch does not
 * test the pointer its allocator returns, so a failed allocation must throw. The exception
 * (std::runtime_error carrying graphpool's message) crosses PyTorch's C++ frames and reaches
 * Python as a RuntimeError, as an RMM allocator's does. A failed free never throws (PyTorch
 * calls it from destructors): the error is reported as unraisable and the block stays with
 * graphpool.
 *
 * No CUDA header is needed: cudaStream_t is an opaque pointer here. After close() (at
 * interpreter exit) malloc throws and free does nothing, so a tensor that PyTorch destroys
 * after Python is gone never calls into a finalized interpreter.
 *
 * The lane (one per device, Note [Parking] in graphpool/policy/heap.py): when the free hook
 * returns a requested size, graphpool parked that block, and the lane keeps (address,
 * requested size, PyTorch's stream). The next malloc of that size on that stream takes it
 * back here, without the GIL, if the stream is not capturing (the device's capture query,
 * a C function graphpool.device provides; the legacy stream never captures); a free of
 * that block while it is out parks it here again. Anything else goes to the hooks. The
 * lane only ever holds the one block graphpool parked, and graphpool takes it back
 * (lane_take) before any other allocator call, counting the times it was handed out, so
 * the Python policy stays the one that decides: this file only replays its decision.
 * graphpool arms the lane for the block it parks, under its lock (lane_take(device, ptr,
 * requested)); the free hook's answer parks a block here only while the lane is still armed
 * for it: a take since (another thread or a signal handler ran graphpool between the park and
 * this file's lane_park) disarms it, and the block, maybe out again, is never kept here.
 * Every routing change (set_backend, graphpool.routing.invalidate) turns the lanes off
 * until graphpool parks again (lanes_off).
 *
 * CuPy (graphpool.cupy, where CuPy has cupy.cuda.memory.CFunctionAllocator) calls
 *
 *   void *graphpool_cupy_malloc(void *param, size_t size, int device)
 *   void  graphpool_cupy_free(void *param, void *ptr, int device)
 *
 * with the GIL held, from its memory object's constructor and deallocator. The stream is
 * CuPy's current one, read by CuPy's own C function (cupy.cuda.stream's exported
 * get_current_stream_ptr, handed over by set_cupy_hooks). The same lanes serve it: a lane
 * keys on the framework's raw stream handle, which both frameworks take from CUDA. The
 * hooks are graphpool.hooks.CupyHooks' malloc_on(size, device, stream) and
 * free(ptr, device); a failed malloc returns (void *)-1 with the Python exception
 * set (CuPy's Cython caller checks for an exception on -1), and a free of -1 or 0 is
 * ignored, so a CuPy built to ignore the error still fails cleanly.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>

static PyObject *g_malloc = nullptr; /* hook(size, device, stream) -> int */
static PyObject *g_free = nullptr;   /* hook(ptr, size, device, stream) -> int (parked) or None */
static volatile int g_closed = 0;    /* set by close() (PyTorch's entry points): exit, or a refused install */

/* ------------------------------------------------------------------ the lane */

/* graphpool.device's capture query: 0 on success, *id the capture's id (0: none). */
typedef int (*capture_query_t)(void *stream, unsigned long long *id);

enum LaneState { LANE_EMPTY = 0, LANE_PARKED = 1, LANE_LIVE = 2 };

struct Lane {
    std::mutex m;
    void *ptr = nullptr;      /* the parked block */
    size_t requested = 0;     /* the request it serves */
    void *stream = nullptr;   /* PyTorch's stream it serves */
    int state = LANE_EMPTY;
    unsigned long long hits = 0; /* times handed out since graphpool last took it */
    capture_query_t query = nullptr;
    bool on = false;          /* off: every call goes to the hooks (routing changed) */
    void *armed = nullptr;    /* the block graphpool parked last, until its next take */
    size_t armed_requested = 0;
    int kind = 0;             /* the framework that parked it (KIND_TORCH, KIND_CUPY): only it is served */
    void *cupy_ptr = nullptr;    /* the block CuPy's malloc hook handed out last on this device, */
    void *cupy_stream = nullptr; /* and CuPy's stream it was for (CuPy's free names no stream) */
};

/* A block parked by one framework's free is handed only to that framework's malloc: a block
   out is freed through the hooks of the framework that holds it, and those know its allocator. */
enum LaneKind { KIND_TORCH = 0, KIND_CUPY = 1 };

static const int kLanes = 64;
static Lane g_lanes[kLanes];
static std::atomic<bool> g_lanes_enabled{true}; /* set_lanes_enabled(False): the hooks only */

static bool is_legacy(void *stream) { return (uintptr_t)stream <= 1; } /* 0, CU_STREAM_LEGACY */

/* The parked block for this request, or nullptr (then the hooks decide). No GIL. */
static void *lane_malloc(size_t size, int device, void *stream, int kind) {
    if (device < 0 || device >= kLanes || size == 0 || !g_lanes_enabled.load(std::memory_order_relaxed)) {
        return nullptr;
    }
    Lane &l = g_lanes[device];
    capture_query_t query;
    {
        std::lock_guard<std::mutex> g(l.m);
        if (!l.on || l.state != LANE_PARKED || l.requested != size || l.stream != stream || l.kind != kind) {
            return nullptr;
        }
        query = l.query;
    }
    if (!is_legacy(stream)) { /* asked outside the lock: the query may take the GIL (simulator) */
        unsigned long long id = 0;
        if (query == nullptr || query(stream, &id) != 0 || id != 0) {
            return nullptr;
        }
    }
    std::lock_guard<std::mutex> g(l.m);
    if (!l.on || l.state != LANE_PARKED || l.requested != size || l.stream != stream || l.kind != kind) {
        return nullptr;
    }
    l.state = LANE_LIVE;
    l.hits++;
    return l.ptr;
}

/* Park the block the lane handed out, if ``ptr`` is it. No GIL. */
static bool lane_free(void *ptr, int device) {
    if (device < 0 || device >= kLanes || !g_lanes_enabled.load(std::memory_order_relaxed)) {
        return false;
    }
    Lane &l = g_lanes[device];
    std::lock_guard<std::mutex> g(l.m);
    if (!l.on || l.state != LANE_LIVE || l.ptr != ptr) {
        return false;
    }
    l.state = LANE_PARKED;
    return true;
}

/* graphpool parked ``ptr`` (the free hook returned ``requested``): the lane keeps it. */
static void lane_park(void *ptr, size_t requested, int device, void *stream, int kind) {
    if (device < 0 || device >= kLanes) {
        return;
    }
    Lane &l = g_lanes[device];
    std::lock_guard<std::mutex> g(l.m);
    if (ptr == nullptr || l.armed != ptr || l.armed_requested != requested) {
        return; /* graphpool took it back since it parked it (or never parked it for this lane) */
    }
    if (kind == KIND_CUPY) { /* graphpool parks the block its hooks handed out last: this one */
        if (l.cupy_ptr != ptr) {
            return;
        }
        stream = l.cupy_stream;
    }
    l.armed = nullptr;
    l.ptr = ptr;
    l.requested = requested;
    l.stream = stream;
    l.kind = kind;
    l.state = LANE_PARKED;
    l.on = true;
}

/* A free hook answered ``r`` for ``ptr`` (GIL held): a positive int is the requested size of
   the block graphpool parked, which the lane then keeps; anything else (0: queued; a negative
   or non-int answer) parks nothing. */
static void park_answered(PyObject *r, void *ptr, int device, void *stream, int kind) {
    if (!PyLong_Check(r)) {
        return;
    }
    unsigned long long requested = PyLong_AsUnsignedLongLong(r);
    if (requested == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear(); /* (a negative answer: not parked) */
    } else if (requested != 0) {
        lane_park(ptr, (size_t)requested, device, stream, kind);
    }
}

/* The message of the current Python exception ("Type: text"), which is cleared. */
static std::string take_error(void) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    std::string out = "graphpool: allocation failed";
    if (value != nullptr) {
        PyObject *text = PyObject_Str(value);
        const char *name = type != nullptr ? ((PyTypeObject *)type)->tp_name : "Error";
        const char *msg = text != nullptr ? PyUnicode_AsUTF8(text) : nullptr;
        if (msg != nullptr) {
            out = std::string(name) + ": " + msg;
        }
        Py_XDECREF(text);
        PyErr_Clear();
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return out;
}

/* Call the malloc hook (GIL held). True with *out set, or false with *msg set. */
static bool call_malloc(size_t size, int device, void *stream, void **out, std::string *msg) {
    if (g_malloc == nullptr) {
        *msg = "graphpool.torch: no allocator hook is set (call graphpool.torch.install())";
        return false;
    }
    /* unsigned: a size or handle past 2**63 stays positive (graphpool then refuses the size
       as larger than the device, an out-of-memory error). One vectorcall of the compiled
       hook (graphpool.hooks), no format string and no argument tuple. */
    PyObject *args[3];
    args[0] = PyLong_FromUnsignedLongLong((unsigned long long)size);
    args[1] = PyLong_FromLong(device);
    args[2] = PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)stream);
    PyObject *r = nullptr;
    if (args[0] != nullptr && args[1] != nullptr && args[2] != nullptr) {
        r = PyObject_Vectorcall(g_malloc, args, 3, nullptr);
    }
    Py_XDECREF(args[0]);
    Py_XDECREF(args[1]);
    Py_XDECREF(args[2]);
    if (r == nullptr) {
        *msg = take_error();
        return false;
    }
    void *p = PyLong_AsVoidPtr(r);
    Py_DECREF(r);
    if (p == nullptr && PyErr_Occurred()) {
        *msg = take_error();
        return false;
    }
    if (p == nullptr && size != 0) {
        *msg = "graphpool.torch: the allocator hook returned a null address";
        return false;
    }
    *out = p;
    return true;
}

/* ------------------------------------------------------------------ CuPy */

typedef intptr_t (*current_stream_t)(void); /* CuPy's get_current_stream_ptr */

static PyObject *g_cupy_malloc = nullptr;  /* CupyHooks.malloc_on(size, device, stream) -> int */
static PyObject *g_cupy_free = nullptr;    /* CupyHooks.free(ptr, device) -> int (parked) */
static volatile int g_cupy_closed = 0;     /* set by close() or close("cupy") (CuPy's entry points) */
static current_stream_t g_cupy_stream = nullptr;
static void *const kFailed = (void *)(intptr_t)-1; /* a failed malloc, the exception set */
/* Note the block CuPy's malloc hook handed out and its stream: a free hook that parks a block
   parks the one the hooks handed out last, and the lane then serves that stream. */
static void lane_note_cupy(void *ptr, int device, void *stream) {
    if (device < 0 || device >= kLanes) {
        return;
    }
    Lane &l = g_lanes[device];
    std::lock_guard<std::mutex> g(l.m);
    l.cupy_ptr = ptr;
    l.cupy_stream = stream;
}

/* (GIL held) The block for CuPy, or kFailed with the exception set. */
static void *cupy_malloc(size_t size, int device) {
    if (g_cupy_closed) {
        PyErr_SetString(PyExc_RuntimeError, "graphpool.cupy: allocation after graphpool's shim was closed (exit)");
        return kFailed;
    }
    if (g_cupy_malloc == nullptr || g_cupy_stream == nullptr) {
        PyErr_SetString(PyExc_RuntimeError,
                        "graphpool.cupy: no allocator hook is set (call graphpool.cupy.install())");
        return kFailed;
    }
    intptr_t raw = g_cupy_stream();
    if (PyErr_Occurred()) { /* (CuPy's function never fails; one that did is not trusted) */
        return kFailed;
    }
    void *stream = (void *)raw;
    void *p = lane_malloc(size, device, stream, KIND_CUPY);
    if (p != nullptr) {
        return p;
    }
    PyObject *args[3];
    args[0] = PyLong_FromSize_t(size);
    args[1] = PyLong_FromLong(device);
    args[2] = PyLong_FromVoidPtr(stream);
    PyObject *r = nullptr;
    PyObject *hook = g_cupy_malloc; /* owned for the call: set_cupy_hooks or close may run meanwhile */
    Py_INCREF(hook);
    if (args[0] != nullptr && args[1] != nullptr && args[2] != nullptr) {
        r = PyObject_Vectorcall(hook, args, 3, nullptr);
    }
    Py_DECREF(hook);
    Py_XDECREF(args[0]);
    Py_XDECREF(args[1]);
    Py_XDECREF(args[2]);
    if (r == nullptr) {
        return kFailed;
    }
    p = PyLong_AsVoidPtr(r);
    Py_DECREF(r);
    if (PyErr_Occurred()) {
        return kFailed;
    }
    if (p == nullptr || p == kFailed) {
        PyErr_SetString(PyExc_RuntimeError, "graphpool.cupy: the allocator hook returned no address");
        return kFailed;
    }
    lane_note_cupy(p, device, stream);
    return p;
}

/* (GIL held) Give ``ptr`` back through the free hook; a parked block goes to the lane. */
static void cupy_free(void *ptr, int device) {
    if (g_cupy_free == nullptr) {
        return;
    }
    PyObject *args[2];
    args[0] = PyLong_FromVoidPtr(ptr);
    args[1] = PyLong_FromLong(device);
    PyObject *r = nullptr;
    PyObject *hook = g_cupy_free; /* owned for the call, as cupy_malloc's */
    Py_INCREF(hook);
    if (args[0] != nullptr && args[1] != nullptr) {
        r = PyObject_Vectorcall(hook, args, 2, nullptr);
    }
    Py_XDECREF(args[0]);
    Py_XDECREF(args[1]);
    if (r == nullptr) {
        PyErr_WriteUnraisable(hook);
        Py_DECREF(hook);
        return;
    }
    Py_DECREF(hook);
    park_answered(r, ptr, device, nullptr, KIND_CUPY);
    Py_DECREF(r);
}

extern "C" {

#if defined(_WIN32)
#define GRAPHPOOL_EXPORT __declspec(dllexport)
#else
#define GRAPHPOOL_EXPORT __attribute__((visibility("default")))
#endif

GRAPHPOOL_EXPORT void *graphpool_torch_malloc(size_t size, int device, void *stream) {
    if (g_closed || !Py_IsInitialized()) {
        throw std::runtime_error("graphpool.torch: allocation after the interpreter shut down");
    }
    void *p = lane_malloc(size, device, stream, KIND_TORCH);
    if (p != nullptr) {
        return p;
    }
    std::string msg;
    PyGILState_STATE st = PyGILState_Ensure();
    bool ok = call_malloc(size, device, stream, &p, &msg);
    PyGILState_Release(st);
    if (!ok) {
        throw std::runtime_error(msg);  /* the GIL is released before throwing */
    }
    return p;
}

GRAPHPOOL_EXPORT void graphpool_torch_free(void *ptr, size_t size, int device, void *stream) {
    if (g_closed || !Py_IsInitialized() || ptr == nullptr || lane_free(ptr, device)) {
        return;
    }
    PyGILState_STATE st = PyGILState_Ensure();
    if (g_free != nullptr) {
        PyObject *args[4];
        args[0] = PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)ptr);
        args[1] = PyLong_FromUnsignedLongLong((unsigned long long)size);
        args[2] = PyLong_FromLong(device);
        args[3] = PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)stream);
        PyObject *r = nullptr;
        if (args[0] != nullptr && args[1] != nullptr && args[2] != nullptr && args[3] != nullptr) {
            r = PyObject_Vectorcall(g_free, args, 4, nullptr);
        }
        for (PyObject *a : args) {
            Py_XDECREF(a);
        }
        if (r == nullptr) {
            PyErr_WriteUnraisable(g_free);
        } else {
            park_answered(r, ptr, device, stream, KIND_TORCH);
        }
        Py_XDECREF(r);
    }
    PyGILState_Release(st);
}

/* CuPy's CFunctionAllocator: the GIL is held (CuPy calls from Python-level code). */
GRAPHPOOL_EXPORT void *graphpool_cupy_malloc(void *, size_t size, int device) {
    if (size == 0 || !Py_IsInitialized()) {
        return nullptr; /* (CuPy asks for bytes only; none at all when the interpreter is gone) */
    }
    PyGILState_STATE st = PyGILState_Ensure();
    void *p = cupy_malloc(size, device);
    PyGILState_Release(st);
    return p;
}

GRAPHPOOL_EXPORT void graphpool_cupy_free(void *, void *ptr, int device) {
    if (g_cupy_closed || !Py_IsInitialized() || ptr == nullptr || ptr == kFailed || lane_free(ptr, device)) {
        return;
    }
    PyGILState_STATE st = PyGILState_Ensure();
    cupy_free(ptr, device);
    PyGILState_Release(st);
}

} /* extern "C" */

/* ------------------------------------------------------------------ Python functions */

static PyObject *set_hooks(PyObject *, PyObject *args) {
    PyObject *m, *f;
    if (!PyArg_ParseTuple(args, "OO:set_hooks", &m, &f)) {
        return nullptr;
    }
    if (!PyCallable_Check(m) || !PyCallable_Check(f)) {
        PyErr_SetString(PyExc_TypeError, "set_hooks: malloc and free must be callable");
        return nullptr;
    }
    Py_INCREF(m);
    Py_INCREF(f);
    Py_XSETREF(g_malloc, m);
    Py_XSETREF(g_free, f);
    g_closed = 0;
    Py_RETURN_NONE;
}

/* close(): both frameworks' entry points (exit); close("torch") or close("cupy"): one (a
   refused install closes only its own framework's). */
static PyObject *close_shim(PyObject *, PyObject *args) {
    const char *which = nullptr;
    if (!PyArg_ParseTuple(args, "|z:close", &which)) {
        return nullptr;
    }
    bool torch = which == nullptr || strcmp(which, "torch") == 0;
    bool cupy = which == nullptr || strcmp(which, "cupy") == 0;
    if (!torch && !cupy) {
        PyErr_Format(PyExc_ValueError, "close: 'torch', 'cupy' or nothing (both), not '%s'", which);
        return nullptr;
    }
    if (torch) {
        g_closed = 1;
        Py_CLEAR(g_malloc);
        Py_CLEAR(g_free);
    }
    if (cupy) {
        g_cupy_closed = 1;
        Py_CLEAR(g_cupy_malloc);
        Py_CLEAR(g_cupy_free);
        g_cupy_stream = nullptr;
    }
    Py_RETURN_NONE;
}

/* The name CuPy's Cython gives get_current_stream_ptr's signature in its exported capsule. */
static const char *const kStreamSignature = "intptr_t (void)";

static PyObject *set_cupy_hooks(PyObject *, PyObject *args) {
    PyObject *m, *f, *capsule;
    if (!PyArg_ParseTuple(args, "OOO:set_cupy_hooks", &m, &f, &capsule)) {
        return nullptr;
    }
    if (!PyCallable_Check(m) || !PyCallable_Check(f)) {
        PyErr_SetString(PyExc_TypeError, "set_cupy_hooks: malloc and free must be callable");
        return nullptr;
    }
    /* Only a capsule that names exactly this signature is called (any other: TypeError). */
    void *fn = PyCapsule_IsValid(capsule, kStreamSignature) ? PyCapsule_GetPointer(capsule, kStreamSignature)
                                                             : nullptr;
    if (fn == nullptr) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "set_cupy_hooks: the stream function must be a capsule named \"%s\"",
                     kStreamSignature);
        return nullptr;
    }
    Py_INCREF(m);
    Py_INCREF(f);
    Py_XSETREF(g_cupy_malloc, m);
    Py_XSETREF(g_cupy_free, f);
    g_cupy_stream = (current_stream_t)fn;
    g_cupy_closed = 0;
    Py_RETURN_NONE;
}

static PyObject *cupy_entry_points(PyObject *, PyObject *) {
    return Py_BuildValue("(NN)", PyLong_FromVoidPtr((void *)&graphpool_cupy_malloc),
                         PyLong_FromVoidPtr((void *)&graphpool_cupy_free));
}

static PyObject *try_malloc(PyObject *, PyObject *args) {
    unsigned long long size, stream;
    int device;
    if (!PyArg_ParseTuple(args, "KiK:try_malloc", &size, &device, &stream)) {
        return nullptr;
    }
    void *p = nullptr;
    std::string msg;
    if (!call_malloc((size_t)size, device, (void *)(uintptr_t)stream, &p, &msg)) {
        PyErr_SetString(PyExc_RuntimeError, msg.c_str());
        return nullptr;
    }
    return PyLong_FromVoidPtr(p);
}

static int device_arg(long device) { /* (a long: a cast to int first would wrap 2**32 to 0) */
    if (device < 0 || device >= kLanes) {
        PyErr_Format(PyExc_ValueError, "graphpool._torch_shim: device %ld has no lane (0-%d)", device, kLanes - 1);
        return -1;
    }
    return 0;
}

/* lane_take's answer when nothing happened since the last take, the common case: one tuple,
   made once (no allocation per call). */
static PyObject *g_nothing = nullptr;

/* An unsigned argument of lane_take (a C long long or smaller fits: addresses, sizes). */
static bool ull_arg(PyObject *o, unsigned long long *out) {
    *out = PyLong_AsUnsignedLongLong(o);
    return !(*out == (unsigned long long)-1 && PyErr_Occurred());
}

/* METH_FASTCALL: graphpool calls it before every allocator call while a block is parked. */
static PyObject *lane_take(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 3) {
        PyErr_Format(PyExc_TypeError, "lane_take(device, ptr=0, requested=0) takes 1 to 3 arguments (%zd given)",
                     nargs);
        return nullptr;
    }
    long device = PyLong_AsLong(args[0]);
    if ((device == -1 && PyErr_Occurred()) || device_arg(device) < 0) {
        return nullptr;
    }
    unsigned long long arm = 0, arm_requested = 0;
    if ((nargs > 1 && !ull_arg(args[1], &arm)) || (nargs > 2 && !ull_arg(args[2], &arm_requested))) {
        return nullptr;
    }
    Lane &l = g_lanes[device];
    unsigned long long hits;
    bool live;
    {
        std::lock_guard<std::mutex> g(l.m);
        hits = l.hits;
        live = l.state == LANE_LIVE;
        l.state = LANE_EMPTY;
        l.hits = 0;
        l.ptr = nullptr;
        l.armed = (void *)(uintptr_t)arm;
        l.armed_requested = (size_t)arm_requested;
    }
    if (hits == 0 && !live) {
        if (g_nothing == nullptr) {
            g_nothing = Py_BuildValue("(iO)", 0, Py_False);
            if (g_nothing == nullptr) {
                return nullptr;
            }
        }
        Py_INCREF(g_nothing);
        return g_nothing;
    }
    PyObject *n = PyLong_FromUnsignedLongLong(hits);
    if (n == nullptr) {
        return nullptr;
    }
    return Py_BuildValue("(NO)", n, live ? Py_True : Py_False);
}

static PyObject *lane_query(PyObject *, PyObject *args) {
    int device;
    unsigned long long address;
    if (!PyArg_ParseTuple(args, "iK:lane_query", &device, &address) || device_arg(device) < 0) {
        return nullptr;
    }
    Lane &l = g_lanes[device];
    std::lock_guard<std::mutex> g(l.m);
    l.query = (capture_query_t)(uintptr_t)address;
    Py_RETURN_NONE;
}

static PyObject *lanes_off(PyObject *, PyObject *) {
    for (Lane &l : g_lanes) {
        std::lock_guard<std::mutex> g(l.m);
        l.on = false;
        l.armed = nullptr; /* (a park answered after the change keeps the lane off) */
    }
    Py_RETURN_NONE;
}

static PyObject *set_lanes_enabled(PyObject *, PyObject *arg) {
    int on = PyObject_IsTrue(arg);
    if (on < 0) {
        return nullptr;
    }
    g_lanes_enabled.store(on != 0);
    Py_RETURN_NONE;
}

static PyObject *lane_state(PyObject *, PyObject *arg) {
    long device = PyLong_AsLong(arg);
    if ((device == -1 && PyErr_Occurred()) || device_arg(device) < 0) {
        return nullptr;
    }
    Lane &l = g_lanes[device];
    std::lock_guard<std::mutex> g(l.m);
    static const char *names[] = {"empty", "parked", "live"};
    return Py_BuildValue("{s:K,s:K,s:K,s:s,s:K,s:O,s:s}", "ptr", (unsigned long long)(uintptr_t)l.ptr,
                         "requested", (unsigned long long)l.requested, "stream",
                         (unsigned long long)(uintptr_t)l.stream, "state", names[l.state], "hits", l.hits,
                         "on", l.on ? Py_True : Py_False, "kind", l.kind == KIND_CUPY ? "cupy" : "torch");
}

static PyMethodDef methods[] = {
    {"set_hooks", set_hooks, METH_VARARGS,
     "set_hooks(malloc, free)\n--\n\nThe Python callables the exported C functions call."},
    {"set_cupy_hooks", set_cupy_hooks, METH_VARARGS,
     "set_cupy_hooks(malloc_on, free, current_stream_capsule)\n--\n\nThe CuPy hooks the exported "
     "graphpool_cupy_malloc/free call, and CuPy's get_current_stream_ptr (its exported capsule)."},
    {"cupy_entry_points", cupy_entry_points, METH_NOARGS,
     "cupy_entry_points() -> (malloc, free)\n--\n\nThe addresses of graphpool_cupy_malloc and "
     "graphpool_cupy_free, for CuPy's CFunctionAllocator."},
    {"close", close_shim, METH_VARARGS,
     "close(framework=None)\n--\n\nDrop the hooks of both frameworks (exit), or of 'torch' or 'cupy' "
     "alone: from then on their malloc fails and their free does nothing, until hooks are set again."},
    {"try_malloc", try_malloc, METH_VARARGS,
     "try_malloc(size, device, stream)\n--\n\nThe exported malloc's path, raising RuntimeError "
     "with the message the C++ exception would carry (for tests)."},
    {"lane_take", (PyCFunction)(void (*)(void))lane_take, METH_FASTCALL,
     "lane_take(device, ptr=0, requested=0) -> (hits, live)\n--\n\nTake the parked block back from "
     "the device's lane: the times it was handed out since, and whether it is out now (graphpool's "
     "settle call); then arm the lane for the block graphpool parked at ptr (0: none), the only one "
     "the free hook's answer may park there until the next take."},
    {"lane_query", lane_query, METH_VARARGS,
     "lane_query(device, address)\n--\n\nThe device's capture query, a C function "
     "int(void *stream, unsigned long long *id) (0: none; the lane then serves the legacy stream only)."},
    {"lanes_off", lanes_off, METH_NOARGS,
     "lanes_off()\n--\n\nEvery call goes to the hooks until graphpool parks again (routing changed)."},
    {"set_lanes_enabled", set_lanes_enabled, METH_O,
     "set_lanes_enabled(on)\n--\n\nFalse: the lanes never answer (GRAPHPOOL_LANE=0 or GRAPHPOOL_TORCH_LANE=0)."},
    {"lane_state", lane_state, METH_O, "lane_state(device) -> dict\n--\n\nThe device's lane (for tests)."},
    {nullptr, nullptr, 0, nullptr},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "graphpool._torch_shim",
    "The C entry points of graphpool's PyTorch allocator (see graphpool.torch).", -1, methods,
    nullptr, nullptr, nullptr, nullptr,
};

PyMODINIT_FUNC PyInit__torch_shim(void) { return PyModule_Create(&module); }
