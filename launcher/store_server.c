/* store_server: meshrun's key-value store on a libuv loop (API in store_server.h, wire format
 * in common/store_proto.h).
 *
 * A connection first shakes hands (HELLO, then AUTH when the store has a secret; the exchange
 * is in store_proto.h). Until it is done the connection sits on the "unauthenticated" list,
 * oldest first, under a deadline, may send only frames of STORE_PROTO_PREAUTH_FRAME bytes, and
 * any other request closes it. Once done it belongs to its job: every key it names is kept
 * under that job's namespace (a prefix of one byte of run id length and the run id, which no
 * key of another job can produce), so jobs sharing a store never meet.
 *
 * Each connection reads into one buffer that holds at most the frame being received. A header
 * is checked as soon as its 8 bytes arrive, so a frame announcing 1 GiB or a foreign
 * magic/version closes that connection before anything is buffered. The buffer grows only as
 * bytes arrive (doubling when full, never past the announced length), and a frame bigger than
 * BASE_BUF must first fit in what is left of the server's budget for partly received frames,
 * or the connection is refused with STORE_EBUSY: twenty connections announcing 64 MiB and
 * sending half cost what they sent, within the budget, not 64 MiB each. Such a frame must keep
 * coming (frame_ms): one that stalls is dropped and its share of the budget released, so that
 * four stalled 64 MiB frames cannot keep everyone else's big SETs out for good. An idle
 * connection holds no buffer at all.
 *
 * A waiting request (GET, WAIT, MULTI_GET) parks the connection: its payload is copied, a timer
 * armed, and the connection is filed under the first of its keys that is missing, in a hash
 * table of waiters by key. A write wakes only the waiters filed under the key it wrote, which
 * look for their next missing key (filed again under it) or are answered. So a write costs the
 * same whether one or thousands of requests wait (rechecking every waiter on every write made
 * a 2048-node rendezvous, with a waiter per node, quadratic in the nodes). While parked a
 * connection handles no further frames (replies must keep request order). Replies that the
 * client does not read pile up to STORE_MAX_FRAME at most, then reading from it stops until
 * they drain. Nothing here blocks.
 *
 * Closing, two ways. Refusals a client must be able to read (wrong secret, a request before
 * the handshake, over a limit, a stalled frame) send an ERROR, shut down our side once it is
 * written and wait LINGER_MS for the client's EOF, discarding what it sends: closing at once
 * with its request unread would reset the connection and could lose the ERROR. At most
 * MAX_LINGER refused connections wait so (the oldest is closed when one more comes), and they
 * count against no limit but that one: each holds a descriptor. Evictions and the handshake
 * deadline write the ERROR only if the socket takes it at once, then close.
 *
 * Descriptors. The store holds at most max_conns connections that are not refused plus
 * MAX_LINGER refused ones; the rest of the file limit (fd_reserve) is the host's: the agent
 * serving the store restarts workers (pipes, a listener for MASTER_PORT), and a store that
 * took the last descriptor would end the job it serves. Past the handshake each peer address
 * may hold max_conns_per_host connections: one host that holds the secret, or a client that
 * leaks connections, cannot take the others' room.
 *
 * Not here: persistence, per-job quotas beyond the whole store's STORE_SERVER_MAX_BYTES. */
#include "launcher/store_server.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/err.h"
#include "common/log.h"
#include "common/net.h"
#include "common/store.h"
#include "common/store_proto.h"

/* Default limits (store_server_opts_t fields left 0), and why:
 *
 * - max_conns: the soft RLIMIT_NOFILE less fd_reserve (NOFILE_RESERVE by default) and
 *   MAX_LINGER. The agent serving the store also opens its workers' pipes, log and error
 *   files, its listeners and libuv's own descriptors (three or four per worker), and running
 *   out of those must never be the store's doing; 256 covers 64 workers with room to spare
 *   (the agent passes a reserve sized for its own workers). Never below MIN_CONNS.
 * - max_conns_per_host: none but max_conns. Only the agent knows how many connections its job
 *   makes (a node's agent and workers), so it sets this one.
 * - max_unauth 64, max_unauth_per_addr 16: a real job's connections finish the handshake
 *   within a round trip or two, so even thousands of nodes starting at once rarely have more
 *   than a few in it at a time; 16 per address leaves room for a node's workers connecting
 *   together. Past a limit the oldest unauthenticated connection (of that address, for the
 *   per-address one) is closed: idle sockets of an attacker go first and a node arriving
 *   later still gets in, where a refusal of newcomers would lock every real node out.
 *   But only once it has had EVICT_GRACE_MS for its handshake: on a loaded host (1024 nodes
 *   emulated on 2 cores, all from 127.0.0.1) a real node can take tens of milliseconds to
 *   answer our HELLO with its AUTH, while hundreds of others connect, and evicting the
 *   oldest at once evicted real nodes about 4000 times in a start of 1024 nodes with a
 *   secret, each eviction making more (the node reconnects). Until then the limits are
 *   exceeded for a moment; what an attacker can hold is still bounded, by max_conns (past
 *   which the oldest goes at once, grace or not) and by the grace itself.
 * - handshake_ms 3000: the handshake is two round trips of under 100 bytes, milliseconds even
 *   across a data center or on a loaded host; three seconds is ample, and short enough that
 *   idle sockets do not pile up between evictions.
 * - inflight_budget 256 MiB: four frames of the STORE_MAX_FRAME maximum being received at
 *   once. Real jobs send a few big values at most (checkpoint metadata, comm bench payloads),
 *   one at a time per connection; the budget bounds what clients that announce big frames and
 *   stall can pin. Frames up to BASE_BUF (every rendezvous and heartbeat request) never wait
 *   on it, so big frames cannot starve them; those buffers are bounded by max_conns.
 * - frame_ms 10000, and FRAME_MIN_RATE: a client sends a frame with one blocking send, which
 *   the kernel carries on even while the client's process is descheduled; ten seconds without
 *   a byte is a dead or stalled peer even across TCP's retransmissions (a few seconds at
 *   worst), and 1 MiB/s on top is far below any network a job runs on, while it stops a peer
 *   that keeps a frame alive by trickling a byte at a time. A 64 MiB frame may take 74 s. */
#define NOFILE_RESERVE 256
#define MIN_CONNS 16
#define MAX_LINGER 16 /* refused connections waiting for their client's EOF */
#define DEFAULT_FRAME_MS 10000
#define FRAME_MIN_RATE (1u << 20) /* bytes per second a big frame must average, after frame_ms */
#define DEFAULT_MAX_UNAUTH 64
#define DEFAULT_MAX_UNAUTH_PER_ADDR 16
#define DEFAULT_HANDSHAKE_MS (STORE_HANDSHAKE_S * 1000)
#define EVICT_GRACE_MS 500 /* capped at half of handshake_ms */
#define DEFAULT_INFLIGHT_BUDGET ((size_t)256 << 20)

#define BASE_BUF 4096u              /* room every connection may hold for a frame, budget aside */
#define OUT_LIMIT STORE_MAX_FRAME   /* queued reply bytes that stop reading from a client */
#define WRITER_KEEP (64u << 10)     /* reply buffer kept for the next reply when written at once */
#define LINGER_MS 2000              /* wait for the client's EOF after a refusal */
#define WARN_INTERVAL_MS 1000       /* at most one rate-limited warning per interval */
#define RELISTEN_MS 500            /* pause of the last resort when accepting keeps failing */
#define ACCEPT_FAILURES_MAX 64     /* accept errors in a row (no success between) that pause it */
/* Connections the kernel completes before we accept them. Past it, the kernel drops the
 * client's SYN or final ACK and the client's TCP tries again after a second (its initial
 * retransmission timeout): 2048 nodes starting at once on loopback overflowed a backlog of
 * 1024 hundreds of times (TcpExtListenOverflows), each costing a node a second or more.
 * Linux caps it at net.core.somaxconn (4096 by default). */
#define LISTEN_BACKLOG 65535
#define MAX_LISTENERS 8 /* one per address the endpoint's host resolves to */

_Static_assert(STORE_PROTO_PREAUTH_FRAME <= BASE_BUF, "handshake frames never touch the budget");

/* A job's key namespace: the prefix of all its keys in the table. Lives while it has keys or
 * connections. */
typedef struct ns {
  struct ns *next;
  size_t nkeys;  /* keys stored under it */
  size_t nconns; /* authenticated connections of the job */
  uint64_t hash; /* FNV-1a state after the prefix: where hash_key starts */
  size_t len;    /* of prefix: 1 + run id length */
  uint8_t prefix[]; /* u8 run id length, run id bytes */
} ns_t;

/* The first member of every node of the chained hash tables here (keys, peers): its bucket's
 * chain and its whole hash, which is all that growing a table needs (links_grow). */
typedef struct link {
  struct link *next;
  uint64_t hash;
} link_t;

/* A peer address with connections past the handshake, for max_conns_per_host. Lives while it
 * has some. */
typedef struct {
  link_t link; /* first: the peer table holds peers as links */
  size_t nconns;
  char addr[48];
} peer_t;

typedef struct entry {
  link_t link;       /* first: the key table holds entries as links */
  size_t klen, vlen; /* klen includes the namespace prefix */
  uint8_t *val;      /* vlen bytes plus a NUL, so ADD can parse it in place */
  uint8_t key[];     /* namespace prefix, then the client's key */
} entry_t;

typedef struct {
  link_t **b; /* entries; nb a power of two (0: none yet) */
  size_t nb, n;
  size_t bytes; /* sum of key and value lengths, against STORE_SERVER_MAX_BYTES */
} table_t;

enum { CONN_HELLO = 0, CONN_AUTH, CONN_READY }; /* handshake progress */

/* Rate-limited warnings, each kind on its own clock, so that a flood of one kind never hides
 * the first of another: refusals at the connection limits (in all, per host) and dropped
 * stalled frames, the rest together. */
enum { WARN_MISC = 0, WARN_LIMITS, WARN_STALLS, WARN_KINDS };
typedef struct {
  int64_t last_ms;    /* last warning printed */
  size_t nsuppressed; /* warnings not printed since */
} warn_rate_t;

typedef struct conn conn_t;

/* Connections in order of arrival: those in the handshake, or the refused ones lingering. A
 * connection is on one queue at most. */
typedef struct {
  conn_t *head, *tail; /* oldest, newest */
  size_t n;
} queue_t;

