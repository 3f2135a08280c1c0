/* net: blocking TCP helpers (endpoint parsing, connect with retry, listen, exact send/recv).
 *
 * Every address getaddrinfo returns is tried in order. net_connect keeps retrying refused or
 * unreachable peers with exponential backoff (10 ms doubling to 1 s) until its deadline,
 * because at startup the server we want is often not listening yet. Messages name the
 * endpoint as the user would type it ("connect [::1]:29400: connection refused").
 * This module knows nothing about the store protocol or libuv; it never logs. */
#include "common/net.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/err.h"

int64_t net_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* strerror() with a lower-case first letter, to read well after "connect x:y: ". */
static void err_text(char *out, size_t outlen, int e) {
  char tmp[128];
  snprintf(tmp, sizeof tmp, "%s", strerror(e));
  if (tmp[0] && isupper((unsigned char)tmp[0]) && !(tmp[1] && isupper((unsigned char)tmp[1])))
    tmp[0] = (char)tolower((unsigned char)tmp[0]);
  snprintf(out, outlen, "%s", tmp);
}

/* Parses a decimal port; returns it or -1. */
static int parse_port(const char *s, size_t n, int allow_zero) {
  if (n == 0 || n > 5) return -1;
  int v = 0;
  for (size_t i = 0; i < n; i++) {
    if (!isdigit((unsigned char)s[i])) return -1;
    v = v * 10 + (s[i] - '0');
  }
  if (v > 65535 || (v == 0 && !allow_zero)) return -1;
  return v;
}

static int host_chars_ok(const char *s, size_t n) {
  for (size_t i = 0; i < n; i++) {
    unsigned char c = (unsigned char)s[i];
    if (c <= ' ' || c == '[' || c == ']' || c == '/' || c >= 0x7f) return 0;
  }
  return 1;
}

int net_parse_endpoint(const char *s, char *host, size_t hostlen, int *port, int default_port,
                       int allow_zero, char *err, size_t errlen) {
  if (!s || !*s) {
    err_set(err, errlen, 0, "empty endpoint; expected HOST[:PORT]");
    return -EINVAL;
  }
  const char *h = s, *p = NULL;
  size_t hn, pn = 0;
  int bracketed = s[0] == '[';
  if (bracketed) {
    const char *close = strchr(s, ']');
    if (!close) {
      err_set(err, errlen, 0, "endpoint '%s': missing ']' after IPv6 address", s);
      return -EINVAL;
    }
    h = s + 1;
    hn = (size_t)(close - h);
    if (close[1] == ':') {
      p = close + 2;
      pn = strlen(p);
      if (pn == 0) {
        err_set(err, errlen, 0, "endpoint '%s': empty port after ':'", s);
        return -EINVAL;
      }
    } else if (close[1] != '\0') {
      err_set(err, errlen, 0, "endpoint '%s': junk after ']'; expected [ADDR]:PORT", s);
      return -EINVAL;
    }
  } else {
    const char *c1 = strchr(s, ':');
    if (c1 && strchr(c1 + 1, ':')) {
      /* Two or more colons and no brackets: a bare IPv6 literal, which cannot carry a port. */
      hn = strlen(s);
    } else if (c1) {
      hn = (size_t)(c1 - s);
      p = c1 + 1;
      pn = strlen(p);
      if (pn == 0) {
        err_set(err, errlen, 0, "endpoint '%s': empty port after ':'", s);
        return -EINVAL;
      }
    } else {
      hn = strlen(s);
    }
  }
  if (hn == 0) {
    err_set(err, errlen, 0, "endpoint '%s': empty host", s);
    return -EINVAL;
  }
  if (!host_chars_ok(h, hn)) {
    err_set(err, errlen, 0, "endpoint '%s': invalid character in host", s);
    return -EINVAL;
  }
  if (hn >= hostlen) {
    err_set(err, errlen, 0, "endpoint '%s': host longer than %zu bytes", s, hostlen ? hostlen - 1 : 0);
    return -EINVAL;
  }
  char tmp[256];
  if (bracketed || memchr(h, ':', hn)) {
    struct in6_addr a6;
    if (hn >= sizeof tmp) {
      err_set(err, errlen, 0, "endpoint '%s': invalid IPv6 address", s);
      return -EINVAL;
    }
    memcpy(tmp, h, hn);
    tmp[hn] = '\0';
    char *pct = strchr(tmp, '%'); /* a zone id ("fe80::1%eth0") is not part of inet_pton's syntax */
    if (pct) *pct = '\0';
    if (inet_pton(AF_INET6, tmp, &a6) != 1) {
      err_set(err, errlen, 0, "endpoint '%s': '%.*s' is not an IPv6 address", s, (int)hn, h);
      return -EINVAL;
    }
  }
  int pv = default_port;
  if (p) {
    pv = parse_port(p, pn, allow_zero);
    if (pv < 0) {
      err_set(err, errlen, 0, "endpoint '%s': bad port '%s'; expected %d..65535", s, p, allow_zero ? 0 : 1);
      return -EINVAL;
    }
  }
  memcpy(host, h, hn);
  host[hn] = '\0';
  *port = pv;
  return 0;
}

