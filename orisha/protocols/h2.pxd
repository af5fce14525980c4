# Cython augmentation of h2.py (the source and the pure fallback): the same code compiled
# with typed objects when setup.py builds it; nothing here changes behaviour. Attributes
# stay ``public``: front.py, the TLS layers and tests read them. Module constants stay
# Python objects (tests and unikernel/h2_tables.py read them).

cimport cython
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.string cimport memcpy

cdef bint _COMPILED  # True here: h2.py's helpers below replace its struct packing
cdef Py_ssize_t _REQUESTS, _RESPONSE_BYTES, _REQUEST, _TRAILERS, _IGNORED, _date_second
cdef bytes _date_bytes


# The frame-header helpers of the compiled module (h2.py's ``_frame``/``_framed`` call them
# when ``_COMPILED``; the pure module packs with struct): the bytes written in C.
cdef inline void _c_head(unsigned char *p, Py_ssize_t length, Py_ssize_t ftype,
                         Py_ssize_t flags, Py_ssize_t sid) noexcept:
    p[0] = <unsigned char>(length >> 16)
    p[1] = <unsigned char>(length >> 8)
    p[2] = <unsigned char>length
    p[3] = <unsigned char>ftype
    p[4] = <unsigned char>flags
    p[5] = <unsigned char>(sid >> 24)
    p[6] = <unsigned char>(sid >> 16)
    p[7] = <unsigned char>(sid >> 8)
    p[8] = <unsigned char>sid


cdef inline bytes _c_frame(Py_ssize_t length, Py_ssize_t ftype, Py_ssize_t flags,
                           Py_ssize_t sid):
    cdef bytes b = PyBytes_FromStringAndSize(NULL, 9)
    _c_head(<unsigned char *>PyBytes_AS_STRING(b), length, ftype, flags, sid)
    return b


cdef inline bytes _c_framed(Py_ssize_t ftype, Py_ssize_t flags, Py_ssize_t sid,
                            bytes payload, bytes tail, Py_ssize_t data):
    cdef Py_ssize_t a = PyBytes_GET_SIZE(payload), t = PyBytes_GET_SIZE(tail)
    cdef bytes b = PyBytes_FromStringAndSize(NULL, 9 + a + t + (9 if data >= 0 else 0))
    cdef unsigned char *p = <unsigned char *>PyBytes_AS_STRING(b)
    _c_head(p, a + t, ftype, flags, sid)
    memcpy(p + 9, PyBytes_AS_STRING(payload), a)
    memcpy(p + 9 + a, PyBytes_AS_STRING(tail), t)
    if data >= 0:
        _c_head(p + 9 + a + t, data, 0, 1, sid)  # DATA, END_STREAM
    return b


cdef inline bytes _c_slice(bytes buf, Py_ssize_t start, Py_ssize_t end):
    return PyBytes_FromStringAndSize(PyBytes_AS_STRING(buf) + start, end - start)

# Frame types and flags as C integers (the dispatch in ``_process`` compares them per frame);
# nothing outside reads them.
cdef Py_ssize_t DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY
cdef Py_ssize_t WINDOW_UPDATE, CONTINUATION, END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG


cdef class _Block:
    cdef public Py_ssize_t sid, end, size, kind
    cdef public list frags


cdef class _Stream:
    cdef public Py_ssize_t sid, window, pos
    cdef public object body
    cdef public bint parked


cdef class _Body:
    cdef public Py_ssize_t length, got, window
    cdef public object send  # None until the answer is all queued, then its send window


cpdef bytes _frame(Py_ssize_t length, Py_ssize_t ftype, Py_ssize_t flags, Py_ssize_t sid)
cpdef bytes _framed(Py_ssize_t ftype, Py_ssize_t flags, Py_ssize_t sid, bytes payload,
                    bytes tail, Py_ssize_t data=*)
@cython.locals(second=Py_ssize_t)
cpdef bytes _date_field(double now)


