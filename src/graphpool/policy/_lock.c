/* graphpool.policy._lock: the allocator's reentrant lock, in C.
 *
 * The compiled allocator takes this lock twice per cached malloc+free pair. mypyc calls a
 * lock's methods through Python's call protocol; fastrlock's methods are Cython functions
 * bound as Python methods (and acquire parses its arguments), about 150-200 instructions a
 * call. These methods take no arguments and are plain C methods, about half that
 * (benchmarks/pair_instructions.py counts them). Built only with the compiled modules (setup.py); the
 * plain-Python install uses fastrlock or threading.RLock, with the same behaviour.
 *
 *   RLock()             a reentrant lock, as threading.RLock
 *   try_acquire()       acquire without waiting: True if this thread now holds it
 *   __enter__()         acquire, waiting (interruptible as threading.RLock's: a signal
 *                       handler that raises makes it raise, holding nothing)
 *   acquire(blocking=True, timeout=-1), release(), __exit__(*exc), _is_owned()
 *
 * The state is read and written with the GIL held (every method holds it), so it needs no
 * atomics; only the wait for the OS lock releases the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>
#ifdef _WIN32
#include <windows.h>
#else
#include <time.h>
#endif

typedef struct {
    PyObject_HEAD
    PyThread_type_lock lock; /* the OS lock: taken only when a second thread must wait */
    unsigned long owner;     /* thread ident of the holder, valid while count > 0 */
    unsigned long count;     /* recursion depth of the holder; 0 when free */
    int os_locked;           /* whether `lock` is taken (for the holder) */
    unsigned long waiting;   /* threads waiting in wait_lock */
} RLockObject;

/* As fastrlock (and CuPy) do: while no second thread wants the lock, the holder does not
 * touch the OS lock at all; owner and count, read and written with the GIL held, are the
 * lock. A thread that must wait first takes the OS lock on the holder's behalf (it is
 * free: nobody waits), then waits on it a second time; the holder's last release gives it
 * back, and the waiter leaves holding it. A wait interrupted by a signal handler that
 * returns starts over from the state as it then is (Python code ran meanwhile). The module
 * declares no free-threading support, so a free-threaded CPython turns the GIL back on when
 * it is imported; were it ever declared, LOGICAL 0 makes every acquire take the OS lock. */
#ifdef Py_GIL_DISABLED
#define LOGICAL 0
#else
#define LOGICAL 1
#endif

/* Monotonic time in microseconds (no private CPython API: it moved between 3.12 and 3.13). */
static long long now_us(void) {
#ifdef _WIN32
    return (long long)GetTickCount64() * 1000;
#else
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000 + t.tv_nsec / 1000;
#endif
}

enum { GOT = 1, TIMED_OUT = 0, RAISED = -1, AGAIN = 2 };

/* Wait for the OS lock, up to timeout_us (-1: forever). GOT, TIMED_OUT, RAISED (a signal
   handler raised while waiting), or AGAIN: a signal handler ran and returned. Python code ran
   meanwhile (other threads may have taken or released the lock, and this thread counted as
   not waiting), so the caller must look at the state afresh. */
static int wait_lock(RLockObject *self, PY_TIMEOUT_T timeout_us) {
    PyLockStatus r;
    self->waiting++;
    Py_BEGIN_ALLOW_THREADS
    r = PyThread_acquire_lock_timed(self->lock, timeout_us, 1);
    Py_END_ALLOW_THREADS
    self->waiting--;
    if (r == PY_LOCK_ACQUIRED)
        return GOT;
    if (r == PY_LOCK_FAILURE)
        return TIMED_OUT;
    /* PY_LOCK_INTR: run the signal handlers, as threading's locks do */
    if (Py_MakePendingCalls() < 0)
        return RAISED;
    return AGAIN;
}

/* 1 acquired, 0 not (non-blocking or timed out), -1 exception. */
static int do_acquire(RLockObject *self, int blocking, PY_TIMEOUT_T timeout_us) {
    unsigned long me = PyThread_get_thread_ident();
    long long deadline = timeout_us > 0 ? now_us() + (long long)timeout_us : 0;
again:
    if (self->count > 0 && self->owner == me) {
        if (self->count == ULONG_MAX) {
            PyErr_SetString(PyExc_OverflowError, "internal lock count overflowed");
            return -1;
        }
        self->count++;
        return 1;
    }
    if (self->count == 0) {
        if (LOGICAL && self->waiting == 0) { /* free, nobody waits: no OS call */
            self->owner = me;
            self->count = 1;
            return 1;
        }
        /* free, but a woken waiter may be about to take it: race for the OS lock */
        if (PyThread_acquire_lock(self->lock, NOWAIT_LOCK)) {
            self->os_locked = 1;
            self->owner = me;
            self->count = 1;
            return 1;
        }
    } else {
        if (!blocking || timeout_us == 0)
            return 0;
        if (!self->os_locked) {
            /* held logically: take the OS lock on the holder's behalf (it is free: nobody
               waits), so that the wait below lasts until the holder's last release */
            if (PyThread_acquire_lock(self->lock, NOWAIT_LOCK))
                self->os_locked = 1;
        }
    }
    if (!blocking || timeout_us == 0)
        return 0;
    int r = wait_lock(self, timeout_us);
    if (r == AGAIN) {
        if (timeout_us > 0) {
            long long left = deadline - now_us();
            if (left <= 0)
                return 0;
            timeout_us = (PY_TIMEOUT_T)left;
        }
        goto again;
    }
    if (r != GOT)
        return r;
    self->os_locked = 1;
    self->owner = me;
    self->count = 1;
    return 1;
}