void net_format_endpoint(char *out, size_t outlen, const char *host, int port) {
  if (strchr(host, ':')) snprintf(out, outlen, "[%s]:%d", host, port);
  else snprintf(out, outlen, "%s:%d", host, port);
}

static int resolve(const char *host, int port, int passive, struct addrinfo **res, char *err, size_t errlen) {
  struct addrinfo hints;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_protocol = IPPROTO_TCP;
  if (passive) hints.ai_flags |= AI_PASSIVE;
  char ps[16];
  snprintf(ps, sizeof ps, "%d", port);
  int rc = getaddrinfo(host && *host ? host : NULL, ps, &hints, res);
  if (rc == 0) return 0;
  char ep[300];
  net_format_endpoint(ep, sizeof ep, host && *host ? host : "*", port);
  err_set(err, errlen, 0, "resolve %s: %s", ep, rc == EAI_SYSTEM ? strerror(errno) : gai_strerror(rc));
  return rc == EAI_AGAIN ? -EAGAIN : -ENOENT;
}

/* One connect attempt bounded by timeout_ms (< 0: the kernel's own limit). Returns the fd in
 * blocking mode or -errno. */
static int connect_one(const struct addrinfo *ai, int timeout_ms) {
  int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
  if (fd < 0) return -errno;
  int rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
  if (rc < 0 && errno != EINPROGRESS) {
    int e = errno;
    close(fd);
    return -e;
  }
  if (rc < 0) {
    int64_t deadline = timeout_ms < 0 ? -1 : net_now_ms() + timeout_ms;
    for (;;) {
      struct pollfd pfd = {.fd = fd, .events = POLLOUT};
      int wait = deadline < 0 ? -1 : (int)(deadline - net_now_ms() > 0 ? deadline - net_now_ms() : 0);
      int n = poll(&pfd, 1, wait);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        int e = errno;
        close(fd);
        return -e;
      }
      if (n == 0) {
        close(fd);
        return -ETIMEDOUT;
      }
      break;
    }
    int soerr = 0;
    socklen_t sl = sizeof soerr;
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) < 0) soerr = errno;
    if (soerr) {
      close(fd);
      return -soerr;
    }
  }
  int fl = fcntl(fd, F_GETFL);
  fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

/* Errors worth another try: the server may simply not be up yet, or the route not ready. */
static int retryable(int e) {
  return e == ECONNREFUSED || e == ENETUNREACH || e == EHOSTUNREACH || e == ETIMEDOUT ||
         e == ECONNRESET || e == EAGAIN || e == ECONNABORTED;
}

/* One try at every address of host:port before deadline (< 0: none): the fd, or a negative
 * errno (a refusal preferred) with the reason in err. */