cdef class H2Connection:
    cdef public object app, peer, decoder, ready, resets
    cdef public double since, drain_since
    cdef public bint refuse, should_close, shut_write, eof, settings_seen, closing, dead, draining
    cdef public bytes buf
    cdef public list out
    cdef public Py_ssize_t out_bytes, preface, window, initial, max_frame, recv_window, recv_used
    cdef public Py_ssize_t last_id, calm
    cdef public dict streams, remote_open, memo, built, early, plans
    cdef public dict pieces, sent_blocks
    cdef public list inc, sizes
    cdef public bytearray slots
    cdef public Py_ssize_t inserted, table_used, table_max
    cdef public bytes table_update
    cdef public list counts
    cdef public object log_lines, hosts
    cdef public Py_ssize_t head_max
    cdef public _Block hdr

    cpdef bint reading(self)
    cpdef receive(self, bytes data, double now)
    cpdef sent(self, Py_ssize_t n, double now)
    @cython.locals(waited=double)
    cpdef tick(self, double now)
    cpdef shutdown(self, double now)
    cpdef close(self)
    cpdef _settle(self, double now)
    cpdef _go_away(self, Py_ssize_t code)
    cpdef _fail(self, Py_ssize_t code)
    @cython.locals(st=_Stream)
    cpdef _reset(self, Py_ssize_t sid, Py_ssize_t code)
    cpdef bint _spend(self)
    @cython.locals(buf=bytes, pos=Py_ssize_t, n=Py_ssize_t, end_of_buf=Py_ssize_t,
                   length=Py_ssize_t, end=Py_ssize_t, ftype=Py_ssize_t, flags=Py_ssize_t,
                   sid=Py_ssize_t, payload=bytes, out=list, frames=Py_ssize_t,
                   frame_max=Py_ssize_t)
    cpdef _process(self, double now)
    cpdef _unpad(self, Py_ssize_t flags, bytes payload)
    @cython.locals(size=Py_ssize_t, body=_Body)
    cpdef _data(self, Py_ssize_t flags, Py_ssize_t sid, bytes payload, double now)
    @cython.locals(self_dependent=bint, kind=Py_ssize_t)
    cpdef _headers(self, Py_ssize_t flags, Py_ssize_t sid, bytes payload, double now)
    @cython.locals(hdr=_Block)
    cpdef _continuation(self, Py_ssize_t flags, Py_ssize_t sid, bytes payload, double now)
    @cython.locals(hdr=_Block, frags=list)
    cpdef _end_headers(self, double now)
    @cython.locals(declared=Py_ssize_t)
    cpdef _end_block(self, Py_ssize_t sid, Py_ssize_t end, bytes block, Py_ssize_t size,
                     Py_ssize_t kind, double now)
    @cython.locals(body=_Body)
    cpdef _trailers(self, Py_ssize_t sid, bytes block)
    @cython.locals(memo=dict, pair=tuple)
    cpdef _decode(self, bytes block)
    cpdef _priority(self, Py_ssize_t flags, Py_ssize_t sid, bytes payload, double now)
    @cython.locals(st=_Stream)
    cpdef _rst_stream(self, Py_ssize_t flags, Py_ssize_t sid, bytes payload, double now)
    @cython.locals(st=_Stream, i=Py_ssize_t, key=Py_ssize_t, value=Py_ssize_t, delta=Py_ssize_t)
    cpdef _settings(self, Py_ssize_t flags, Py_ssize_t sid, bytes payload, double now)
    cpdef _push_promise(self, Py_ssize_t flags, Py_ssize_t sid, bytes payload, double now)
    cpdef _ping(self, Py_ssize_t flags, Py_ssize_t sid, bytes payload, double now)
    cpdef _goaway(self, Py_ssize_t flags, Py_ssize_t sid, bytes payload, double now)
    @cython.locals(inc=Py_ssize_t, st=_Stream, body=_Body)
    cpdef _window_update(self, Py_ssize_t flags, Py_ssize_t sid, bytes payload, double now)
    cpdef _request(self, Py_ssize_t sid, tuple decoded, double now)  # plan: a Plan (a NamedTuple)
    @cython.locals(status=Py_ssize_t, stats=list, block=bytes, date=bytes, out=list,
                   size=Py_ssize_t, length=Py_ssize_t, hit=tuple)
    cpdef _respond(self, Py_ssize_t sid, object plan, bytes line, double now, bytes request=*)
    @cython.locals(out=list, step=Py_ssize_t, i=Py_ssize_t, last=Py_ssize_t)
    cpdef _long_block(self, Py_ssize_t sid, bytes block, object body)
    @cython.locals(pieces=tuple, parts=list, before=Py_ssize_t, slots=bytearray, vid=Py_ssize_t,
                   k=Py_ssize_t, literal=bytes, owed=bytes)
    cpdef bytes _block(self, bytes head)
    cpdef _shrink_table(self, Py_ssize_t size)
    cpdef _empty_table(self)
    cpdef bytes _owed(self)
    @cython.locals(st=_Stream)
    cpdef _stream(self, Py_ssize_t sid, object view)
    cpdef _early_hints(self, Py_ssize_t sid, bytes head)
    @cython.locals(body=_Body)
    cpdef _ended(self, Py_ssize_t sid, Py_ssize_t window)
    @cython.locals(out=list, st=_Stream, left=Py_ssize_t, n=Py_ssize_t, pos=Py_ssize_t,
                   done=bint)
    cpdef _pump(self)
