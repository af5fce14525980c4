# The OpenSSL declarations compiled_tls.pyx uses (libssl, libcrypto: Debian's libssl-dev).
# Several are macros in the headers (SSL_CTX_set_min_proto_version, SSL_CTX_add0_chain_cert,
# SSL_CTX_set_mode, BIO_set_retry_read…): declared as functions, expanded by the compiler.

from libc.stdint cimport uint64_t

cdef extern from "<openssl/ssl.h>" nogil:
    ctypedef struct SSL_CTX:
        pass
    ctypedef struct SSL:
        pass
    ctypedef struct SSL_METHOD:
        pass
    ctypedef struct BIO:
        pass
    ctypedef struct BIO_METHOD:
        pass
    ctypedef struct X509:
        pass
    ctypedef struct EVP_PKEY:
        pass
    ctypedef int (*pem_password_cb)(char *, int, int, void *)
    ctypedef int (*alpn_select_cb)(SSL *, const unsigned char **, unsigned char *,
                                   const unsigned char *, unsigned int, void *)

    int SSL_ERROR_SSL, SSL_ERROR_WANT_READ, SSL_ERROR_SYSCALL, SSL_ERROR_ZERO_RETURN
    int SSL_TLSEXT_ERR_OK, SSL_TLSEXT_ERR_NOACK, OPENSSL_NPN_NEGOTIATED
    int TLSEXT_NAMETYPE_host_name
    long SSL_MODE_RELEASE_BUFFERS, SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER, SSL_MODE_AUTO_RETRY
    int SSL_R_UNEXPECTED_EOF_WHILE_READING

    const SSL_METHOD *TLS_server_method()
    SSL_CTX *SSL_CTX_new(const SSL_METHOD *)
    void SSL_CTX_free(SSL_CTX *)
    int SSL_CTX_set_min_proto_version(SSL_CTX *, int)
    int SSL_CTX_set_max_proto_version(SSL_CTX *, int)
    uint64_t SSL_CTX_set_options(SSL_CTX *, uint64_t)
    uint64_t SSL_CTX_clear_options(SSL_CTX *, uint64_t)
    long SSL_CTX_set_mode(SSL_CTX *, long)
    int SSL_CTX_set_cipher_list(SSL_CTX *, const char *)
    int SSL_CTX_set_ciphersuites(SSL_CTX *, const char *)
    int SSL_CTX_set_num_tickets(SSL_CTX *, size_t)
    int SSL_CTX_set_session_id_context(SSL_CTX *, const unsigned char *, unsigned int)
    void SSL_CTX_set_alpn_select_cb(SSL_CTX *, alpn_select_cb, void *)
    int SSL_select_next_proto(unsigned char **, unsigned char *, const unsigned char *,
                              unsigned int, const unsigned char *, unsigned int)
    int SSL_CTX_use_certificate(SSL_CTX *, X509 *)
    long SSL_CTX_add0_chain_cert(SSL_CTX *, X509 *)
    int SSL_CTX_use_PrivateKey(SSL_CTX *, EVP_PKEY *)
    int SSL_CTX_check_private_key(const SSL_CTX *)

    SSL *SSL_new(SSL_CTX *)
    void SSL_free(SSL *)
    void SSL_set_bio(SSL *, BIO *, BIO *)
    void SSL_set_accept_state(SSL *)
    long SSL_set_mode(SSL *, long)
    int SSL_free_buffers(SSL *)
    int SSL_do_handshake(SSL *)
    int SSL_read(SSL *, void *, int)
    int SSL_write(SSL *, const void *, int)
    int SSL_shutdown(SSL *)
    int SSL_get_error(const SSL *, int)
    int SSL_pending(const SSL *)
    void SSL_get0_alpn_selected(const SSL *, const unsigned char **, unsigned int *)
    const char *SSL_get_servername(const SSL *, int)

cdef extern from "<openssl/bio.h>":
    # The write callback holds the GIL (it makes bytes): OpenSSL calls it from SSL_* calls
    # made with the GIL held.
    ctypedef int (*bio_write_cb)(BIO *, const char *, int)
    ctypedef int (*bio_read_cb)(BIO *, char *, int)
    ctypedef long (*bio_ctrl_cb)(BIO *, int, long, void *)

cdef extern from "<openssl/bio.h>" nogil:
    int BIO_TYPE_SOURCE_SINK, BIO_CTRL_FLUSH, BIO_CTRL_PENDING, BIO_CTRL_EOF
    int BIO_get_new_index()
    BIO_METHOD *BIO_meth_new(int, const char *)
    int BIO_meth_set_write(BIO_METHOD *, bio_write_cb)
    int BIO_meth_set_read(BIO_METHOD *, bio_read_cb)
    int BIO_meth_set_ctrl(BIO_METHOD *, bio_ctrl_cb)
    void BIO_set_retry_read(BIO *)
    void BIO_clear_retry_flags(BIO *)
    void BIO_set_data(BIO *, void *)
    void *BIO_get_data(BIO *)
    void BIO_set_init(BIO *, int)
    BIO *BIO_new(const BIO_METHOD *)
    BIO *BIO_new_mem_buf(const void *, int)
    int BIO_free(BIO *)

cdef extern from "<openssl/pem.h>" nogil:
    X509 *PEM_read_bio_X509_AUX(BIO *, X509 **, pem_password_cb, void *)
    X509 *PEM_read_bio_X509(BIO *, X509 **, pem_password_cb, void *)
    EVP_PKEY *PEM_read_bio_PrivateKey(BIO *, EVP_PKEY **, pem_password_cb, void *)

cdef extern from "<openssl/x509.h>" nogil:
    void X509_free(X509 *)

cdef extern from "<openssl/evp.h>" nogil:
    void EVP_PKEY_free(EVP_PKEY *)

cdef extern from "<openssl/err.h>" nogil:
    void ERR_clear_error()
    unsigned long ERR_peek_error()
    int ERR_GET_REASON(unsigned long)