struct conn {
  uv_tcp_t tcp;
  uv_timer_t timer;     /* the handshake deadline, then a parked request's timeout or the linger */
  uv_shutdown_t shut;   /* after a refusal */
  store_server_t *srv;
  conn_t *prev, *next;   /* all live connections */
  conn_t *wprev, *wnext; /* parked connections filed under the same waiter bucket */
  conn_t *rnext;         /* connections with buffered frames to resume */
  queue_t *queue;         /* &srv->unauth or &srv->linger while on it, else NULL */
  conn_t *qprev, *qnext;  /* its neighbours there */
  int on_ready, closing, handles_open;
  int finishing; /* refused: the ERROR is on its way, then our side shuts down */
  int state;     /* CONN_* */
  int foreign;   /* authenticated with a run id other than the hosting job's */
  uint64_t accepted_ms; /* uv_now() when accepted: its handshake's age */
  char peer[64]; /* address:port, for messages */
  char addr[48]; /* address alone, for the per-address limit */
  char run_id[STORE_MAX_RUN_ID + 1]; /* from HELLO */
  ns_t *ns;      /* once authenticated */
  peer_t *host;  /* its address's count, once past the handshake (until refused or closed) */
  uint8_t cnonce[STORE_PROTO_NONCE], snonce[STORE_PROTO_NONCE];

  uint8_t *buf;  /* received bytes not yet handled: [0, len) of cap; NULL when empty */
  size_t len, cap;
  uint32_t frame_len; /* announced length of the partly received frame at buf's head, 0: not known */
  size_t reserved;    /* bytes of the budget held for that frame */
  uint64_t frame_start_ms, frame_seen_ms; /* uv_now() when that frame was reserved, and when
                                           * its last bytes arrived */

  int parked_op; /* 0, or the op of the parked request */
  uint8_t *wpayload; /* owned copy of the parked request's payload */
  const uint8_t **wkeys; /* point into wpayload */
  size_t *wklens;
  size_t nwkeys;
  size_t wmissing;  /* index in wkeys of the key it is filed under (missing when filed) */
  uint64_t whash;   /* hash_key of that key */

  size_t out_pending; /* bytes handed to uv_write and not yet written */
  int out_paused;     /* reading stopped because out_pending passed OUT_LIMIT */
};

struct store_server {
  uv_loop_t *loop;
  uv_tcp_t listeners[MAX_LISTENERS];
  int nlisteners;          /* listening now (0 while paused) */
  int nlisteners_closing;  /* closed, their callbacks still to come */
  char *host;              /* what we listen on, for listening again */
  int port;                /* bound */
  uv_timer_t relisten;     /* ends a pause in accepting; takes the spare descriptor back */
  uv_timer_t limits;       /* the oldest handshake's grace ends: the limits are checked again */
  int spare_fd;            /* a descriptor kept to give back when out of them (-1: none) */
  int accept_failures;     /* accept errors since the last success */
  uv_idle_t idle; /* resumes connections whose parked request was answered */
  int closing, handles_open;
  conn_t *conns, *ready;
  conn_t **wbuckets; /* parked connections by the hash of the key they wait for; nwbuckets a
                      * power of two (0: none yet), grown to keep chains short */
  size_t nwbuckets;
  queue_t unauth; /* connections in the handshake */
  queue_t linger; /* refused connections waiting for their client's EOF */
  size_t nclients, nwaiters, nforeign; /* nclients counts the lingering too */
  link_t **pbuckets; /* peers by the hash of their address; npbuckets a power of two (0: none) */
  size_t npbuckets, npeers;
  size_t buffered; /* sum of the connections' buffer capacities */
  size_t reserved; /* sum of their budget reservations, <= budget */
  char *run_id;    /* the hosting job */
  char *secret;    /* NULL: open store */
  size_t max_conns, max_per_host, max_unauth, max_unauth_per_addr, budget;
  int handshake_ms, frame_ms;
  uint64_t grace_ms; /* before which a handshake is not evicted for the limits on handshakes */
  warn_rate_t warn[WARN_KINDS];
  ns_t *spaces;
  table_t tab;
  store_proto_writer_t w; /* scratch for building one reply at a time */
  uint8_t discard[4096];  /* where lingering connections' bytes go */
};

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *b);
static void on_read(uv_stream_t *s, ssize_t n, const uv_buf_t *b);
static void schedule_ready(conn_t *c);
static void on_limits(uv_timer_t *t);

typedef struct {
  uv_write_t req;
  conn_t *c;
  uint8_t *data; /* the reply's buffer, freed when written */
  size_t len;    /* bytes of it still to write (its end), counted in out_pending */
} wreq_t;

/* Warnings a flood could repeat thousands of times a second: one of each kind (WARN_*) per
 * WARN_INTERVAL_MS. */