static int connect_any(const char *host, int port, const char *ep, int64_t deadline, char *err, size_t errlen) {
  struct addrinfo *res = NULL;
  int rc = resolve(host, port, 0, &res, err, errlen);
  if (rc) return rc;
  int last = 0;
  for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
    int left = deadline < 0 ? -1 : (int)(deadline - net_now_ms() > 0 ? deadline - net_now_ms() : 1);
    int fd = connect_one(ai, left);
    if (fd >= 0) {
      freeaddrinfo(res);
      return fd;
    }
    /* Prefer a refusal over, say, "address family not supported" from an unused family. */
    if (!last || -fd == ECONNREFUSED) last = -fd;
  }
  freeaddrinfo(res);
  char et[128];
  err_text(et, sizeof et, last);
  err_set(err, errlen, 0, "connect %s: %s", ep, et);
  return -last;
}

int net_connect_once(const char *host, int port, int timeout_ms, char *err, size_t errlen) {
  char ep[300];
  net_format_endpoint(ep, sizeof ep, host, port);
  return connect_any(host, port, ep, timeout_ms < 0 ? -1 : net_now_ms() + timeout_ms, err, errlen);
}

int net_connect(const char *host, int port, int timeout_ms, char *err, size_t errlen) {
  char ep[300];
  net_format_endpoint(ep, sizeof ep, host, port);
  int64_t start = net_now_ms();
  int64_t deadline = timeout_ms < 0 ? -1 : start + timeout_ms;
  int backoff = 10;
  for (;;) {
    int rc = connect_any(host, port, ep, deadline, err, errlen);
    if (rc >= 0) return rc;
    if (!retryable(-rc)) return rc;
    int64_t t = net_now_ms();
    if (deadline >= 0 && t >= deadline) {
      size_t n = err ? strlen(err) : 0;
      if (err && n + 1 < errlen)
        snprintf(err + n, errlen - n, " (gave up after %lld ms)", (long long)(t - start));
      return rc;
    }
    int64_t nap = backoff;
    if (deadline >= 0 && deadline - t < nap) nap = deadline - t;
    struct timespec ts = {.tv_sec = nap / 1000, .tv_nsec = (nap % 1000) * 1000000};
    nanosleep(&ts, NULL);
    if (backoff < 1000) backoff *= 2;
  }
}

/* Binds and listens on one address; returns the fd or -errno. */
static int listen_one(const struct sockaddr *sa, socklen_t salen, int v6only, int backlog) {
  int fd = socket(sa->sa_family, SOCK_STREAM | SOCK_CLOEXEC, IPPROTO_TCP);
  if (fd < 0) return -errno;
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (sa->sa_family == AF_INET6) setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, sizeof v6only);
  if (bind(fd, sa, salen) < 0 || listen(fd, backlog) < 0) {
    int e = errno;
    close(fd);
    return -e;
  }
  return fd;
}

/* The port fd is bound to, or -1 when getsockname fails. */
static int bound_port_of(int fd) {
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  if (getsockname(fd, (struct sockaddr *)&ss, &sl) < 0) return -1;
  if (ss.ss_family == AF_INET) return ntohs(((struct sockaddr_in *)&ss)->sin_port);
  return ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
}

