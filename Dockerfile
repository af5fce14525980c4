# The Orisha container image: FROM scratch, exactly one static executable.
#
#   orisha build SITE --target container -o OUT     # OUT/orisha, OUT/init, OUT/rootfs/tmp/ (empty, 1777), OUT/Dockerfile
#   docker build -t my-site OUT                     # OUT/Dockerfile is a copy of this file
#   docker run --rm -p 127.0.0.1:8080:8080 my-site  # PORT, HOST, WORKERS or --port ... to configure
#
# No base image is pulled. /init (orisha/targets/container/init.c, compiled static) is PID 1: it
# runs /orisha, forwards its signals and reaps every orphan. The executable carries Python, Orisha, the build's loop and the
# compiled site (README "Container"); /tmp must be writable and exec-allowed because the
# frozen interpreter unpacks there at start (with --read-only, add
# --tmpfs /tmp:rw,exec,nosuid,nodev,size=128m). OUT/.dockerignore keeps the context to
# these three entries. With registry access, a multi-stage build works too (README).
FROM scratch
COPY orisha /orisha
COPY init /init
# rootfs/ holds only an empty tmp/ of mode 1777. Copying the directory's contents keeps the
# context's modes (`COPY tmp /tmp` would not), so /tmp arrives world-writable and sticky
# without a shell or RUN.
COPY rootfs/ /
ENV PORT=8080
# The admin port: /healthz, /readyz and /metrics (orisha/serving/admin.py), answered by the supervisor.
ENV ADMIN_PORT=9090
# 8080/udp: HTTP/3 (QUIC) beside TLS on 8080/tcp, on by default with --tls-cert.
EXPOSE 8080 8080/udp 9090
USER 65534:65534
# SIGTERM: stop accepting, finish in-flight responses (up to --grace), exit 0.
STOPSIGNAL SIGTERM
# No shell or curl in the image: /init probes the admin port (`/init --health` = GET
# http://127.0.0.1:$ADMIN_PORT/readyz, exit 0 on a 2xx), as `/orisha --health` does, but in one
# process of a millisecond: nothing forked or unpacked into /tmp, so a check Docker kills
# after its timeout leaves nothing behind (`/orisha --health` starts three processes).
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 CMD ["/init", "--health"]
# `docker run IMAGE --port 8000` runs `/init /orisha --port 8000`.
ENTRYPOINT ["/init", "/orisha"]