static void warn_limited(store_server_t *srv, int kind, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void warn_limited(store_server_t *srv, int kind, const char *fmt, ...) {
  warn_rate_t *w = &srv->warn[kind];
  int64_t now = net_now_ms();
  if (w->last_ms && now - w->last_ms < WARN_INTERVAL_MS) {
    w->nsuppressed++;
    return;
  }
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (w->nsuppressed) log_warn("store: %s (%zu similar warnings before it not shown)", msg, w->nsuppressed);
  else log_warn("store: %s", msg);
  w->last_ms = now;
  w->nsuppressed = 0;
}

/* ---- namespaces ---------------------------------------------------------------------- */

#define FNV_OFFSET 1469598103934665603ull
#define FNV_PRIME 1099511628211ull

static uint64_t fnv1a(uint64_t h, const uint8_t *p, size_t n) {
  for (size_t i = 0; i < n; i++) {
    h ^= p[i];
    h *= FNV_PRIME;
  }
  return h;
}

static ns_t *ns_get(store_server_t *srv, const char *run_id) {
  size_t n = strlen(run_id);
  for (ns_t *s = srv->spaces; s; s = s->next)
    if (s->len == 1 + n && memcmp(s->prefix + 1, run_id, n) == 0) return s;
  ns_t *s = calloc(1, sizeof *s + 1 + n);
  if (!s) return NULL;
  s->len = 1 + n;
  s->prefix[0] = (uint8_t)n;
  memcpy(s->prefix + 1, run_id, n);
  s->hash = fnv1a(FNV_OFFSET, s->prefix, s->len);
  s->next = srv->spaces;
  srv->spaces = s;
  return s;
}

static void ns_maybe_free(store_server_t *srv, ns_t *s) {
  if (!s || s->nkeys || s->nconns) return;
  for (ns_t **pp = &srv->spaces; *pp; pp = &(*pp)->next) {
    if (*pp == s) {
      *pp = s->next;
      free(s);
      return;
    }
  }
}

/* ---- hash table ---------------------------------------------------------------------- */

/* FNV-1a over prefix and key, the prefix's part done once per namespace. */
static uint64_t hash_key(const ns_t *ns, const uint8_t *k, size_t n) { return fnv1a(ns->hash, k, n); }

/* Doubles the nb buckets of a chained table (64 at first), moving every node to its new chain.
 * Returns 0, or -1 when out of memory (the table is unchanged). */
static int links_grow(link_t ***buckets, size_t *nb) {
  size_t n = *nb ? *nb * 2 : 64;
  link_t **b = calloc(n, sizeof *b);
  if (!b) return -1;
  for (size_t i = 0; i < *nb; i++) {
    for (link_t *l = (*buckets)[i], *next; l; l = next) {
      next = l->next;
      l->next = b[l->hash & (n - 1)];
      b[l->hash & (n - 1)] = l;
    }
  }
  free(*buckets);
  *buckets = b;
  *nb = n;
  return 0;
}

static link_t **tab_slot(table_t *t, const ns_t *ns, const uint8_t *k, size_t n, uint64_t h) {
  if (!t->nb) return NULL;
  link_t **pp = &t->b[h & (t->nb - 1)];
  for (; *pp; pp = &(*pp)->next) {
    entry_t *e = (entry_t *)*pp;
    if (e->link.hash == h && e->klen == ns->len + n && memcmp(e->key, ns->prefix, ns->len) == 0 &&
        memcmp(e->key + ns->len, k, n) == 0)
      return pp;
  }
  return NULL;
}

static entry_t *tab_find_h(table_t *t, const ns_t *ns, const uint8_t *k, size_t n, uint64_t h) {
  link_t **pp = tab_slot(t, ns, k, n, h);
  return pp ? (entry_t *)*pp : NULL;
}

static entry_t *tab_find(table_t *t, const ns_t *ns, const uint8_t *k, size_t n) {
  return tab_find_h(t, ns, k, n, hash_key(ns, k, n));
}

/* Sets key (in ns, hash h) to val; STORE_ENOMEM when memory or the STORE_SERVER_MAX_BYTES
 * budget runs out. */
static int tab_set(table_t *t, ns_t *ns, const uint8_t *k, size_t kn, uint64_t h, const uint8_t *v, size_t vn) {
  link_t **pp = tab_slot(t, ns, k, kn, h);
  entry_t *e = pp ? (entry_t *)*pp : NULL;
  size_t old = e ? e->klen + e->vlen : 0, fk = ns->len + kn;
  if (t->bytes - old + fk + vn > STORE_SERVER_MAX_BYTES) return STORE_ENOMEM;
  uint8_t *nv = malloc(vn + 1);
  if (!nv) return STORE_ENOMEM;
  if (vn) memcpy(nv, v, vn);
  nv[vn] = 0;
  if (!e) {
    if (t->n >= t->nb && links_grow(&t->b, &t->nb)) {
      free(nv);
      return STORE_ENOMEM;
    }
    e = malloc(sizeof *e + fk);
    if (!e) {
      free(nv);
      return STORE_ENOMEM;
    }
    e->link.hash = h;
    e->klen = fk;
    memcpy(e->key, ns->prefix, ns->len);
    memcpy(e->key + ns->len, k, kn);
    e->val = NULL;
    e->vlen = 0;
    e->link.next = t->b[h & (t->nb - 1)];
    t->b[h & (t->nb - 1)] = &e->link;
    t->n++;
    ns->nkeys++;
  }
  free(e->val);
  e->val = nv;
  e->vlen = vn;
  t->bytes = t->bytes - old + fk + vn;
  return 0;
}

static int tab_del(table_t *t, ns_t *ns, const uint8_t *k, size_t kn) {
  link_t **pp = tab_slot(t, ns, k, kn, hash_key(ns, k, kn));
  if (!pp) return 0;
  entry_t *e = (entry_t *)*pp;
  *pp = e->link.next;
  t->bytes -= e->klen + e->vlen;
  t->n--;
  ns->nkeys--;
  free(e->val);
  free(e);
  return 1;
}

static void tab_free(table_t *t) {
  for (size_t i = 0; i < t->nb; i++) {
    for (link_t *l = t->b[i], *next; l; l = next) {
      next = l->next;
      entry_t *e = (entry_t *)l;
      free(e->val);
      free(e);
    }
  }
  free(t->b);
  memset(t, 0, sizeof *t);
}

/* ---- peers (connections per host) ---------------------------------------------------- */

static link_t **peer_slot(store_server_t *srv, const char *addr, uint64_t h) {
  link_t **pp = &srv->pbuckets[h & (srv->npbuckets - 1)];
  while (*pp && ((*pp)->hash != h || strcmp(((peer_t *)*pp)->addr, addr) != 0)) pp = &(*pp)->next;
  return pp;
}

/* The count of addr, made (at 0) when it has none; NULL when out of memory. The buckets double
 * once peers outnumber them (a failed growth keeps the old ones: longer chains, still
 * correct). */
static peer_t *peer_get(store_server_t *srv, const char *addr) {
  if (srv->npeers >= srv->npbuckets && links_grow(&srv->pbuckets, &srv->npbuckets) && !srv->npbuckets) return NULL;
  uint64_t h = fnv1a(FNV_OFFSET, (const uint8_t *)addr, strlen(addr));
  link_t **pp = peer_slot(srv, addr, h);
  if (*pp) return (peer_t *)*pp;
  peer_t *p = calloc(1, sizeof *p);
  if (!p) return NULL;
  p->link.hash = h;
  snprintf(p->addr, sizeof p->addr, "%s", addr);
  *pp = &p->link;
  srv->npeers++;
  return p;
}

/* c no longer counts against its host's limit (refused or closed). */
static void peer_release(conn_t *c) {
  store_server_t *srv = c->srv;
  peer_t *p = c->host;
  if (!p) return;
  c->host = NULL;
  if (--p->nconns) return;
  link_t **pp = peer_slot(srv, p->addr, p->link.hash);
  *pp = p->link.next;
  free(p);
  srv->npeers--;
}

/* ---- buffers and the budget ---------------------------------------------------------- */

/* Resizes c's receive buffer to cap bytes (0 frees it), keeping srv->buffered the sum of all
 * capacities. Returns 0, or -1 when realloc failed (the buffer is unchanged). */
static int buf_resize(conn_t *c, size_t cap) {
  store_server_t *srv = c->srv;
  if (cap == 0) {
    free(c->buf);
    c->buf = NULL;
  } else {
    uint8_t *nb = realloc(c->buf, cap);
    if (!nb) return -1;
    c->buf = nb;
  }
  srv->buffered = srv->buffered - c->cap + cap;
  c->cap = cap;
  return 0;
}

static void unreserve(conn_t *c) {
  c->srv->reserved -= c->reserved;
  c->reserved = 0;
}

/* ---- connection lifetime ------------------------------------------------------------- */

static void server_maybe_free(store_server_t *srv) {
  if (!srv->closing || srv->handles_open > 0 || srv->conns) return;
  tab_free(&srv->tab);
  free(srv->wbuckets);
  free(srv->pbuckets); /* empty: each connection's close released its peer */
  store_proto_writer_free(&srv->w);
  while (srv->spaces) {
    ns_t *s = srv->spaces;
    srv->spaces = s->next;
    free(s);
  }
  free(srv->run_id);
  free(srv->host);
  if (srv->spare_fd >= 0) close(srv->spare_fd);
  if (srv->secret) {
    explicit_bzero(srv->secret, strlen(srv->secret));
    free(srv->secret);
  }
  free(srv);
}

static void free_wait(conn_t *c) {
  free(c->wpayload);
  free(c->wkeys);
  free(c->wklens);
  c->wpayload = NULL;
  c->wkeys = NULL;
  c->wklens = NULL;
  c->nwkeys = 0;
}

static conn_t **wbucket(store_server_t *srv, uint64_t h) { return &srv->wbuckets[h & (srv->nwbuckets - 1)]; }

/* Files parked c under c->whash, at the head of its bucket. */
static void wfile(store_server_t *srv, conn_t *c) {
  conn_t **head = wbucket(srv, c->whash);
  c->wprev = NULL;
  c->wnext = *head;
  if (*head) (*head)->wprev = c;
  *head = c;
}

static void wunfile(store_server_t *srv, conn_t *c) {
  if (c->wprev) c->wprev->wnext = c->wnext;
  else *wbucket(srv, c->whash) = c->wnext;
  if (c->wnext) c->wnext->wprev = c->wprev;
  c->wprev = c->wnext = NULL;
}

/* Room for one more waiter: the buckets double once waiters outnumber them, so chains stay
 * about one long. Returns 0, or -1 when there are no buckets and none could be allocated (a
 * failed growth keeps the old ones: longer chains, still correct). */
static int wgrow(store_server_t *srv) {
  if (srv->nwaiters < srv->nwbuckets) return 0;
  size_t nb = srv->nwbuckets ? srv->nwbuckets * 2 : 64;
  conn_t **b = calloc(nb, sizeof *b);
  if (!b) return srv->nwbuckets ? 0 : -1;
  conn_t **old = srv->wbuckets;
  size_t nold = srv->nwbuckets;
  srv->wbuckets = b;
  srv->nwbuckets = nb;
  for (size_t i = 0; i < nold; i++) {
    for (conn_t *c = old[i], *next; c; c = next) {
      next = c->wnext;
      wfile(srv, c);
    }
  }
  free(old);
  return 0;
}

static void unpark(conn_t *c) {
  store_server_t *srv = c->srv;
  if (!c->parked_op) return;
  wunfile(srv, c);
  srv->nwaiters--;
  c->parked_op = 0;
  free_wait(c);
  if (!c->closing) uv_timer_stop(&c->timer);
}

/* Appends c, on no queue, to q. */
static void queue_push(queue_t *q, conn_t *c) {
  c->qprev = q->tail;
  c->qnext = NULL;
  if (q->tail) q->tail->qnext = c;
  else q->head = c;
  q->tail = c;
  c->queue = q;
  q->n++;
}

/* Takes c off the queue it is on, if any. */
static void queue_remove(conn_t *c) {
  queue_t *q = c->queue;
  if (!q) return;
  if (c->qprev) c->qprev->qnext = c->qnext;
  else q->head = c->qnext;
  if (c->qnext) c->qnext->qprev = c->qprev;
  else q->tail = c->qprev;
  c->qprev = c->qnext = NULL;
  c->queue = NULL;
  q->n--;
}

static void conn_handle_closed(uv_handle_t *h) {
  conn_t *c = h->data;
  if (--c->handles_open > 0) return;
  store_server_t *srv = c->srv;
  free(c->buf);
  free(c);
  srv->handles_open--;
  server_maybe_free(srv);
}

static void conn_close(conn_t *c, const char *why) {
  if (c->closing) return;
  store_server_t *srv = c->srv;
  if (why) log_debug("store: closing client %s: %s", c->peer, why);
  unpark(c);
  c->closing = 1;
  if (c->on_ready) {
    for (conn_t **pp = &srv->ready; *pp; pp = &(*pp)->rnext) {
      if (*pp == c) {
        *pp = c->rnext;
        break;
      }
    }
    c->on_ready = 0;
  }
  if (c->prev) c->prev->next = c->next;
  else srv->conns = c->next;
  if (c->next) c->next->prev = c->prev;
  srv->nclients--;
  queue_remove(c);
  peer_release(c);
  if (c->foreign) srv->nforeign--;
  if (c->ns) {
    c->ns->nconns--;
    ns_maybe_free(srv, c->ns);
    c->ns = NULL;
  }
  /* The budget and the count of buffered bytes let go now; the memory itself goes with the
   * conn, since a request being handled may still point into it. */
  unreserve(c);
  srv->buffered -= c->cap;
  c->cap = c->len = 0;
  /* The conn stays allocated (off every list) until both handles report closed. */
  srv->handles_open++;
  uv_close((uv_handle_t *)&c->tcp, conn_handle_closed);
  uv_close((uv_handle_t *)&c->timer, conn_handle_closed);
}

/* Builds an ERROR frame in srv->w. Returns 0, or -1 when it could not be built. */
static int build_error(store_server_t *srv, int code, const char *msg) {
  store_proto_writer_t *w = &srv->w;
  store_proto_begin(w, STORE_REP_ERROR);
  store_proto_put_i64(w, code);
  store_proto_put_bytes(w, msg, strlen(msg));
  return store_proto_finish(w) ? -1 : 0;
}

/* Closes c at once, telling it why if its socket takes the ERROR without waiting. */
static void conn_abort(conn_t *c, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void conn_abort(conn_t *c, int code, const char *fmt, ...) {
  if (c->closing) return;
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (!c->finishing && build_error(c->srv, code, msg) == 0) {
    uv_buf_t b = uv_buf_init((char *)c->srv->w.buf, (unsigned)c->srv->w.len);
    uv_try_write((uv_stream_t *)&c->tcp, &b, 1);
  }
  conn_close(c, msg);
}

static void on_linger_timeout(uv_timer_t *t) { conn_close(t->data, "no EOF after a refusal"); }

static void on_shutdown(uv_shutdown_t *req, int status) {
  conn_t *c = req->data;
  if (status < 0 && !c->closing) conn_close(c, uv_strerror(status));
}

static void send_error(conn_t *c, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Refuses c: sends an ERROR, shuts our side down once it is written and waits up to LINGER_MS
 * for the client's EOF (see the top of the file). Nothing more of c is handled. */
static void conn_finish(conn_t *c, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void conn_finish(conn_t *c, int code, const char *fmt, ...) {
  if (c->closing || c->finishing) return;
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  log_debug("store: refusing client %s: %s", c->peer, msg);
  unpark(c);
  send_error(c, code, "%s", msg);
  if (c->closing) return;
  c->finishing = 1;
  unreserve(c);
  peer_release(c);
  /* It waits as the newest refusal; the oldest goes when more than MAX_LINGER wait. */
  queue_t *linger = &c->srv->linger;
  queue_remove(c);
  queue_push(linger, c);
  while (linger->n > MAX_LINGER) conn_close(linger->head, "refused, and more refusals lingering");
  if (c->out_paused) {
    c->out_paused = 0;
    int err = uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
    if (err < 0) {
      conn_close(c, uv_strerror(err));
      return;
    }
  }
  c->shut.data = c;
  int err = uv_shutdown(&c->shut, (uv_stream_t *)&c->tcp, on_shutdown);
  if (err < 0) {
    conn_close(c, uv_strerror(err));
    return;
  }
  uv_timer_start(&c->timer, on_linger_timeout, LINGER_MS, 0);
}

/* ---- replies ------------------------------------------------------------------------- */

static void on_write(uv_write_t *req, int status) {
  wreq_t *wr = (wreq_t *)req;
  conn_t *c = wr->c;
  c->out_pending -= wr->len;
  free(wr->data);
  free(wr);
  if (c->closing) return;
  if (status < 0) {
    conn_close(c, uv_strerror(status));
    return;
  }
  if (c->out_paused && c->out_pending <= OUT_LIMIT / 2) {
    /* The client caught up: read again and handle what was buffered meanwhile. */
    c->out_paused = 0;
    int err = uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
    if (err < 0) {
      conn_close(c, uv_strerror(err));
      return;
    }
    if (c->len) schedule_ready(c);
  }
}

/* Sends the frame in srv->w (an ERROR instead if it could not be built). Most replies fit in
 * the socket's buffer at once: written here, with no allocation and no write request (the
 * writer keeps its buffer for the next reply, unless it grew past WRITER_KEEP). When the
 * socket takes less, the buffer moves to a write request for the rest (the writer starts
 * empty next time). While replies are queued uv_try_write takes nothing, so order holds.
 * (Queued replies, 40 KB each in a 2048-node start, had the store's process peak at 90 MB;
 * every reply also cost a malloc, a free and a callback.) */
static void send_reply(conn_t *c) {
  store_server_t *srv = c->srv;
  store_proto_writer_t *w = &srv->w;
  int rc = store_proto_finish(w);
  if (rc) {
    if (rc == STORE_ETOOBIG) send_error(c, rc, "reply over the %u-byte frame limit", STORE_MAX_FRAME);
    else send_error(c, rc, "out of memory building a reply");
    return;
  }
  if (c->closing) return;
  size_t done = 0;
  if (c->out_pending == 0) {
    uv_buf_t b = uv_buf_init((char *)w->buf, (unsigned)w->len);
    int n = uv_try_write((uv_stream_t *)&c->tcp, &b, 1);
    if (n < 0 && n != UV_EAGAIN) {
      conn_close(c, uv_strerror(n));
      return;
    }
    if (n > 0) done = (size_t)n;
  }
  if (done == w->len) {
    if (w->cap > WRITER_KEEP) store_proto_writer_free(w);
    return;
  }
  wreq_t *wr = malloc(sizeof *wr);
  if (!wr) {
    conn_close(c, "out of memory for a reply");
    return;
  }
  wr->c = c;
  wr->data = w->buf;
  wr->len = w->len - done;
  w->buf = NULL;
  w->len = w->cap = 0;
  uv_buf_t b = uv_buf_init((char *)wr->data + done, (unsigned)wr->len);
  c->out_pending += wr->len;
  int err = uv_write(&wr->req, (uv_stream_t *)&c->tcp, &b, 1, on_write);
  if (err < 0) {
    c->out_pending -= wr->len;
    free(wr->data);
    free(wr);
    conn_close(c, uv_strerror(err));
    return;
  }
  if (c->out_pending > OUT_LIMIT && !c->out_paused && !c->finishing) {
    c->out_paused = 1;
    uv_read_stop((uv_stream_t *)&c->tcp);
  }
}

static void send_error(conn_t *c, int code, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (build_error(c->srv, code, msg)) {
    conn_close(c, "out of memory for an error reply");
    return;
  }
  send_reply(c);
}

static void send_empty(conn_t *c, int op) {
  store_proto_begin(&c->srv->w, op);
  send_reply(c);
}

static void send_int(conn_t *c, int64_t v) {
  store_proto_begin(&c->srv->w, STORE_REP_INT);
  store_proto_put_i64(&c->srv->w, v);
  send_reply(c);
}

static void send_value(conn_t *c, const entry_t *e) {
  store_proto_begin(&c->srv->w, STORE_REP_VALUE);
  store_proto_put_bytes(&c->srv->w, e->val, e->vlen);
  send_reply(c);
}

/* ---- waiting ------------------------------------------------------------------------- */

/* Index of the first of the n keys that is missing, or n when all exist; *h gets its hash. */
static size_t first_missing(store_server_t *srv, const ns_t *ns, const uint8_t *const *keys, const size_t *lens,
                            size_t n, uint64_t *h) {
  for (size_t i = 0; i < n; i++) {
    uint64_t kh = hash_key(ns, keys[i], lens[i]);
    if (!tab_find_h(&srv->tab, ns, keys[i], lens[i], kh)) {
      *h = kh;
      return i;
    }
  }
  return n;
}

/* Answers c's request (WAIT, GET or MULTI_GET) over the n keys when they all exist, looking
 * each up once (a MULTI_GET's reply is built as it goes), and returns n. Otherwise sends
 * nothing and returns the index of the first missing key, its hash in *h. */
static size_t try_answer(conn_t *c, int op, const uint8_t *const *keys, const size_t *lens, size_t n, uint64_t *h) {
  store_server_t *srv = c->srv;
  store_proto_writer_t *w = &srv->w;
  const entry_t *e = NULL;
  if (op == STORE_OP_MULTI_GET) {
    store_proto_begin(w, STORE_REP_VALUES);
    store_proto_put_u32(w, (uint32_t)n);
  }
  for (size_t i = 0; i < n; i++) {
    uint64_t kh = hash_key(c->ns, keys[i], lens[i]);
    if (!(e = tab_find_h(&srv->tab, c->ns, keys[i], lens[i], kh))) {
      *h = kh;
      return i; /* a VALUES frame begun in w is simply dropped: the next reply begins afresh */
    }
    if (op == STORE_OP_MULTI_GET) store_proto_put_bytes(w, e->val, e->vlen);
  }
  if (op == STORE_OP_MULTI_GET) send_reply(c);
  else if (op == STORE_OP_GET) send_value(c, e);
  else send_empty(c, STORE_REP_OK);
  return n;
}

/* After a write of key k (hash h) in ns: each request filed under k looks for its next missing
 * key from k on, and is filed under it. When none is missing it is answered, unless one of
 * the keys before k has gone meanwhile (they existed when it last looked; deletes are rare):
 * then it is filed under that one. Waiters under other keys, and other jobs', cannot be
 * concerned. */
static void wake_key(store_server_t *srv, const ns_t *ns, const uint8_t *k, size_t kn, uint64_t h) {
  if (!srv->nwbuckets) return;
  for (conn_t *c = *wbucket(srv, h), *next; c; c = next) {
    next = c->wnext;
    size_t m = c->wmissing, n = c->nwkeys;
    if (c->whash != h || c->ns != ns || c->wklens[m] != kn || memcmp(c->wkeys[m], k, kn) != 0) continue;
    uint64_t mh = 0;
    size_t miss = m + first_missing(srv, ns, c->wkeys + m, c->wklens + m, n - m, &mh);
    if (miss == n) miss = try_answer(c, c->parked_op, c->wkeys, c->wklens, n, &mh);
    if (miss < n) {
      /* Refiled at the head of its new bucket: behind this walk, even when that is this bucket. */
      wunfile(srv, c);
      c->wmissing = miss;
      c->whash = mh;
      wfile(srv, c);
      continue;
    }
    unpark(c);
    if (!c->closing && c->len) schedule_ready(c);
  }
}

static void on_wait_timeout(uv_timer_t *t) {
  conn_t *c = t->data;
  if (!c->parked_op || c->closing) return;
  unpark(c);
  send_empty(c, STORE_REP_TIMEOUT);
  if (!c->closing && c->len) schedule_ready(c);
}

/* Parks c on a request whose key `missing` (hash h) is not there yet, filed under that key.
 * Keys are re-pointed into an owned copy of the payload, since the read buffer moves. */
static void park(conn_t *c, int op, const uint8_t *payload, size_t plen, const uint8_t *const *keys,
                 const size_t *lens, size_t n, size_t missing, uint64_t h, int64_t timeout_ms) {
  store_server_t *srv = c->srv;
  c->wpayload = malloc(plen ? plen : 1);
  c->wkeys = malloc((n ? n : 1) * sizeof *c->wkeys);
  c->wklens = malloc((n ? n : 1) * sizeof *c->wklens);
  if (!c->wpayload || !c->wkeys || !c->wklens || wgrow(srv)) {
    free_wait(c);
    send_error(c, STORE_ENOMEM, "out of memory parking a %s", store_proto_op_name(op));
    return;
  }
  memcpy(c->wpayload, payload, plen);
  for (size_t i = 0; i < n; i++) {
    c->wkeys[i] = c->wpayload + (keys[i] - payload);
    c->wklens[i] = lens[i];
  }
  c->nwkeys = n;
  c->wmissing = missing;
  c->whash = h;
  c->parked_op = op;
  wfile(srv, c);
  srv->nwaiters++;
  if (timeout_ms >= 0) uv_timer_start(&c->timer, on_wait_timeout, (uint64_t)timeout_ms, 0);
}

/* Stores k = v in ns and wakes the requests waiting for k. */
static int set_key(store_server_t *srv, ns_t *ns, const uint8_t *k, size_t kn, const uint8_t *v, size_t vn) {
  uint64_t h = hash_key(ns, k, kn);
  int rc = tab_set(&srv->tab, ns, k, kn, h, v, vn);
  if (rc == 0) wake_key(srv, ns, k, kn, h);
  return rc;
}

/* ---- requests ------------------------------------------------------------------------ */

/* Reads a key; returns 0, or sends an error reply / closes and returns -1. */
static int get_key(conn_t *c, store_proto_reader_t *r, const uint8_t **k, size_t *kn) {
  *k = store_proto_get_bytes(r, kn);
  if (r->bad) return 0; /* reported by the caller's reader_done check */
  if (*kn == 0) {
    send_error(c, STORE_EINVAL, "empty key");
    return -1;
  }
  if (*kn > STORE_MAX_KEY) {
    send_error(c, STORE_ETOOBIG, "key of %zu bytes is over the limit of %d", *kn, STORE_MAX_KEY);
    return -1;
  }
  return 0;
}

static void store_err(conn_t *c, int rc, const uint8_t *k, size_t kn) {
  store_server_t *srv = c->srv;
  if (rc == STORE_ENOMEM && srv->tab.bytes + kn <= STORE_SERVER_MAX_BYTES)
    send_error(c, rc, "out of memory storing '%.*s'", (int)(kn > 80 ? 80 : kn), (const char *)k);
  else
    send_error(c, rc, "store full: %zu of %zu bytes used; refusing '%.*s'", srv->tab.bytes,
               (size_t)STORE_SERVER_MAX_BYTES, (int)(kn > 80 ? 80 : kn), (const char *)k);
}

/* Parses the decimal integer stored at e (absent: 0); -1 when it is not one. */
static int parse_int(const entry_t *e, int64_t *v) {
  if (!e) {
    *v = 0;
    return 0;
  }
  if (e->vlen == 0 || e->vlen > 20) return -1;
  char *end;
  errno = 0;
  long long x = strtoll((const char *)e->val, &end, 10);
  if (errno || end != (const char *)e->val + e->vlen || ((const char *)e->val)[0] == ' ' ||
      ((const char *)e->val)[0] == '+')
    return -1;
  *v = x;
  return 0;
}

/* Handles a key list "u32 n, n x bytes"; on success the key and length arrays are malloc'ed.
 * Returns 0, or -1 after an error reply or closing (as get_key). */
static int get_keys(conn_t *c, store_proto_reader_t *r, const uint8_t ***keys, size_t **lens, size_t *n) {
  uint32_t cnt = store_proto_get_u32(r);
  *keys = NULL;
  *lens = NULL;
  *n = 0;
  if (r->bad) return 0;
  /* Each key takes at least 4 bytes, so a count the payload cannot hold is malformed. */
  if ((size_t)cnt > (r->len - r->off) / 4) {
    r->bad = 1;
    return 0;
  }
  *keys = malloc((cnt ? cnt : 1) * sizeof **keys);
  *lens = malloc((cnt ? cnt : 1) * sizeof **lens);
  if (!*keys || !*lens) {
    free(*keys);
    free(*lens);
    *keys = NULL;
    *lens = NULL;
    send_error(c, STORE_ENOMEM, "out of memory for %u keys", cnt);
    return -1;
  }
  for (uint32_t i = 0; i < cnt; i++) {
    if (get_key(c, r, &(*keys)[i], &(*lens)[i])) {
      free(*keys);
      free(*lens);
      *keys = NULL;
      *lens = NULL;
      return -1;
    }
    if (r->bad) break;
  }
  *n = cnt;
  return 0;
}

/* ---- the handshake ------------------------------------------------------------------- */

/* c proved itself (or the store is open): it joins its job's namespace. */
static void conn_authed(conn_t *c) {
  store_server_t *srv = c->srv;
  ns_t *ns = ns_get(srv, c->run_id);
  if (!ns) {
    conn_finish(c, STORE_ENOMEM, "out of memory admitting job '%s'", c->run_id);
    return;
  }
  ns->nconns++;
  c->ns = ns;
  c->state = CONN_READY;
  queue_remove(c);
  uv_timer_stop(&c->timer);
  if (strcmp(c->run_id, srv->run_id) != 0) {
    c->foreign = 1;
    srv->nforeign++;
    log_debug("store: client %s of job '%s' joined the store of job '%s'", c->peer, c->run_id, srv->run_id);
  }
}

/* c has proved it holds the secret (or the store is open) and is about to be told so: it stays
 * unless its address already holds max_per_host connections past the handshake. Checked
 * before the reply, so that the client's store_connect fails naming the limit instead of its
 * first request. Returns 0 when c stays (counted for its address), else -1: c is refused. */
static int admit_host(conn_t *c) {
  store_server_t *srv = c->srv;
  peer_t *p = peer_get(srv, c->addr);
  if (!p) {
    conn_finish(c, STORE_ENOMEM, "out of memory admitting a connection from %s", c->addr);
    return -1;
  }
  if (p->nconns >= srv->max_per_host) {
    warn_limited(srv, WARN_LIMITS, "refusing %s: %zu connections from %s are past the handshake (limit %zu per host)",
                 c->peer, p->nconns, c->addr, srv->max_per_host);
    conn_finish(c, STORE_EBUSY, "the store of job '%s' holds %zu connections from %s, its limit per host", srv->run_id,
                p->nconns, c->addr);
    return -1;
  }
  p->nconns++;
  c->host = p;
  return 0;
}

/* HELLO: bytes banner, bytes run_id, bytes client_nonce. */
static void handle_hello(conn_t *c, store_proto_reader_t *r) {
  store_server_t *srv = c->srv;
  size_t bn, rn, nn;
  const uint8_t *b = store_proto_get_bytes(r, &bn);
  const uint8_t *rid = store_proto_get_bytes(r, &rn);
  const uint8_t *nonce = store_proto_get_bytes(r, &nn);
  if (!store_proto_reader_done(r) || nn != STORE_PROTO_NONCE) {
    conn_close(c, "malformed HELLO");
    return;
  }
  if (bn != strlen(STORE_PROTO_BANNER) || memcmp(b, STORE_PROTO_BANNER, bn) != 0) {
    conn_close(c, "bad HELLO banner");
    return;
  }
  if (rn > STORE_MAX_RUN_ID || memchr(rid, 0, rn)) {
    conn_finish(c, STORE_EINVAL, "run id of %zu bytes%s: at most %d bytes of text", rn,
                rn <= STORE_MAX_RUN_ID ? " with a NUL byte" : "", STORE_MAX_RUN_ID);
    return;
  }
  memcpy(c->run_id, rid, rn);
  c->run_id[rn] = 0;
  memcpy(c->cnonce, nonce, STORE_PROTO_NONCE);
  if (store_proto_nonce(c->snonce)) {
    conn_finish(c, STORE_ENOMEM, "the store has no random bytes for the handshake (getrandom failed)");
    return;
  }
  if (!srv->secret && admit_host(c)) return;
  store_proto_writer_t *w = &srv->w;
  store_proto_begin(w, STORE_REP_HELLO);
  store_proto_put_bytes(w, STORE_PROTO_BANNER, strlen(STORE_PROTO_BANNER));
  store_proto_put_bytes(w, srv->run_id, strlen(srv->run_id));
  store_proto_put_u8(w, srv->secret != NULL);
  store_proto_put_bytes(w, c->snonce, STORE_PROTO_NONCE);
  send_reply(c);
  if (c->closing) return;
  if (srv->secret) c->state = CONN_AUTH;
  else conn_authed(c);
}

/* AUTH: bytes client_proof. Checked in constant time; a wrong one is refused naming the job
 * that owns the store, so that the other job's operator sees whose port they reached. */
static void handle_auth(conn_t *c, store_proto_reader_t *r) {
  store_server_t *srv = c->srv;
  size_t n;
  const uint8_t *proof = store_proto_get_bytes(r, &n);
  if (!store_proto_reader_done(r) || n != STORE_PROTO_PROOF) {
    conn_close(c, "malformed AUTH");
    return;
  }
  uint8_t want[STORE_PROTO_PROOF], mine[STORE_PROTO_PROOF];
  if (store_proto_proof(want, srv->secret, 0, c->cnonce, c->snonce, c->run_id, strlen(c->run_id)) ||
      store_proto_proof(mine, srv->secret, 1, c->cnonce, c->snonce, srv->run_id, strlen(srv->run_id))) {
    conn_finish(c, STORE_ENOMEM, "the store cannot compute HMAC-SHA256");
    return;
  }
  if (!store_proto_proof_equal(proof, want)) {
    warn_limited(srv, WARN_MISC, "client %s of job '%s' does not hold this job's secret; refused", c->peer, c->run_id);
    conn_finish(c, STORE_EAUTH, "authentication failed: this store belongs to job '%s'", srv->run_id);
    return;
  }
  if (admit_host(c)) return;
  store_proto_begin(&srv->w, STORE_REP_AUTH);
  store_proto_put_bytes(&srv->w, mine, sizeof mine);
  send_reply(c);
  if (!c->closing) conn_authed(c);
}

static void on_handshake_timeout(uv_timer_t *t) {
  conn_t *c = t->data;
  if (c->closing || c->state == CONN_READY) return;
  conn_abort(c, STORE_ETIMEDOUT, "handshake not finished within %d ms", c->srv->handshake_ms);
}

/* ---- the operations ------------------------------------------------------------------ */

/* One request being handled: its connection, op and payload, and a reader over the payload. */
typedef struct {
  conn_t *c;
  int op;
  const uint8_t *p;
  size_t plen;
  store_proto_reader_t r;
} req_t;

/* 0 when the whole payload was read and well formed; otherwise closes the connection and
 * returns -1 (the handler then returns, releasing what it holds). */
static int req_done(req_t *q) {
  if (store_proto_reader_done(&q->r)) return 0;
  conn_close(q->c, "malformed request payload");
  return -1;
}

/* HELLO or AUTH once the handshake is done. */
static void op_handshake_again(req_t *q) {
  conn_finish(q->c, STORE_EPROTO, "%s after the handshake", store_proto_op_name(q->op));
}

/* SET: bytes key, bytes value. */
static void op_set(req_t *q) {
  const uint8_t *k, *v;
  size_t kn, vn;
  if (get_key(q->c, &q->r, &k, &kn)) return;
  v = store_proto_get_bytes(&q->r, &vn);
  if (req_done(q)) return;
  int rc = set_key(q->c->srv, q->c->ns, k, kn, v, vn);
  if (rc) store_err(q->c, rc, k, kn);
  else send_empty(q->c, STORE_REP_OK);
}

/* GET: bytes key, i64 timeout_ms (0: do not wait, negative: no deadline); GET_NOWAIT: bytes
 * key, answered NOKEY when it is missing. */
static void op_get(req_t *q) {
  conn_t *c = q->c;
  const uint8_t *k;
  size_t kn;
  if (get_key(c, &q->r, &k, &kn)) return;
  int64_t timeout_ms = q->op == STORE_OP_GET ? store_proto_get_i64(&q->r) : 0;
  if (req_done(q)) return;
  entry_t *e = tab_find(&c->srv->tab, c->ns, k, kn);
  if (e) send_value(c, e);
  else if (q->op == STORE_OP_GET_NOWAIT) send_empty(c, STORE_REP_NOKEY);
  else if (timeout_ms == 0) send_empty(c, STORE_REP_TIMEOUT);
  else park(c, q->op, q->p, q->plen, &k, &kn, 1, 0, hash_key(c->ns, k, kn), timeout_ms);
}

/* ADD: bytes key, i64 delta, to a decimal integer (absent: 0); answers the sum. */
static void op_add(req_t *q) {
  conn_t *c = q->c;
  const uint8_t *k;
  size_t kn;
  if (get_key(c, &q->r, &k, &kn)) return;
  int64_t delta = store_proto_get_i64(&q->r), cur, sum;
  if (req_done(q)) return;
  int shown = (int)(kn > 80 ? 80 : kn);
  if (parse_int(tab_find(&c->srv->tab, c->ns, k, kn), &cur)) {
    send_error(c, STORE_EINVAL, "add '%.*s': stored value is not a decimal integer", shown, (const char *)k);
    return;
  }
  if (__builtin_add_overflow(cur, delta, &sum)) {
    send_error(c, STORE_EINVAL, "add '%.*s': %lld + %lld overflows", shown, (const char *)k, (long long)cur,
               (long long)delta);
    return;
  }
  char txt[32];
  int tn = snprintf(txt, sizeof txt, "%lld", (long long)sum);
  int rc = set_key(c->srv, c->ns, k, kn, (const uint8_t *)txt, (size_t)tn);
  if (rc) store_err(c, rc, k, kn);
  else send_int(c, sum);
}

/* CAS: bytes key, u8 expect_absent, bytes expected, bytes desired; answers the value after. */
static void op_cas(req_t *q) {
  conn_t *c = q->c;
  const uint8_t *k, *v, *v2;
  size_t kn, vn, vn2;
  if (get_key(c, &q->r, &k, &kn)) return;
  uint8_t expect_absent = store_proto_get_u8(&q->r);
  v = store_proto_get_bytes(&q->r, &vn);
  v2 = store_proto_get_bytes(&q->r, &vn2);
  if (req_done(q)) return;
  entry_t *e = tab_find(&c->srv->tab, c->ns, k, kn);
  int swap = expect_absent ? !e : (e && e->vlen == vn && memcmp(e->val, v, vn) == 0);
  if (swap) {
    int rc = set_key(c->srv, c->ns, k, kn, v2, vn2);
    if (rc) {
      store_err(c, rc, k, kn);
      return;
    }
    e = tab_find(&c->srv->tab, c->ns, k, kn);
  }
  if (e) send_value(c, e);
  else send_empty(c, STORE_REP_NOKEY);
}

/* WAIT and MULTI_GET: i64 timeout_ms, key list; answered once every key exists. */
static void op_wait(req_t *q) {
  conn_t *c = q->c;
  const uint8_t **keys;
  size_t *lens, n;
  int64_t timeout_ms = store_proto_get_i64(&q->r);
  if (get_keys(c, &q->r, &keys, &lens, &n)) return;
  if (req_done(q) == 0) {
    uint64_t h = 0;
    size_t miss = try_answer(c, q->op, keys, lens, n, &h);
    if (miss < n && timeout_ms == 0) send_empty(c, STORE_REP_TIMEOUT);
    else if (miss < n) park(c, q->op, q->p, q->plen, keys, lens, n, miss, h, timeout_ms);
  }
  free(keys);
  free(lens);
}

/* CHECK: key list; answers 1 when every key exists. */
static void op_check(req_t *q) {
  const uint8_t **keys;
  size_t *lens, n;
  if (get_keys(q->c, &q->r, &keys, &lens, &n)) return;
  if (req_done(q) == 0) {
    uint64_t h;
    send_int(q->c, first_missing(q->c->srv, q->c->ns, keys, lens, n, &h) == n);
  }
  free(keys);
  free(lens);
}

/* DELETE: bytes key; answers 1 when it existed. */
static void op_delete(req_t *q) {
  const uint8_t *k;
  size_t kn;
  if (get_key(q->c, &q->r, &k, &kn) || req_done(q)) return;
  send_int(q->c, tab_del(&q->c->srv->tab, q->c->ns, k, kn));
}

/* MULTI_SET: u32 n, n x (bytes key, bytes value). The whole request is checked first, against
 * the store's size too, so that a bad entry or a full store sets nothing. */
static void op_multi_set(req_t *q) {
  conn_t *c = q->c;
  store_server_t *srv = c->srv;
  const uint8_t *k, *v;
  size_t kn, vn, total = 0;
  uint32_t cnt = store_proto_get_u32(&q->r);
  for (uint32_t i = 0; i < cnt && !q->r.bad; i++) {
    if (get_key(c, &q->r, &k, &kn)) return;
    store_proto_get_bytes(&q->r, &vn);
    total += c->ns->len + kn + vn;
  }
  if (req_done(q)) return;
  if (srv->tab.bytes + total > STORE_SERVER_MAX_BYTES) {
    send_error(c, STORE_ENOMEM, "store full: %zu of %zu bytes used; refusing a multi_set of %zu bytes",
               srv->tab.bytes, (size_t)STORE_SERVER_MAX_BYTES, total);
    return;
  }
  store_proto_reader_init(&q->r, q->p, q->plen);
  store_proto_get_u32(&q->r);
  for (uint32_t i = 0; i < cnt; i++) {
    k = store_proto_get_bytes(&q->r, &kn);
    v = store_proto_get_bytes(&q->r, &vn);
    int rc = set_key(srv, c->ns, k, kn, v, vn);
    if (rc) {
      store_err(c, rc, k, kn);
      return;
    }
  }
  send_empty(c, STORE_REP_OK);
}

/* NUM_KEYS: no payload; answers the number of this job's keys only. */
static void op_num_keys(req_t *q) {
  if (req_done(q)) return;
  send_int(q->c, (int64_t)q->c->ns->nkeys);
}

/* The handler of each operation once the handshake is done; an op without one is unknown. */
static void (*const op_handlers[STORE_OP_LAST_ + 1])(req_t *q) = {
    [STORE_OP_HELLO] = op_handshake_again,
    [STORE_OP_AUTH] = op_handshake_again,
    [STORE_OP_SET] = op_set,
    [STORE_OP_GET] = op_get,
    [STORE_OP_GET_NOWAIT] = op_get,
    [STORE_OP_ADD] = op_add,
    [STORE_OP_CAS] = op_cas,
    [STORE_OP_WAIT] = op_wait,
    [STORE_OP_MULTI_GET] = op_wait,
    [STORE_OP_CHECK] = op_check,
    [STORE_OP_DELETE] = op_delete,
    [STORE_OP_MULTI_SET] = op_multi_set,
    [STORE_OP_NUM_KEYS] = op_num_keys,
};

/* Handles one request frame, in c's job's namespace. Malformed payloads close the connection. */
static void handle(conn_t *c, int op, const uint8_t *p, size_t plen) {
  req_t q = {.c = c, .op = op, .p = p, .plen = plen};
  store_proto_reader_init(&q.r, p, plen);

  /* Before the handshake is done only its next step is welcome; after it, neither step. */
  if (c->state != CONN_READY) {
    int want = c->state == CONN_HELLO ? STORE_OP_HELLO : STORE_OP_AUTH;
    if (op != want) {
      conn_finish(c, STORE_EAUTH, "%s before the handshake is done: this store belongs to job '%s' and expects %s",
                  store_proto_op_name(op), c->srv->run_id, store_proto_op_name(want));
      return;
    }
    if (op == STORE_OP_HELLO) handle_hello(c, &q.r);
    else handle_auth(c, &q.r);
    return;
  }
  if (op < 0 || op > STORE_OP_LAST_ || !op_handlers[op]) {
    conn_close(c, "unknown op");
    return;
  }
  op_handlers[op](&q);
}

static void on_frame_timeout(uv_timer_t *t);

/* Handles every whole frame in c's buffer, in order, until one parks, output backs up or c is
 * refused. A frame not yet whole that is bigger than BASE_BUF takes its announced length from
 * the budget first (once), and its deadline (on_frame_timeout); it is refused when that does
 * not fit. The timer is free then: such frames come after the handshake, and a parked or
 * refused connection reserves nothing. */
static void conn_process(conn_t *c) {
  store_server_t *srv = c->srv;
  size_t off = 0;
  uint32_t partial = 0;
  while (!c->closing && !c->finishing && !c->parked_op && !c->out_paused && c->len - off >= STORE_PROTO_HEADER) {
    uint32_t flen;
    int op;
    char why[160];
    if (store_proto_parse_header(c->buf + off, 1, &flen, &op, why, sizeof why)) {
      conn_close(c, why);
      return;
    }
    if (c->state != CONN_READY && flen > STORE_PROTO_PREAUTH_FRAME) {
      conn_abort(c, STORE_EPROTO, "a %u-byte %s frame before the handshake is done (at most %u bytes)", flen,
                 store_proto_op_name(op), STORE_PROTO_PREAUTH_FRAME);
      return;
    }
    if (c->len - off < flen) {
      if (flen > BASE_BUF && !c->reserved) {
        if (flen > srv->budget - srv->reserved) {
          warn_limited(srv, WARN_MISC,
                       "client %s: a %u-byte frame does not fit in the %zu bytes left of the %zu-byte budget "
                       "for partly received frames; refused",
                       c->peer, flen, srv->budget - srv->reserved, srv->budget);
          conn_finish(c, STORE_EBUSY, "store busy: a %u-byte %s does not fit in the %zu bytes left of its %zu-byte "
                                      "budget for frames being received; try again later",
                      flen, store_proto_op_name(op), srv->budget - srv->reserved, srv->budget);
          break;
        }
        c->reserved = flen;
        srv->reserved += flen;
        c->frame_start_ms = c->frame_seen_ms = uv_now(srv->loop);
        uv_timer_start(&c->timer, on_frame_timeout, (uint64_t)srv->frame_ms, 0);
      }
      partial = flen;
      break;
    }
    handle(c, op, c->buf + off + STORE_PROTO_HEADER, flen - STORE_PROTO_HEADER);
    if (c->reserved) {
      unreserve(c);
      /* Its deadline goes with it, unless the request parked (the timer is its wait's now). */
      if (!c->closing && !c->finishing && !c->parked_op) uv_timer_stop(&c->timer);
    }
    off += flen;
  }
  if (c->closing) return;
  if (c->finishing) {
    /* Nothing more of it is handled (handle() has returned, so nothing points into it). */
    buf_resize(c, 0);
    c->len = 0;
    c->frame_len = 0;
    return;
  }
  if (off) {
    memmove(c->buf, c->buf + off, c->len - off);
    c->len -= off;
  }
  c->frame_len = partial;
  /* An idle connection holds no buffer; one grown for a big frame shrinks once it is done. */
  size_t keep = partial > BASE_BUF ? partial : BASE_BUF;
  if (c->len == 0) buf_resize(c, 0);
  else if (c->cap > keep && c->len <= keep) buf_resize(c, keep);
}

static void on_idle(uv_idle_t *h) {
  store_server_t *srv = h->data;
  while (srv->ready) {
    conn_t *c = srv->ready;
    srv->ready = c->rnext;
    c->on_ready = 0;
    conn_process(c);
  }
  uv_idle_stop(&srv->idle);
}

static void schedule_ready(conn_t *c) {
  store_server_t *srv = c->srv;
  if (c->on_ready || c->closing) return;
  c->on_ready = 1;
  c->rnext = srv->ready;
  srv->ready = c;
  uv_idle_start(&srv->idle, on_idle);
}

/* Room for the next read. The buffer grows only when full, by doubling, up to the announced
 * length of the frame at its head (reserved against the budget by conn_process), else up to
 * BASE_BUF: so what a connection holds is at most twice what it has sent. A parked connection
 * gets no more than it has: it may pipeline a little behind its wait, not send a big frame. */
static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *b) {
  conn_t *c = h->data;
  if (c->finishing) {
    *b = uv_buf_init((char *)c->srv->discard, sizeof c->srv->discard);
    return;
  }
  size_t target = BASE_BUF;
  if (!c->parked_op && c->frame_len > target) target = c->frame_len;
  if (c->len == c->cap && c->cap < target) {
    size_t ncap = c->cap ? c->cap * 2 : BASE_BUF;
    buf_resize(c, ncap < target ? ncap : target);
  }
  /* A full buffer (or a failed allocation) yields UV_ENOBUFS in on_read. */
  *b = uv_buf_init((char *)c->buf + c->len, (unsigned)(c->cap - c->len));
  if (!c->buf) b->len = 0;
}

static void on_read(uv_stream_t *s, ssize_t n, const uv_buf_t *b) {
  conn_t *c = s->data;
  if (n < 0) {
    conn_close(c, n == UV_EOF ? NULL : n == UV_ENOBUFS ? "pipelined past one frame while waiting" : uv_strerror((int)n));
    return;
  }
  if (c->finishing) return; /* discarded: we wait for its EOF */
  c->len += (size_t)n;
  if (c->reserved && n > 0) c->frame_seen_ms = uv_now(c->srv->loop);
  conn_process(c);
}

/* Reads what a newly accepted socket already holds, as on_read will for later bytes. A client
 * sends its HELLO right after connecting, so when the loop has been busy the HELLO is usually
 * there by the time the connection is accepted; and libuv accepts the whole backlog in one go,
 * before it polls any of the new sockets. So an open store's handshake is done here, and the
 * connection never counts against the limits on handshakes. (Without it, 1024 nodes starting
 * at once on loopback, all from one address, were evicted about 4000 times, each eviction
 * costing its node a reconnect after a pause.) What is not there yet, an EOF or an error are
 * left to libuv's reads. */
static void read_now(conn_t *c) {
  uv_os_fd_t fd;
  if (uv_fileno((uv_handle_t *)&c->tcp, &fd) != 0) return;
  uv_buf_t b;
  on_alloc((uv_handle_t *)&c->tcp, BASE_BUF, &b);
  if (b.len == 0) return;
  ssize_t n;
  do n = recv(fd, b.base, b.len, MSG_DONTWAIT);
  while (n < 0 && errno == EINTR);
  if (n > 0) on_read((uv_stream_t *)&c->tcp, n, &b);
  else if (c->len == 0) buf_resize(c, 0); /* a silent connection holds no buffer */
}

/* The deadline of c's reserved frame: dropped once no byte of it came for frame_ms, or once
 * it has taken frame_ms plus its length at FRAME_MIN_RATE; else armed again for whichever
 * comes first. Timers run before the loop polls, so after a busy spell the bytes that did
 * come may still be in the socket: read first, then judge. */
static void on_frame_timeout(uv_timer_t *t) {
  conn_t *c = t->data;
  store_server_t *srv = c->srv;
  if (c->closing || c->finishing || !c->reserved) return;
  read_now(c);
  /* The frame may have been whole and handled, parking c or refusing it, or the next frame
   * reserved: each armed the timer anew. */
  if (c->closing || c->finishing || !c->reserved || uv_is_active((uv_handle_t *)&c->timer)) return;
  uint64_t now = uv_now(srv->loop), frame_ms = (uint64_t)srv->frame_ms;
  uint64_t idle = now - c->frame_seen_ms, age = now - c->frame_start_ms;
  uint64_t limit = frame_ms + (uint64_t)c->frame_len * 1000 / FRAME_MIN_RATE;
  if (idle < frame_ms && age < limit) {
    uint64_t next = frame_ms - idle < limit - age ? frame_ms - idle : limit - age;
    uv_timer_start(&c->timer, on_frame_timeout, next, 0);
    return;
  }
  char why[96];
  if (idle >= frame_ms) snprintf(why, sizeof why, "no byte of it for %llu ms", (unsigned long long)idle);
  else snprintf(why, sizeof why, "not whole after %llu ms (%u KiB/s at least)", (unsigned long long)age,
                FRAME_MIN_RATE >> 10);
  const char *op = store_proto_op_name(c->buf[6]); /* the header is in: the frame was reserved */
  warn_limited(srv, WARN_STALLS, "client %s: a %u-byte %s stalled at %zu bytes, %s: dropped, releasing its budget",
               c->peer, c->frame_len, op, c->len, why);
  conn_finish(c, STORE_ETIMEDOUT, "a %u-byte %s stalled at %zu bytes received, %s: dropped", c->frame_len, op, c->len,
              why);
}

/* ---- listening ----------------------------------------------------------------------- */

static size_t count_unauth_from(store_server_t *srv, const char *addr) {
  size_t n = 0;
  for (conn_t *u = srv->unauth.head; u; u = u->qnext) n += strcmp(u->addr, addr) == 0;
  return n;
}

/* The newcomer c (on the unauthenticated list, the newest there) against the limit on
 * connections in all, before anything of it is read: the oldest connection still in its
 * handshake goes; only when every other connection has finished its handshake is c the one
 * refused, before its HELLO is answered, so that its store_connect names the limit. Refused
 * connections still lingering are not counted: they are off the handshake list, so a newcomer
 * never takes the place of one (that let every second newcomer past a full store), and
 * MAX_LINGER bounds them. Returns 0 when c stays, -1 when it is refused. */
static int admit_conn(conn_t *c) {
  store_server_t *srv = c->srv;
  if (srv->nclients - srv->linger.n <= srv->max_conns) return 0;
  if (srv->unauth.head != c) {
    conn_abort(srv->unauth.head, STORE_EBUSY, "evicted: the store of job '%s' is at its limit of %zu connections",
               srv->run_id, srv->max_conns);
    return 0;
  }
  warn_limited(srv, WARN_LIMITS, "at the limit of %zu connections: refusing %s", srv->max_conns, c->peer);
  conn_finish(c, STORE_EBUSY, "the store of job '%s' is at its limit of %zu connections", srv->run_id,
              srv->max_conns);
  return -1;
}

/* The limits on connections in the handshake: per address, then in all. Looks at them oldest
 * first, and closes each that has had its grace and is over a limit, so that a flood of idle
 * sockets cannot lock real nodes out. Stops at the first still in its grace (the younger ones
 * are younger still) and checks again when that grace ends. Called when a connection was
 * accepted (after read_now, so that a node whose HELLO came with it is not counted). */
static void check_unauth(store_server_t *srv) {
  uint64_t now = uv_now(srv->loop);
  conn_t *u = srv->unauth.head;
  while (u) {
    if (now - u->accepted_ms < srv->grace_ms) {
      if (!uv_is_active((uv_handle_t *)&srv->limits))
        uv_timer_start(&srv->limits, on_limits, srv->grace_ms - (now - u->accepted_ms), 0);
      return;
    }
    conn_t *next = u->qnext;
    size_t n = count_unauth_from(srv, u->addr);
    if (n > srv->max_unauth_per_addr) {
      warn_limited(srv, WARN_MISC,
                   "%zu connections from %s have not finished the handshake (limit %zu): closing the oldest", n,
                   u->addr, srv->max_unauth_per_addr);
      conn_abort(u, STORE_EBUSY, "evicted: %zu connections from %s have not finished the handshake (limit %zu)", n,
                 u->addr, srv->max_unauth_per_addr);
    } else if (srv->unauth.n > srv->max_unauth) {
      warn_limited(srv, WARN_MISC,
                   "%zu connections have not finished the handshake (limit %zu): closing the oldest, from %s",
                   srv->unauth.n, srv->max_unauth, u->peer);
      conn_abort(u, STORE_EBUSY, "evicted: %zu connections have not finished the handshake (limit %zu)",
                 srv->unauth.n, srv->max_unauth);
    }
    u = next;
  }
}

static void on_limits(uv_timer_t *t) {
  store_server_t *srv = t->data;
  if (!srv->closing) check_unauth(srv);
}

static void on_listener_closed(uv_handle_t *h) {
  store_server_t *srv = h->data;
  srv->handles_open--;
  if (srv->nlisteners_closing > 0) srv->nlisteners_closing--;
  server_maybe_free(srv);
}

static void on_connection(uv_stream_t *l, int status);

/* Listens on srv->host:port, one libuv handle per address. On failure the handles already
 * opened are closed (their callbacks run on the loop) and err says why. */
static int listen_on(store_server_t *srv, int port, char *err, size_t errlen) {
  int bp = 0, fds[MAX_LISTENERS];
  /* net_listen_all does the address work (dual-stack "any"; every address a name resolves to,
   * so clients meet us whichever they try first; EADDRINUSE when the endpoint is taken);
   * libuv then adopts the sockets. */
  int nfd = net_listen_all(srv->host, port, LISTEN_BACKLOG, fds, MAX_LISTENERS, &bp, err, errlen);
  if (nfd < 0) return nfd; /* -EADDRINUSE is STORE_SERVER_EADDRINUSE */
  int rc = 0;
  for (int i = 0; i < nfd; i++) {
    srv->listeners[i].data = srv;
    uv_tcp_init(srv->loop, &srv->listeners[i]);
    srv->handles_open++;
    /* Once adopted, closing the handle closes the fd; before, it is ours to close. */
    int orc = rc ? rc : uv_tcp_open(&srv->listeners[i], fds[i]);
    if (orc) {
      close(fds[i]);
      rc = orc;
      continue;
    }
    rc = uv_listen((uv_stream_t *)&srv->listeners[i], LISTEN_BACKLOG, on_connection);
  }
  if (rc < 0) {
    char ep[300];
    net_format_endpoint(ep, sizeof ep, *srv->host ? srv->host : "*", bp);
    err_set(err, errlen, 0, "store server: listen %s: %s", ep, uv_strerror(rc));
    for (int i = 0; i < nfd; i++) uv_close((uv_handle_t *)&srv->listeners[i], on_listener_closed);
    srv->nlisteners_closing += nfd;
    return rc;
  }
  srv->nlisteners = nfd;
  srv->port = bp;
  return 0;
}

static void on_relisten(uv_timer_t *t) {
  store_server_t *srv = t->data;
  if (srv->closing) return;
  if (srv->spare_fd < 0) srv->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (srv->nlisteners) return; /* not paused: the spare was all */
  char err[256];
  if (srv->nlisteners_closing > 0 || listen_on(srv, srv->port, err, sizeof err) != 0) {
    if (srv->nlisteners_closing == 0) warn_limited(srv, WARN_MISC, "%s; trying again in %d ms", err, RELISTEN_MS);
    uv_timer_start(&srv->relisten, on_relisten, RELISTEN_MS, 0);
    return;
  }
  srv->accept_failures = 0;
  log_warn("store: accepting connections again on port %d", srv->port);
}

/* The last resort against accept failing over and over: libuv retries a failed accept at once,
 * in a loop that returns only when the listener is closed, so a failure nothing here can
 * cure would spin the loop forever. Close the listeners and open them again after
 * RELISTEN_MS (clients retry refused connections meanwhile). Those waiting are reset; one whose
 * handshake was under way may be left established on its client's side with nothing on ours,
 * until the client's first segment draws a reset (the store's client sends its HELLO at once). */
static void pause_listening(store_server_t *srv, const char *why) {
  if (srv->closing || srv->nlisteners == 0) return;
  log_error("store: accept: %s, and nothing to free: not accepting connections for %d ms (%zu connections open)",
            why, RELISTEN_MS, srv->nclients);
  for (int i = 0; i < srv->nlisteners; i++) uv_close((uv_handle_t *)&srv->listeners[i], on_listener_closed);
  srv->nlisteners_closing += srv->nlisteners;
  srv->nlisteners = 0;
  uv_timer_start(&srv->relisten, on_relisten, RELISTEN_MS, 0);
}

/* libuv's own answer to EMFILE (close a spare descriptor, accept and drop what waits, reopen
 * the spare), with a spare of ours: libuv's can be lost to another thread's open between its
 * close and reopen, after which libuv spins. Each dropped connection is told why if its socket
 * takes the ERROR at once. The spare is taken back only by the relisten timer, once libuv's
 * accept loop has returned: Linux reports EMFILE before it looks at the backlog, so libuv's
 * next accept needs the free descriptor to see EAGAIN and stop. Returns 0 when the backlog
 * was drained, -1 without a spare (then it tries to get one back for next time). */
static int shed_load(store_server_t *srv) {
  if (srv->spare_fd < 0) {
    srv->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    return -1;
  }
  close(srv->spare_fd);
  srv->spare_fd = -1;
  int have_msg = build_error(srv, STORE_EBUSY, "the store's host is out of file descriptors; try again later") == 0;
  size_t dropped = 0;
  for (int i = 0; i < srv->nlisteners; i++) {
    uv_os_fd_t lfd;
    if (uv_fileno((uv_handle_t *)&srv->listeners[i], &lfd) != 0 || !(fcntl(lfd, F_GETFL) & O_NONBLOCK)) continue;
    for (;;) {
      int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        break;
      }
      if (have_msg) (void)send(fd, srv->w.buf, srv->w.len, MSG_DONTWAIT | MSG_NOSIGNAL);
      close(fd);
      dropped++;
    }
  }
  if (!uv_is_active((uv_handle_t *)&srv->relisten)) uv_timer_start(&srv->relisten, on_relisten, 0, 0);
  warn_limited(srv, WARN_MISC, "out of file descriptors (%zu connections open): dropped %zu waiting connection(s)",
               srv->nclients, dropped);
  return 0;
}

/* accept failed. Never fatal: out of descriptors, evict the oldest connection still in its
 * handshake (that frees one for the next node), else shed the waiting connections; other
 * errors are a connection's own (reset before we took it) unless they keep coming. */
static void accept_failed(store_server_t *srv, int status) {
  srv->accept_failures++;
  if (status == UV_EMFILE || status == UV_ENFILE) {
    if (srv->linger.head) { /* refused already: only its ERROR's delivery is at stake */
      conn_close(srv->linger.head, "out of descriptors");
      return;
    }
    if (srv->unauth.head) {
      warn_limited(srv, WARN_MISC, "accept: %s (%zu connections, %zu in the handshake): closing the oldest of those",
                   uv_strerror(status), srv->nclients, srv->unauth.n);
      conn_abort(srv->unauth.head, STORE_EBUSY, "evicted: the store's host is out of file descriptors");
      return;
    }
    if (shed_load(srv) == 0) return;
  } else {
    warn_limited(srv, WARN_MISC, "accept: %s", uv_strerror(status));
    if (srv->accept_failures < ACCEPT_FAILURES_MAX) return;
  }
  pause_listening(srv, uv_strerror(status));
}

static void on_connection(uv_stream_t *l, int status) {
  store_server_t *srv = l->data;
  if (srv->closing) return;
  if (status < 0) {
    accept_failed(srv, status);
    return;
  }
  srv->accept_failures = 0;
  conn_t *c = calloc(1, sizeof *c);
  if (!c) {
    warn_limited(srv, WARN_MISC, "out of memory accepting a client");
    return;
  }
  c->srv = srv;
  c->tcp.data = c;
  c->timer.data = c;
  uv_tcp_init(srv->loop, &c->tcp);
  uv_timer_init(srv->loop, &c->timer);
  c->handles_open = 2;
  c->next = srv->conns;
  if (srv->conns) srv->conns->prev = c;
  srv->conns = c;
  srv->nclients++;
  snprintf(c->peer, sizeof c->peer, "(unknown)");
  snprintf(c->addr, sizeof c->addr, "?");
  int err = uv_accept(l, (uv_stream_t *)&c->tcp);
  if (err < 0) {
    conn_close(c, uv_strerror(err));
    return;
  }
  struct sockaddr_storage ss;
  int sl = sizeof ss;
  if (uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&ss, &sl) == 0) {
    int port = 0;
    if (ss.ss_family == AF_INET) {
      uv_ip4_name((struct sockaddr_in *)&ss, c->addr, sizeof c->addr);
      port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
    } else if (ss.ss_family == AF_INET6) {
      uv_ip6_name((struct sockaddr_in6 *)&ss, c->addr, sizeof c->addr);
      port = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
    }
    net_format_endpoint(c->peer, sizeof c->peer, c->addr, port);
  }
  uv_tcp_nodelay(&c->tcp, 1);
  c->state = CONN_HELLO;
  c->accepted_ms = uv_now(srv->loop);
  queue_push(&srv->unauth, c);
  uv_timer_start(&c->timer, on_handshake_timeout, (uint64_t)srv->handshake_ms, 0);
  err = uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
  if (err < 0) {
    conn_close(c, uv_strerror(err));
    return;
  }
  if (admit_conn(c)) return;
  read_now(c);
  check_unauth(srv);
}

static void server_handle_closed(uv_handle_t *h) {
  store_server_t *srv = h->data;
  srv->handles_open--;
  server_maybe_free(srv);
}

long store_server_raise_nofile(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return -1;
  if (rl.rlim_cur < rl.rlim_max) {
    struct rlimit want = {rl.rlim_max, rl.rlim_max};
    if (setrlimit(RLIMIT_NOFILE, &want) == 0) rl.rlim_cur = rl.rlim_max;
  }
  return rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur > LONG_MAX ? LONG_MAX : (long)rl.rlim_cur;
}

/* max_conns's default: the soft descriptor limit less what the host keeps for itself and the
 * refused connections that may linger. */
static size_t default_max_conns(size_t reserve) {
  struct rlimit rl;
  rlim_t soft = 1024;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0) soft = rl.rlim_cur == RLIM_INFINITY ? (rlim_t)1 << 20 : rl.rlim_cur;
  size_t off = reserve + MAX_LINGER;
  return soft > off + MIN_CONNS ? (size_t)(soft - off) : MIN_CONNS;
}