int net_listen(const char *host, int port, int backlog, int *bound_port, char *err, size_t errlen) {
  char ep[300];
  net_format_endpoint(ep, sizeof ep, host && *host ? host : "*", port);
  int fd = -EADDRNOTAVAIL;
  if (!host || !*host) {
    /* Any address: one dual-stack IPv6 socket serves both families; fall back to IPv4 only
     * where the kernel has no IPv6. */
    struct sockaddr_in6 a6;
    memset(&a6, 0, sizeof a6);
    a6.sin6_family = AF_INET6;
    a6.sin6_addr = in6addr_any;
    a6.sin6_port = htons((uint16_t)port);
    fd = listen_one((struct sockaddr *)&a6, sizeof a6, 0, backlog);
    if (fd == -EAFNOSUPPORT || fd == -EADDRNOTAVAIL) {
      struct sockaddr_in a4;
      memset(&a4, 0, sizeof a4);
      a4.sin_family = AF_INET;
      a4.sin_addr.s_addr = htonl(INADDR_ANY);
      a4.sin_port = htons((uint16_t)port);
      fd = listen_one((struct sockaddr *)&a4, sizeof a4, 0, backlog);
    }
  } else {
    struct addrinfo *res = NULL;
    int rc = resolve(host, port, 1, &res, err, errlen);
    if (rc < 0) return rc;
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
      fd = listen_one(ai->ai_addr, ai->ai_addrlen, 1, backlog);
      if (fd >= 0 || fd == -EADDRINUSE) break;
    }
    freeaddrinfo(res);
  }
  if (fd < 0) {
    char et[128];
    err_text(et, sizeof et, -fd);
    err_set(err, errlen, 0, "listen %s: %s", ep, et);
    return fd;
  }
  if (bound_port) *bound_port = bound_port_of(fd);
  return fd;
}

/* Order for net_listen_all: family, then address bytes. Any fixed order does; what matters is
 * that every process binding the same name walks the addresses in the same one. */
static int addr_cmp(const void *pa, const void *pb) {
  const struct addrinfo *a = *(const struct addrinfo *const *)pa, *b = *(const struct addrinfo *const *)pb;
  if (a->ai_family != b->ai_family) return a->ai_family < b->ai_family ? -1 : 1;
  if (a->ai_family == AF_INET)
    return memcmp(&((const struct sockaddr_in *)a->ai_addr)->sin_addr,
                  &((const struct sockaddr_in *)b->ai_addr)->sin_addr, sizeof(struct in_addr));
  if (a->ai_family == AF_INET6)
    return memcmp(&((const struct sockaddr_in6 *)a->ai_addr)->sin6_addr,
                  &((const struct sockaddr_in6 *)b->ai_addr)->sin6_addr, sizeof(struct in6_addr));
  return 0;
}

static void set_port(struct sockaddr *sa, int port) {
  if (sa->sa_family == AF_INET) ((struct sockaddr_in *)sa)->sin_port = htons((uint16_t)port);
  else if (sa->sa_family == AF_INET6) ((struct sockaddr_in6 *)sa)->sin6_port = htons((uint16_t)port);
}

int net_listen_all(const char *host, int port, int backlog, int *fds, int maxfds, int *bound_port, char *err,
                   size_t errlen) {
  if (!host || !*host || maxfds < 1) {
    if (maxfds < 1) {
      err_set(err, errlen, 0, "net_listen_all: no room for a socket");
      return -EINVAL;
    }
    int fd = net_listen(host, port, backlog, bound_port, err, errlen);
    if (fd < 0) return fd;
    fds[0] = fd;
    return 1;
  }
  char ep[300];
  net_format_endpoint(ep, sizeof ep, host, port);
  struct addrinfo *res = NULL;
  int rc = resolve(host, port, 1, &res, err, errlen);
  if (rc < 0) return rc;
  int na = 0;
  for (struct addrinfo *ai = res; ai; ai = ai->ai_next) na++;
  struct addrinfo **v = calloc((size_t)na, sizeof *v);
  if (!v) {
    freeaddrinfo(res);
    err_set(err, errlen, 0, "listen %s: out of memory", ep);
    return -ENOMEM;
  }
  na = 0;
  for (struct addrinfo *ai = res; ai; ai = ai->ai_next)
    if (ai->ai_family == AF_INET || ai->ai_family == AF_INET6) v[na++] = ai;
  qsort(v, (size_t)na, sizeof *v, addr_cmp);
  int n = 0, last = -EADDRNOTAVAIL, bp = port;
  for (int i = 0; i < na; i++) {
    /* /etc/hosts may name an address twice: binding it again would collide with ourselves. */
    if (i > 0 && addr_cmp(&v[i - 1], &v[i]) == 0) continue;
    set_port(v[i]->ai_addr, bp);
    int fd = listen_one(v[i]->ai_addr, v[i]->ai_addrlen, 1, backlog);
    if (fd >= 0) {
      if (n == maxfds) {
        close(fd);
        break;
      }
      fds[n++] = fd;
      if (bp == 0) bp = bound_port_of(fd); /* port 0: the rest take the port the first got */
      continue;
    }
    last = fd;
    /* A taken address means the endpoint is someone else's (another meshrun, or a foreign
     * program): serving on the rest would split the job between two stores. With a kernel-
     * chosen port nobody competes for it, so such an address is only skipped. Addresses this
     * machine cannot bind (no IPv6, not ours) are skipped. */
    if (fd == -EADDRINUSE && port != 0) {
      for (int j = 0; j < n; j++) close(fds[j]);
      n = 0;
      break;
    }
  }
  free(v);
  freeaddrinfo(res);
  if (n == 0) {
    char et[128];
    err_text(et, sizeof et, -last);
    err_set(err, errlen, 0, "listen %s: %s", ep, et);
    return last;
  }
  if (bound_port) *bound_port = bp;
  return n;
}

