/* graphpool._torch_shim: the two C entry points PyTorch's CUDAPluggableAllocator calls.
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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

static PyObject *g_malloc = nullptr; /* hook(size, device, stream) -> int */
static PyObject *g_free = nullptr;   /* hook(ptr, size, device, stream) -> None */
static volatile int g_closed = 0;    /* set by close(): the interpreter is going away */

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
    void *p = nullptr;
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
    if (g_closed || !Py_IsInitialized() || ptr == nullptr) {
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
        }
        Py_XDECREF(r);
    }
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

static PyObject *close_shim(PyObject *, PyObject *) {
    g_closed = 1;
    Py_CLEAR(g_malloc);
    Py_CLEAR(g_free);
    Py_RETURN_NONE;
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

static PyMethodDef methods[] = {
    {"set_hooks", set_hooks, METH_VARARGS,
     "set_hooks(malloc, free)\n--\n\nThe Python callables the exported C functions call."},
    {"close", close_shim, METH_NOARGS,
     "close()\n--\n\nDrop the hooks: from now on malloc fails and free does nothing (exit)."},
    {"try_malloc", try_malloc, METH_VARARGS,
     "try_malloc(size, device, stream)\n--\n\nThe exported malloc's path, raising RuntimeError "
     "with the message the C++ exception would carry (for tests)."},
    {nullptr, nullptr, 0, nullptr},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "graphpool._torch_shim",
    "The C entry points of graphpool's PyTorch allocator (see graphpool.torch).", -1, methods,
    nullptr, nullptr, nullptr, nullptr,
};

PyMODINIT_FUNC PyInit__torch_shim(void) { return PyModule_Create(&module); }