int store_server_start(store_server_t **out, uv_loop_t *loop, const char *host, int port,
                       const store_server_opts_t *opts, int *bound_port, char *err, size_t errlen) {
  *out = NULL;
  store_server_opts_t o = {0};
  if (opts) o = *opts;
  const char *run_id = o.run_id ? o.run_id : "";
  if (strlen(run_id) > STORE_MAX_RUN_ID) {
    return err_set(err, errlen, -EINVAL, "store server: run id '%.40s...' is %zu bytes, over the limit of %d", run_id,
                   strlen(run_id), STORE_MAX_RUN_ID);
  }
  store_server_t *srv = calloc(1, sizeof *srv);
  if (!srv) {
    return err_set(err, errlen, -ENOMEM, "store server: out of memory");
  }
  srv->loop = loop;
  srv->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  srv->run_id = strdup(run_id);
  srv->host = strdup(host ? host : "");
  srv->secret = o.secret && *o.secret ? strdup(o.secret) : NULL;
  srv->max_conns = o.max_conns ? o.max_conns : default_max_conns(o.fd_reserve ? o.fd_reserve : NOFILE_RESERVE);
  srv->max_per_host = o.max_conns_per_host && o.max_conns_per_host < srv->max_conns ? o.max_conns_per_host
                                                                                   : srv->max_conns;
  srv->max_unauth = o.max_unauth ? o.max_unauth : DEFAULT_MAX_UNAUTH;
  srv->max_unauth_per_addr = o.max_unauth_per_addr ? o.max_unauth_per_addr : DEFAULT_MAX_UNAUTH_PER_ADDR;
  srv->handshake_ms = o.handshake_ms > 0 ? o.handshake_ms : DEFAULT_HANDSHAKE_MS;
  srv->grace_ms = (uint64_t)(srv->handshake_ms / 2 < EVICT_GRACE_MS ? srv->handshake_ms / 2 : EVICT_GRACE_MS);
  srv->budget = o.inflight_budget ? o.inflight_budget : DEFAULT_INFLIGHT_BUDGET;
  srv->frame_ms = o.frame_ms > 0 ? o.frame_ms : DEFAULT_FRAME_MS;
  int rc = 0;
  if (!srv->run_id || !srv->host || (o.secret && *o.secret && !srv->secret)) {
    err_set(err, errlen, 0, "store server: out of memory");
    rc = -ENOMEM;
  } else {
    rc = listen_on(srv, port, err, errlen);
  }
  if (rc) {
    /* Freed here, or by the close callbacks of listeners that were opened (next loop run). */
    srv->closing = 1;
    server_maybe_free(srv);
    return rc;
  }
  srv->idle.data = srv;
  uv_idle_init(loop, &srv->idle);
  srv->relisten.data = srv;
  uv_timer_init(loop, &srv->relisten);
  srv->limits.data = srv;
  uv_timer_init(loop, &srv->limits);
  srv->handles_open += 3;
  if (bound_port) *bound_port = srv->port;
  *out = srv;
  return 0;
}

void store_server_close(store_server_t *srv) {
  if (!srv || srv->closing) return;
  srv->closing = 1;
  while (srv->conns) conn_close(srv->conns, NULL);
  srv->ready = NULL;
  for (int i = 0; i < srv->nlisteners; i++) uv_close((uv_handle_t *)&srv->listeners[i], on_listener_closed);
  srv->nlisteners = 0;
  uv_close((uv_handle_t *)&srv->idle, server_handle_closed);
  uv_close((uv_handle_t *)&srv->relisten, server_handle_closed);
  uv_close((uv_handle_t *)&srv->limits, server_handle_closed);
}

size_t store_server_num_clients(const store_server_t *srv) { return srv ? srv->nclients : 0; }
size_t store_server_num_keys(const store_server_t *srv) { return srv ? srv->tab.n : 0; }
size_t store_server_num_waiters(const store_server_t *srv) { return srv ? srv->nwaiters : 0; }
size_t store_server_num_foreign(const store_server_t *srv) { return srv ? srv->nforeign : 0; }
size_t store_server_inflight_bytes(const store_server_t *srv) { return srv ? srv->buffered : 0; }