int net_free_port(const char *host, int *port, char *err, size_t errlen) {
  int fd = net_listen(host, 0, 1, port, err, errlen);
  if (fd < 0) return fd;
  close(fd);
  return 0;
}

int net_send_all(int fd, const void *buf, size_t len) {
  const char *p = buf;
  while (len > 0) {
    ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EPIPE) return -ECONNRESET;
      return -errno;
    }
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

ssize_t net_recv_some(int fd, void *buf, size_t min, size_t len, int timeout_ms) {
  char *p = buf;
  size_t got = 0;
  int64_t deadline = timeout_ms < 0 ? -1 : net_now_ms() + timeout_ms;
  while (got < min) {
    if (deadline >= 0) {
      int64_t left = deadline - net_now_ms();
      if (left < 0) left = 0;
      struct pollfd pfd = {.fd = fd, .events = POLLIN};
      int r = poll(&pfd, 1, (int)left);
      if (r < 0) {
        if (errno == EINTR) continue;
        return -errno;
      }
      if (r == 0) return -ETIMEDOUT;
    }
    ssize_t n = recv(fd, p + got, len - got, 0);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return -errno;
    }
    if (n == 0) return -ECONNRESET;
    got += (size_t)n;
  }
  return (ssize_t)got;
}

int net_recv_all(int fd, void *buf, size_t len, int timeout_ms) {
  ssize_t n = net_recv_some(fd, buf, len, len, timeout_ms);
  return n < 0 ? (int)n : 0;
}

void net_hostname(char *buf, size_t len) {
  if (!buf || !len) return;
  if (gethostname(buf, len) == 0) {
    buf[len - 1] = '\0';
    if (buf[0]) return;
  }
  snprintf(buf, len, "localhost");
}

int net_local_addr_toward(const char *host, int port, char *buf, size_t len) {
  char ps[16];
  snprintf(ps, sizeof ps, "%d", port);
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_DGRAM}, *res = NULL;
  int g = getaddrinfo(host, ps, &hints, &res);
  if (g) return g == EAI_SYSTEM ? -errno : -EHOSTUNREACH;
  int rc = -EHOSTUNREACH;
  for (struct addrinfo *ai = res; ai && rc; ai = ai->ai_next) {
    int fd = socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    struct sockaddr_storage me;
    socklen_t ml = sizeof me;
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 && getsockname(fd, (struct sockaddr *)&me, &ml) == 0) {
      const void *a = me.ss_family == AF_INET6 ? (const void *)&((struct sockaddr_in6 *)&me)->sin6_addr
                                               : (const void *)&((struct sockaddr_in *)&me)->sin_addr;
      if (inet_ntop(me.ss_family, a, buf, (socklen_t)len)) rc = 0;
    }
    close(fd);
  }
  freeaddrinfo(res);
  return rc;
}
