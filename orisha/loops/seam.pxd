# The loop-body contract of orisha/loops/base.py at C level, for the compiled loop bodies and
# the compiled TLS layer (which drives its inner connection through the same contract).
#
# A connection whose class is the compiled core's ``Connection`` itself, or the class a
# protocols object names as its HTTP/1.1 connections (``h1_type``: ``front.Http1``, which
# overrides none of the contract), or a protocols object's own connections with a table of
# C calls (``connection_type`` and its ``calls`` capsule: the compiled TLS layer's
# ``TlsConnection``), gets its
# contract calls as C calls through a ``Calls`` table: no attribute lookup, no bound method,
# no boxed ``now`` (the last profile of the compiled epoll worker put a fifth of its time
# in libpython, mostly that). Every other connection — ``Sniffing`` before its first read,
# ``H2Front``, any pure class — is called through Python as before (``Calls`` NULL). The
# kind is read from the class, never assumed: ``Sniffing`` becomes ``Http1`` or ``H2Front``
# on its first read, so a NULL table is looked up again (``calls_of``: three pointer
# compares). The cdef-typed calls need the compiled core: ``orisha.loops.module`` and
# ``tls._compiled_layer`` choose the compiled bodies and layer only with it.

from cpython.object cimport PyObject, PyTypeObject, Py_TYPE
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_IsValid
from ..core.connection cimport Connection

ctypedef int (*receive_f)(object, bytes, double) except -1
ctypedef int (*sent_f)(object, Py_ssize_t, double) except -1
ctypedef list (*outgoing_f)(object)
ctypedef bint (*flag_f)(object) except -1

ctypedef struct Calls:
    receive_f receive
    sent_f sent
    outgoing_f outgoing
    flag_f wants_read
    flag_f should_close
    flag_f shut_write

ctypedef struct Kinds:
    PyTypeObject *core     # orisha.core.connection.Connection
    PyTypeObject *h1       # orisha.protocols.front.Http1
    PyTypeObject *tls      # the compiled TLS layer's TlsConnection, or NULL
    Calls h1_calls
    const Calls *tls_calls

# The capsule name of a layer's table (``Tls.calls`` in compiled_tls.pyx).
cdef extern from *:
    """
    #define ORISHA_CALLS "orisha.loops.seam.Calls"
    """
    const char *ORISHA_CALLS


# -- the compiled core's HTTP/1.1 connection (the Connection methods, called unbound: no
# override check either, as neither Http1 nor Connection overrides them)
cdef inline int _h1_receive(object c, bytes data, double now) except -1:
    Connection.receive(<Connection>c, data, now)
    return 0

cdef inline int _h1_sent(object c, Py_ssize_t n, double now) except -1:
    Connection.sent(<Connection>c, n, now)
    return 0

cdef inline list _h1_outgoing(object c):
    return (<Connection>c).out

cdef inline bint _h1_wants_read(object c) except -1:
    return Connection.reading(<Connection>c)

cdef inline bint _h1_should_close(object c) except -1:
    return (<Connection>c).should_close

cdef inline bint _h1_shut_write(object c) except -1:
    return (<Connection>c).shut_write


cdef inline int kinds_init(Kinds *k, object protocols) except -1:
    """The kinds a module calls at C level, as ``protocols`` registers them: the core's
    Connection always; its ``h1_type`` (the class its HTTP/1.1 connections become, a core
    Connection that overrides none of the contract); its ``connection_type`` where it has
    a ``calls`` capsule of C calls (the compiled TLS layer's ``Tls``)."""
    k.core = <PyTypeObject *>Connection
    h1 = getattr(protocols, "h1_type", None)
    if h1 is not None and not issubclass(h1, Connection):
        raise TypeError(f"{h1!r}: an h1_type is a subclass of the core's Connection")
    k.h1 = <PyTypeObject *>h1 if h1 is not None else NULL
    k.h1_calls.receive = _h1_receive
    k.h1_calls.sent = _h1_sent
    k.h1_calls.outgoing = _h1_outgoing
    k.h1_calls.wants_read = _h1_wants_read
    k.h1_calls.should_close = _h1_should_close
    k.h1_calls.shut_write = _h1_shut_write
    k.tls, k.tls_calls = NULL, NULL
    capsule = getattr(protocols, "calls", None)
    if capsule is not None and PyCapsule_IsValid(capsule, ORISHA_CALLS):
        k.tls_calls = <const Calls *>PyCapsule_GetPointer(capsule, ORISHA_CALLS)
        k.tls = <PyTypeObject *>protocols.connection_type
    return 0


cdef inline const Calls *calls_of(const Kinds *k, object conn) noexcept:
    """``conn``'s table, or NULL: called through Python."""
    cdef PyTypeObject *t = Py_TYPE(conn)
    if t == k.h1 or t == k.core:  # k.h1 NULL: never a connection's type
        return &k.h1_calls
    if t == k.tls and t != NULL:
        return k.tls_calls
    return NULL


# -- the contract, through the table or (NULL) through Python
cdef inline int receive(const Calls *k, object conn, bytes data, double now) except -1:
    if k != NULL:
        return k.receive(conn, data, now)
    conn.receive(data, now)
    return 0

cdef inline int sent(const Calls *k, object conn, Py_ssize_t n, double now) except -1:
    if k != NULL:
        return k.sent(conn, n, now)
    conn.sent(n, now)
    return 0

cdef inline list outgoing(const Calls *k, object conn):
    return k.outgoing(conn) if k != NULL else conn.outgoing

cdef inline bint wants_read(const Calls *k, object conn) except -1:
    return k.wants_read(conn) if k != NULL else conn.wants_read

cdef inline bint should_close(const Calls *k, object conn) except -1:
    return k.should_close(conn) if k != NULL else conn.should_close

cdef inline bint shut_write(const Calls *k, object conn) except -1:
    return k.shut_write(conn) if k != NULL else conn.shut_write
