/* net: small socket helpers shared by the store client, the launcher and the cpu comm backend.
 *
 * Addresses are "host" strings as users type them: IPv4 literals, IPv6 literals (without
 * brackets here) and hostnames, resolved with getaddrinfo; every returned address is tried.
 * Errors return a negative errno-style code and a one-line message in err that names the
 * address ("connect [::1]:29400: connection refused"). */
#ifndef MESHRUN_NET_H
#define MESHRUN_NET_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* Splits "host", "host:port", "[v6]:port", "[v6]" or a bare IPv6 literal ("::1") into host
 * (without brackets) and port (default_port when absent). Rejects empty hosts, ports outside
 * 1..65535 (0 allowed only when allow_zero) and junk. Returns 0 or -EINVAL. */
int net_parse_endpoint(const char *s, char *host, size_t hostlen, int *port, int default_port,
                       int allow_zero, char *err, size_t errlen);
/* Formats host:port, bracketing IPv6 literals. */
void net_format_endpoint(char *out, size_t outlen, const char *host, int port);
/* Connects a TCP socket (TCP_NODELAY, blocking, CLOEXEC) to any address of host:port. Refused or
 * unreachable connections are retried with backoff until timeout_ms (< 0: forever) passes.
 * Returns the fd, or a negative code with the reason in err. */
int net_connect(const char *host, int port, int timeout_ms, char *err, size_t errlen);
/* net_connect without the retries: each address once, a refusal answered at once. */
int net_connect_once(const char *host, int port, int timeout_ms, char *err, size_t errlen);
/* Creates a listening TCP socket on host:port (port 0: the kernel picks; host "" = any) and
 * returns the fd; *bound_port gets the real port. -EADDRINUSE when the port is taken. */
int net_listen(const char *host, int port, int backlog, int *bound_port, char *err, size_t errlen);
/* Like net_listen, but listens on every address host resolves to (up to maxfds sockets, all on
 * one port) so that a client meets the server whichever address it tries first ("localhost"
 * may give ::1 and 127.0.0.1). Addresses are bound in a fixed order, the same in every
 * process, so two processes racing for one endpoint collide on the first address and exactly
 * one wins. When any address is taken (port > 0) nothing stays bound and -EADDRINUSE is
 * returned. host "" is one dual-stack socket. Returns the number of fds in fds, or a
 * negative code with the reason in err. */
int net_listen_all(const char *host, int port, int backlog, int *fds, int maxfds, int *bound_port, char *err,
                   size_t errlen);
/* A port that was free a moment ago on host (bind port 0, read it, close). Racy by nature:
 * used only for ports another program binds itself (MASTER_PORT). */
int net_free_port(const char *host, int *port, char *err, size_t errlen);
/* Sends/receives exactly len bytes (retrying EINTR and short transfers). 0, or negative errno
 * (-ECONNRESET when the peer closed). timeout_ms < 0: no timeout (recv only). */
int net_send_all(int fd, const void *buf, size_t len);
int net_recv_all(int fd, void *buf, size_t len, int timeout_ms);
/* Receives at least min and at most len bytes (what has arrived past min, up to len, comes
 * in the same call: a reply's header and a small body in one recv). The count, or negative
 * errno as net_recv_all. */
ssize_t net_recv_some(int fd, void *buf, size_t min, size_t len, int timeout_ms);
/* Milliseconds on the monotonic clock: the clock of every deadline in net, store and comm. */
int64_t net_now_ms(void);
/* This machine's hostname (never fails: "localhost" as a last resort). */
void net_hostname(char *buf, size_t len);
/* The local address this machine would use to reach host:port (the routing table's choice,
 * found by connecting a UDP socket, which sends nothing), numeric, into buf. 0, or -errno when
 * host does not resolve or no route leads there. */
int net_local_addr_toward(const char *host, int port, char *buf, size_t len);

#endif