static PyObject *rlock_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwds != NULL && PyDict_GET_SIZE(kwds) != 0)) {
        PyErr_SetString(PyExc_TypeError, "RLock() takes no arguments");
        return NULL;
    }
    RLockObject *self = (RLockObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->lock = PyThread_allocate_lock();
    if (self->lock == NULL) {
        Py_DECREF(self);
        PyErr_SetString(PyExc_MemoryError, "cannot allocate lock");
        return NULL;
    }
    self->owner = 0;
    self->count = 0;
    self->os_locked = 0;
    self->waiting = 0;
    return (PyObject *)self;
}

static void rlock_dealloc(RLockObject *self) {
    if (self->lock != NULL) {
        if (self->os_locked)
            PyThread_release_lock(self->lock);
        PyThread_free_lock(self->lock);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *rlock_try_acquire(RLockObject *self, PyObject *unused) {
    int r = do_acquire(self, 0, -1);
    if (r < 0)
        return NULL;
    return PyBool_FromLong(r);
}

static PyObject *rlock_enter(RLockObject *self, PyObject *unused) {
    int r = do_acquire(self, 1, -1);
    if (r < 0)
        return NULL;
    Py_RETURN_TRUE;
}

static PyObject *rlock_acquire(RLockObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"blocking", "timeout", NULL};
    int blocking = 1;
    double timeout = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|pd:acquire", kwlist, &blocking, &timeout))
        return NULL;
    if (!blocking && timeout != -1) {
        PyErr_SetString(PyExc_ValueError, "can't specify a timeout for a non-blocking call");
        return NULL;
    }
    if (timeout != timeout) {
        PyErr_SetString(PyExc_ValueError, "Invalid value NaN (not a number)");
        return NULL;
    }
    if (timeout < 0 && timeout != -1) {
        PyErr_SetString(PyExc_ValueError, "timeout value must be a non-negative number");
        return NULL;
    }
    PY_TIMEOUT_T us = -1;
    if (timeout >= 0) {
        double t = timeout * 1e6;
        if (t > (double)PY_TIMEOUT_MAX) {
            PyErr_SetString(PyExc_OverflowError, "timeout value is too large");
            return NULL;
        }
        us = (PY_TIMEOUT_T)t;
    }
    int r = do_acquire(self, blocking, us);
    if (r < 0)
        return NULL;
    return PyBool_FromLong(r);
}

static PyObject *rlock_release(RLockObject *self, PyObject *unused) {
    if (self->count == 0 || self->owner != PyThread_get_thread_ident()) {
        PyErr_SetString(PyExc_RuntimeError, "cannot release un-acquired lock");
        return NULL;
    }
    if (--self->count == 0) {
        self->owner = 0;
        if (self->os_locked) { /* a waiter took it for us, or LOGICAL is 0: hand it on */
            self->os_locked = 0;
            PyThread_release_lock(self->lock);
        }
    }
    Py_RETURN_NONE;
}

static PyObject *rlock_exit(RLockObject *self, PyObject *args) {
    return rlock_release(self, NULL);
}

static PyObject *rlock_is_owned(RLockObject *self, PyObject *unused) {
    return PyBool_FromLong(self->count > 0 && self->owner == PyThread_get_thread_ident());
}

static PyObject *rlock_repr(RLockObject *self) {
    return PyUnicode_FromFormat("<graphpool.policy._lock.RLock %s owner=%lu count=%lu at %p>",
                                self->count ? "locked" : "unlocked", self->count ? self->owner : 0UL,
                                self->count, (void *)self);
}

static PyMethodDef rlock_methods[] = {
    {"try_acquire", (PyCFunction)rlock_try_acquire, METH_NOARGS,
     "try_acquire() -> bool: acquire without waiting; True if this thread now holds the lock."},
    {"acquire", (PyCFunction)(void (*)(void))rlock_acquire, METH_VARARGS | METH_KEYWORDS,
     "acquire(blocking=True, timeout=-1) -> bool: as threading.RLock.acquire."},
    {"release", (PyCFunction)rlock_release, METH_NOARGS,
     "release(): as threading.RLock.release; RuntimeError if this thread does not hold it."},
    {"__enter__", (PyCFunction)rlock_enter, METH_NOARGS, "Acquire, waiting."},
    {"__exit__", (PyCFunction)rlock_exit, METH_VARARGS, "Release."},
    {"_is_owned", (PyCFunction)rlock_is_owned, METH_NOARGS,
     "_is_owned() -> bool: whether this thread holds the lock."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RLockType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "graphpool.policy._lock.RLock",
    .tp_basicsize = sizeof(RLockObject),
    .tp_dealloc = (destructor)rlock_dealloc,
    .tp_repr = (reprfunc)rlock_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A reentrant lock, as threading.RLock, whose hot methods take no arguments.",
    .tp_methods = rlock_methods,
    .tp_new = rlock_new,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "graphpool.policy._lock", "The allocator's reentrant lock, in C.", -1,
    NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__lock(void) {
    if (PyType_Ready(&RLockType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&RLockType);
    if (PyModule_AddObject(m, "RLock", (PyObject *)&RLockType) < 0) {
        Py_DECREF(&RLockType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
