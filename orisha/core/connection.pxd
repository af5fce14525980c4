# Cython augmentation of connection.py (the source and the pure fallback): the same
# code compiled with typed objects when setup.py builds it; nothing here changes
# behaviour. Attributes stay ``public``: the protocol layers and tests read them.

cimport cython

cdef class App:
    cdef public object site, protocols, routes, limits, publish, log, hosts
    cdef public dict views
    cdef public bytes alt_svc  # HTTP/3 advertised beside Date (serve time)
    cdef public Py_ssize_t open
    cdef public list stats, site_stats, counts
    cdef public object log_lines
    cdef public dict plans
    cdef public Py_ssize_t _second
    cdef public tuple _tails
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
