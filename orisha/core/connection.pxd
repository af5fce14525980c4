# Cython augmentation of connection.py (the source and the pure fallback): the same
# code compiled with typed objects when setup.py builds it; nothing here changes
# behaviour. Attributes stay ``public``: the protocol layers and tests read them.

cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE, PyBytes_FromStringAndSize
from cpython.list cimport PyList_GET_SIZE
from cpython.ref cimport PyObject
from libc.string cimport memchr

cdef extern from "Python.h":
    int PyList_SetSlice(object, Py_ssize_t, Py_ssize_t, PyObject *) except -1  # NULL: delete

cdef bint _COMPILED  # True here: connection.py's hot path calls the helpers below
cdef Py_ssize_t _REQUESTS, _RESPONSE_BYTES  # the counters' slots, as C integers


# connection.py calls these when ``_COMPILED`` (the pure module calls bytes.find, list.clear).
cdef inline Py_ssize_t _c_find_end(bytes buf, Py_ssize_t limit):
    """``buf.find(b"\r\n\r\n", 0, limit)``: memchr from LF to LF (a head has a few lines)."""
    cdef const char *p = PyBytes_AS_STRING(buf)
    cdef const char *end = p + min(PyBytes_GET_SIZE(buf), limit)
    cdef const char *q = p + 1  # a candidate LF at q: CR before it, CR LF after it
    while q + 2 < end:
        q = <const char *>memchr(q, 10, end - 2 - q)
        if q == NULL:
            return -1
        if q[-1] == 13 and q[1] == 13 and q[2] == 10:
            return q - 1 - p
        q += 1
    return -1


cdef inline bytes _c_slice(bytes buf, Py_ssize_t start, Py_ssize_t end):
    """``buf[start:end]`` for 0 <= start <= end <= len(buf), without a slice object."""
    return PyBytes_FromStringAndSize(PyBytes_AS_STRING(buf) + start, end - start)


cdef inline int c_clear(list items) except -1:
    return PyList_SetSlice(items, 0, PyList_GET_SIZE(items), NULL)


cdef class App:
    cdef public object site, protocols, routes, limits, publish, log, hosts
    cdef public dict views
    cdef public bytes alt_svc  # HTTP/3 advertised beside Date (serve time)
    cdef public Py_ssize_t open
    cdef public list stats, site_stats, counts
    cdef public object log_lines
    cdef public dict plans
    cdef public Py_ssize_t _second
    cdef readonly Py_ssize_t pipeline, head_scan
    cdef public tuple _tails
    cdef public bint stopping
    @cython.locals(second=Py_ssize_t)
    cpdef tuple tails(self, double now)
    cpdef tuple plan(self, bytes head)


cdef class Connection:
    cdef public App app
    cdef public bytes buf
    cdef public list out
    cdef public Py_ssize_t out_bytes
    cdef public double since
    cdef public Py_ssize_t discard
    cdef public bint eof, close_after, should_close, _closed, shut_write
    cdef public object peer
    cpdef bint reading(self)
    cpdef receive(self, bytes data, double now)
    cpdef sent(self, Py_ssize_t n, double now)
    cpdef tick(self, double now)
    cpdef shutdown(self, double now)
    cpdef close(self)
    cpdef _finish(self, double now)
    cpdef _error(self, int status, double now)
    @cython.locals(status=Py_ssize_t, close=Py_ssize_t, discard=Py_ssize_t, stats=list, out=list)
    cpdef _emit(self, object plan, tuple tails, bytes request, double now)
    @cython.locals(app=App, plans=dict, tails=tuple, answered=Py_ssize_t, buf=bytes, head=bytes,
                   end=Py_ssize_t, rest=Py_ssize_t, skip=Py_ssize_t, pipeline=Py_ssize_t,
                   head_max=Py_ssize_t)
    cpdef _process(self, double now)
