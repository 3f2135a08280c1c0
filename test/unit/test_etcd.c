// deps: common/etcd.c common/http.c common/net.c common/err.c
/* test_etcd: the etcd client against real etcd servers (/usr/bin/etcd, Debian's etcd-server),
 * run as child processes on free loopback ports with their data under one mkdtemp directory.
 *
 * Two groups: one single-member etcd shared by the key-value, transaction, lease and watch
 * tests (each test keeps to its own key prefix), then a three-member cluster in which members
 * are killed with SIGKILL. Readiness is polled (a member is ready when etcd_connect to it
 * alone succeeds: it answers and has a leader), never slept for. Group teardowns kill and
 * remove everything, also after a failed test; the members also get SIGKILL if this process
 * dies (PR_SET_PDEATHSIG). Without /usr/bin/etcd every test is skipped and main says why.
 * cmocka asserts only on the main thread; helper threads record what they saw. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <ftw.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/etcd.h"
#include "common/http.h"
#include "common/net.h"

#define ETCD_BIN "/usr/bin/etcd"
#define READY_MS 30000 /* a member that is not ready by then has failed to start */
#define OP_MS 5000     /* client timeout: outlasts a leader election (about 1 to 2 s) */

typedef struct {
  pid_t pid;
  int client_port, peer_port;
  char name[8];
} member_t;

typedef struct {
  char root[PATH_MAX];
  int n;
  member_t m[3];
} cluster_t;

static cluster_t g_one, g_three;
static int g_have_etcd;

/* --- the cluster */

static int rm_cb(const char *p, const struct stat *sb, int f, struct FTW *w) { return remove(p); }

static void print_log_tail(const cluster_t *cl, int i) {
  char path[PATH_MAX + 32], cmd[PATH_MAX + 64];
  snprintf(path, sizeof path, "%s/%s.log", cl->root, cl->m[i].name);
  snprintf(cmd, sizeof cmd, "tail -n 15 '%s' >&2", path);
  fprintf(stderr, "--- last lines of %s:\n", path);
  if (system(cmd) != 0) fprintf(stderr, "(no log)\n");
}

static void cluster_stop(cluster_t *cl) {
  for (int i = 0; i < cl->n; i++)
    if (cl->m[i].pid > 0) {
      kill(cl->m[i].pid, SIGKILL);
      waitpid(cl->m[i].pid, NULL, 0);
      cl->m[i].pid = 0;
    }
  if (cl->root[0]) nftw(cl->root, rm_cb, 16, FTW_DEPTH | FTW_PHYS);
  cl->root[0] = 0;
}

static void member_kill(cluster_t *cl, int i) {
  kill(cl->m[i].pid, SIGKILL);
  waitpid(cl->m[i].pid, NULL, 0);
  cl->m[i].pid = 0;
}

static void endpoint(const cluster_t *cl, int i, char *out, size_t n) {
  snprintf(out, n, "127.0.0.1:%d", cl->m[i].client_port);
}

/* "a,b,c" of the members in the order given. */
static void endpoints(const cluster_t *cl, const int *order, char *out, size_t n) {
  size_t off = 0;
  for (int k = 0; k < cl->n; k++) {
    char ep[32];
    endpoint(cl, order[k], ep, sizeof ep);
    off += (size_t)snprintf(out + off, n - off, "%s%s", k ? "," : "", ep);
  }
}

/* Starts n members; 0 when every one answers with a leader, else -1 (logs printed). Ports
 * come from sockets bound to port 0, all open at once so that they differ, then closed for
 * etcd to bind. */
static int cluster_start(cluster_t *cl, int n) {
  memset(cl, 0, sizeof *cl);
  snprintf(cl->root, sizeof cl->root, "%s/test_etcd.XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
  if (!mkdtemp(cl->root)) return cl->root[0] = 0, -1;
  cl->n = n;
  int fds[6];
  char err[256], initial[512] = "";
  for (int i = 0; i < 2 * n; i++) {
    int port;
    if ((fds[i] = net_listen("127.0.0.1", 0, 1, &port, err, sizeof err)) < 0) return fprintf(stderr, "%s\n", err), -1;
    if (i % 2) cl->m[i / 2].peer_port = port;
    else cl->m[i / 2].client_port = port;
  }
  for (int i = 0; i < 2 * n; i++) close(fds[i]);
  for (int i = 0; i < n; i++) {
    snprintf(cl->m[i].name, sizeof cl->m[i].name, "m%d", i);
    size_t off = strlen(initial);
    snprintf(initial + off, sizeof initial - off, "%sm%d=http://127.0.0.1:%d", i ? "," : "", i, cl->m[i].peer_port);
  }
  int64_t t0 = net_now_ms();
  pid_t parent = getpid();
  for (int i = 0; i < n; i++) {
    member_t *m = &cl->m[i];
    char dir[PATH_MAX + 16], log[PATH_MAX + 16], curl[64], purl[64];
    snprintf(dir, sizeof dir, "%s/%s", cl->root, m->name);
    snprintf(log, sizeof log, "%s/%s.log", cl->root, m->name);
    snprintf(curl, sizeof curl, "http://127.0.0.1:%d", m->client_port);
    snprintf(purl, sizeof purl, "http://127.0.0.1:%d", m->peer_port);
    if ((m->pid = fork()) < 0) return -1;
    if (m->pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);
      FILE *f = freopen(log, "w", stdout);
      if (!f || dup2(STDOUT_FILENO, STDERR_FILENO) < 0) _exit(127);
      execl(ETCD_BIN, ETCD_BIN, "--name", m->name, "--data-dir", dir, "--listen-client-urls", curl,
            "--advertise-client-urls", curl, "--listen-peer-urls", purl, "--initial-advertise-peer-urls", purl,
            "--initial-cluster", initial, "--initial-cluster-state", "new", "--initial-cluster-token", cl->root,
            (char *)NULL);
      _exit(127);
    }
  }
  int64_t deadline = t0 + READY_MS;
  for (int i = 0; i < n; i++) {
    char ep[32];
    endpoint(cl, i, ep, sizeof ep);
    for (;;) {
      etcd_t *c;
      int status;
      for (int k = 0; k < n; k++)
        if (waitpid(cl->m[k].pid, &status, WNOHANG) == cl->m[k].pid) {
          fprintf(stderr, "etcd member %s exited (status %d) while starting\n", cl->m[k].name, status);
          cl->m[k].pid = 0;
          print_log_tail(cl, k);
          return -1;
        }
      if (etcd_connect(&c, ep, 500, err, sizeof err) == 0) {
        etcd_close(c);
        break;
      }
      if (net_now_ms() > deadline) {
        fprintf(stderr, "etcd member %s not ready in %d ms: %s\n", cl->m[i].name, READY_MS, err);
        print_log_tail(cl, i);
        return -1;
      }
    }
  }
  printf("  etcd: %d member(s) ready in %lld ms\n", n, (long long)(net_now_ms() - t0));
  return 0;
}

static int setup_one(void **state) {
  if (!g_have_etcd) return 0;
  if (cluster_start(&g_one, 1)) return cluster_stop(&g_one), -1;
  return 0;
}
static int teardown_one(void **state) { return cluster_stop(&g_one), 0; }
static int setup_three(void **state) {
  if (!g_have_etcd) return 0;
  if (cluster_start(&g_three, 3)) return cluster_stop(&g_three), -1;
  return 0;
}
static int teardown_three(void **state) { return cluster_stop(&g_three), 0; }

static etcd_t *client_of(const char *eps) {
  etcd_t *c = NULL;
  char err[1024];
  int rc = etcd_connect(&c, eps, OP_MS, err, sizeof err);
  if (rc) fprintf(stderr, "connect: %s\n", err);
  assert_int_equal(rc, 0);
  return c;
}

static etcd_t *client(void) {
  char ep[32];
  if (!g_have_etcd) skip();
  endpoint(&g_one, 0, ep, sizeof ep);
  return client_of(ep);
}

#define OK(c, call)                                                                                                   \
  do {                                                                                                               \
    int rc_ = (call);                                                                                                \
    if (rc_) fprintf(stderr, "%s:%d: %s: %d: %s\n", __FILE__, __LINE__, #call, rc_, etcd_errmsg(c));                 \
    assert_int_equal(rc_, 0);                                                                                        \
  } while (0)

/* The mod_revision of key (which must exist). */
static int64_t mod_rev(etcd_t *c, const char *key) {
  void *v;
  size_t len;
  int64_t rev;
  OK(c, etcd_get(c, key, &v, &len, &rev));
  free(v);
  return rev;
}

/* A request straight to member i (a GET when body is NULL), for what the client does not
 * offer (compaction, member status, metrics). Returns the number that follows pat in the
 * reply ("\"leader\":\"", or "\nmetric_name "; unsigned: member ids use all 64 bits), or
 * UINT64_MAX when there is none. */
static int raw_collect(void *arg, const char *p, size_t n) {
  FILE *f = arg;
  return fwrite(p, 1, n, f) != n;
}

static uint64_t raw_number(const cluster_t *cl, int i, const char *path, const char *body, const char *pat) {
  char *reply = NULL, err[256];
  size_t len = 0;
  FILE *f = open_memstream(&reply, &len);
  http_conn_t h;
  assert_int_equal(http_init(&h), 0);
  http_req_t rq = {.host = "127.0.0.1", .port = cl->m[i].client_port, .method = body ? "POST" : "GET",
                   .path = path, .body = body, .body_len = body ? strlen(body) : 0,
                   .deadline = net_now_ms() + 5000, .on_data = raw_collect, .arg = f};
  http_res_t res;
  int rc = http_post(&h, &rq, &res, err, sizeof err);
  http_close(&h);
  fclose(f);
  const char *p = !rc && reply ? strstr(reply, pat) : NULL;
  uint64_t v = p ? strtoull(p + strlen(pat), NULL, 10) : UINT64_MAX;
  free(reply);
  return v;
}

/* --- key-value */

static void test_put_get_delete_binary(void **state) {
  etcd_t *c = client();
  unsigned char bin[256];
  for (int i = 0; i < 256; i++) bin[i] = (unsigned char)(255 - i); /* every byte, NULs included */
  void *v;
  size_t len;
  int64_t rev1, rev2;
  OK(c, etcd_put(c, "kv/bin", bin, sizeof bin, 0));
  OK(c, etcd_get(c, "kv/bin", &v, &len, &rev1));
  assert_int_equal(len, sizeof bin);
  assert_memory_equal(v, bin, sizeof bin);
  assert_true(rev1 > 0);
  free(v);
  for (size_t n = 0; n < 4; n++) { /* lengths that take base64 padding of 0, 1 and 2 bytes */
    OK(c, etcd_put(c, "kv/bin", bin + 7, n, 0));
    OK(c, etcd_get(c, "kv/bin", &v, &len, &rev2));
    assert_int_equal(len, n);
    assert_memory_equal(v, bin + 7, n);
    assert_int_equal(((char *)v)[n], 0);
    free(v);
  }
  assert_true(rev2 > rev1);

  assert_int_equal(etcd_get(c, "kv/absent", &v, &len, NULL), -ENOENT);
  assert_non_null(strstr(etcd_errmsg(c), "kv/absent"));
  assert_int_equal(etcd_put(c, "", "x", 1, 0), -EINVAL);

  /* A prefix listing: in key order, nothing outside the prefix ("kv/members" without the
   * slash, "kv/memberz"), and a prefix ending in 0xff bytes, whose range end is computed by
   * dropping them. */
  const char *keys[] = {"kv/members/b", "kv/members/a", "kv/members", "kv/memberz", "kv/\xff", "kv/\xff\xff",
                        "kv/\xfe", "kv0"};
  for (size_t i = 0; i < sizeof keys / sizeof *keys; i++) OK(c, etcd_put(c, keys[i], keys[i], strlen(keys[i]), 0));
  etcd_kvs_t kvs;
  OK(c, etcd_get_prefix(c, "kv/members/", &kvs));
  assert_int_equal(kvs.n, 2);
  assert_string_equal(kvs.kvs[0].key, "kv/members/a");
  assert_string_equal(kvs.kvs[1].key, "kv/members/b");
  assert_int_equal(kvs.kvs[1].len, strlen("kv/members/b"));
  assert_memory_equal(kvs.kvs[1].value, "kv/members/b", kvs.kvs[1].len);
  assert_true(kvs.revision >= kvs.kvs[0].mod_revision && kvs.revision >= kvs.kvs[1].mod_revision);
  etcd_kvs_free(&kvs);
  OK(c, etcd_get_prefix(c, "kv/\xff", &kvs));
  assert_int_equal(kvs.n, 2);
  assert_string_equal(kvs.kvs[0].key, "kv/\xff");
  assert_string_equal(kvs.kvs[1].key, "kv/\xff\xff");
  etcd_kvs_free(&kvs);
  OK(c, etcd_get_prefix(c, "nothing-here/", &kvs));
  assert_int_equal(kvs.n, 0);
  etcd_kvs_free(&kvs);

  int64_t deleted;
  OK(c, etcd_delete(c, "kv/members/a", 0, &deleted));
  assert_int_equal(deleted, 1);
  OK(c, etcd_delete(c, "kv/members/a", 0, &deleted));
  assert_int_equal(deleted, 0);
  OK(c, etcd_delete(c, "kv/", 1, &deleted));
  assert_int_equal(deleted, 7); /* bin, members/b, members, memberz, \xff, \xff\xff, \xfe */
  OK(c, etcd_get_prefix(c, "kv", &kvs));
  assert_int_equal(kvs.n, 1); /* kv0 stays */
  assert_string_equal(kvs.kvs[0].key, "kv0");
  etcd_kvs_free(&kvs);
  etcd_close(c);
}

static void test_compare_set(void **state) {
  etcd_t *c = client();
  void *actual;
  size_t alen;
  int swapped;
  OK(c, etcd_compare_set(c, "cs/leader", NULL, 0, "A", 1, 0, &swapped, &actual, &alen));
  assert_int_equal(swapped, 1);
  assert_int_equal(alen, 1);
  assert_memory_equal(actual, "A", 1);
  free(actual);
  /* The second create fails and tells who holds it. */
  OK(c, etcd_compare_set(c, "cs/leader", NULL, 0, "B", 1, 0, &swapped, &actual, &alen));
  assert_int_equal(swapped, 0);
  assert_int_equal(alen, 1);
  assert_memory_equal(actual, "A", 1);
  free(actual);
  /* Compare-value: a wrong expectation changes nothing; the right one swaps. */
  OK(c, etcd_compare_set(c, "cs/leader", "X", 1, "C", 1, 0, &swapped, &actual, &alen));
  assert_int_equal(swapped, 0);
  assert_memory_equal(actual, "A", 1);
  free(actual);
  OK(c, etcd_compare_set(c, "cs/leader", "A", 1, "CC\0C", 4, 0, &swapped, &actual, &alen));
  assert_int_equal(swapped, 1);
  free(actual);
  void *v;
  size_t len;
  OK(c, etcd_get(c, "cs/leader", &v, &len, NULL));
  assert_int_equal(len, 4);
  assert_memory_equal(v, "CC\0C", 4);
  free(v);
  /* Expecting a value of an absent key fails, and says the key is absent. */
  OK(c, etcd_compare_set(c, "cs/none", "A", 1, "B", 1, 0, &swapped, &actual, &alen));
  assert_int_equal(swapped, 0);
  assert_null(actual);
  assert_int_equal(etcd_get(c, "cs/none", &v, &len, NULL), -ENOENT);
  etcd_close(c);
}

/* --- add from two threads */

#define ADDS 100

typedef struct adder adder_t;
/* One step i of a thread: its result into *got. */
typedef int (*step_fn)(etcd_t *c, const adder_t *a, int i, int64_t *got);

struct adder {
  char ep[32];
  step_fn step;
  int64_t got[ADDS]; /* the counter's values after each add, or each create's join index */
  int rc;
  char err[512];
};

/* A thread: its own client, ADDS steps, the first failure's message kept. */
static void *stepper(void *arg) {
  adder_t *a = arg;
  etcd_t *c;
  if ((a->rc = etcd_connect(&c, a->ep, OP_MS, a->err, sizeof a->err))) return NULL;
  for (int i = 0; i < ADDS && !a->rc; i++)
    if ((a->rc = a->step(c, a, i, &a->got[i]))) snprintf(a->err, sizeof a->err, "%s", etcd_errmsg(c));
  etcd_close(c);
  return NULL;
}

/* Runs step ADDS times in each of two threads, each with a client of the one-member cluster,
 * and checks they both succeeded. */
static void run_pair(step_fn step, adder_t a[2]) {
  pthread_t th[2];
  for (int i = 0; i < 2; i++) {
    endpoint(&g_one, 0, a[i].ep, sizeof a[i].ep);
    a[i].step = step;
    assert_int_equal(pthread_create(&th[i], NULL, stepper, &a[i]), 0);
  }
  for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < 2; i++) {
    if (a[i].rc) fprintf(stderr, "thread %d: %s\n", i, a[i].err);
    assert_int_equal(a[i].rc, 0);
  }
}

/* Each of 1..2*ADDS got exactly once over both threads, increasing within each. */
static void assert_each_once(const adder_t a[2]) {
  char seen[2 * ADDS + 1] = {0};
  for (int i = 0; i < 2; i++)
    for (int k = 0; k < ADDS; k++) {
      assert_in_range(a[i].got[k], 1, 2 * ADDS);
      assert_int_equal(seen[a[i].got[k]], 0);
      seen[a[i].got[k]] = 1;
      if (k) assert_true(a[i].got[k] > a[i].got[k - 1]);
    }
}

static int add_step(etcd_t *c, const adder_t *a, int i, int64_t *got) {
  (void)a, (void)i;
  return etcd_add(c, "add/n", 1, got);
}

static void test_add_concurrent(void **state) {
  etcd_t *c = client();
  adder_t a[2] = {0};
  int64_t t0 = net_now_ms();
  run_pair(add_step, a);
  int64_t ms = net_now_ms() - t0;
  /* Exactly once each: the values returned are 1..2*ADDS, each once, increasing per thread. */
  assert_each_once(a);
  void *v;
  size_t len;
  OK(c, etcd_get(c, "add/n", &v, &len, NULL));
  assert_int_equal(strtoll(v, NULL, 10), 2 * ADDS);
  free(v);
  printf("  add: 2 threads x %d adds reached exactly %d in %lld ms (%.1f ms per add)\n", ADDS, 2 * ADDS,
         (long long)ms, (double)ms / ADDS);
  int64_t r;
  OK(c, etcd_add(c, "add/n", -2 * ADDS - 5, &r));
  assert_int_equal(r, -5);
  OK(c, etcd_put(c, "add/text", "twelve", 6, 0));
  assert_int_equal(etcd_add(c, "add/text", 1, &r), -EINVAL);
  assert_non_null(strstr(etcd_errmsg(c), "not an integer"));
  OK(c, etcd_put(c, "add/max", "9223372036854775807", 19, 0));
  assert_int_equal(etcd_add(c, "add/max", 1, &r), -ERANGE);
  etcd_close(c);
}

/* --- leases */

/* --- join indices from two threads (adder_t.got: the indices) */

/* etcd_create_index: the create and the count in one transaction, from two threads. */
static int index_step(etcd_t *c, const adder_t *a, int i, int64_t *got) {
  char key[64];
  snprintf(key, sizeof key, "idx/%p/%d", (const void *)a, i);
  return etcd_create_index(c, key, "idx/", got);
}

static void test_create_index_one_request(void **state) {
  etcd_t *c = client();
  adder_t a[2] = {0};
  run_pair(index_step, a);
  assert_each_once(a); /* 1..2*ADDS, each once, increasing per thread */
  /* Again on a key that is there (an unsure retry's case): its own index, not a new one. */
  int64_t i1 = 0, i2 = 0, n = 0, rev = 0;
  OK(c, etcd_create_index(c, "idx/zz-again", "idx/", &i1));
  assert_int_equal(i1, 2 * ADDS + 1);
  OK(c, etcd_create_index(c, "idx/zz-later", "idx/", &i2));
  assert_int_equal(i2, 2 * ADDS + 2);
  OK(c, etcd_create_index(c, "idx/zz-again", "idx/", &i1));
  assert_int_equal(i1, 2 * ADDS + 1);
  OK(c, etcd_count(c, "idx/", 0, &n, &rev));
  assert_int_equal(n, 2 * ADDS + 2);
  assert_true(rev >= mod_rev(c, "idx/zz-later"));
  assert_int_equal(etcd_create_index(c, "other/key", "idx/", &i1), -EINVAL); /* not under the prefix */
  etcd_close(c);
}

/* etcd_put2 writes both keys on the lease, or neither when the lease is gone; etcd_clone talks
 * to the same cluster; the grant says the TTL it gave. */
static void test_put2_clone_grant_ttl(void **state) {
  etcd_t *c = client(), *d = NULL;
  int64_t id = 0;
  int ttl = 0;
  OK(c, etcd_lease_grant(c, 30, &id, &ttl));
  assert_int_equal(ttl, 30);
  OK(c, etcd_put2(c, "two/a", "1", 1, "two/b", "22", 2, id));
  assert_int_equal(etcd_clone(&d, c), 0);
  void *v;
  size_t len;
  OK(d, etcd_get(d, "two/b", &v, &len, NULL));
  assert_int_equal(len, 2);
  assert_memory_equal(v, "22", 2);
  free(v);
  OK(d, etcd_lease_revoke(d, id));
  assert_int_equal(etcd_get(c, "two/a", &v, &len, NULL), -ENOENT); /* gone with the lease */
  assert_int_equal(etcd_put2(c, "two/c", "1", 1, "two/d", "1", 1, id), -ENOENT);
  assert_int_equal(etcd_get(c, "two/c", &v, &len, NULL), -ENOENT);
  etcd_close(d);
  etcd_close(c);
}

static void test_lease_expiry_fences(void **state) {
  etcd_t *c = client();
  const int ttl = 2;
  int64_t id, rev;
  int left;
  OK(c, etcd_lease_grant(c, ttl, &id, NULL));
  OK(c, etcd_put(c, "lease/alive", "me", 2, id));
  int swapped;
  OK(c, etcd_compare_set(c, "lease/leader", NULL, 0, "me", 2, id, &swapped, NULL, NULL));
  assert_int_equal(swapped, 1);
  rev = mod_rev(c, "lease/leader"); /* the later of the two writes */
  /* Keep it alive for twice its TTL; the wait between keepalives is a watch that must see no
   * change (the key outliving its TTL is the check). */
  int64_t t0 = net_now_ms(), last = t0;
  etcd_kvs_t ev;
  while (net_now_ms() - t0 < 2 * ttl * 1000) {
    assert_int_equal(etcd_watch(c, "lease/", 1, rev, 400, &ev), -ETIMEDOUT);
    OK(c, etcd_lease_keepalive(c, id, &left));
    last = net_now_ms();
    assert_in_range(left, 1, ttl);
  }
  /* Stop: both keys go, as deletes, within TTL plus etcd's expiry check (every 500 ms). */
  OK(c, etcd_watch(c, "lease/", 1, rev, ttl * 1000 + 5000, &ev));
  int64_t gone = net_now_ms() - last;
  assert_true(ev.n >= 1);
  assert_int_equal(ev.kvs[0].deleted, 1);
  assert_null(ev.kvs[0].value);
  etcd_kvs_free(&ev);
  printf("  lease: ttl %d s, keys deleted %lld ms after the last keepalive\n", ttl, (long long)gone);
  assert_in_range(gone, ttl * 1000 - 600, ttl * 1000 + 3000);
  void *v;
  size_t len;
  assert_int_equal(etcd_get(c, "lease/alive", &v, &len, NULL), -ENOENT);
  assert_int_equal(etcd_get(c, "lease/leader", &v, &len, NULL), -ENOENT);
  assert_int_equal(etcd_lease_keepalive(c, id, &left), -ENOENT);
  assert_non_null(strstr(etcd_errmsg(c), "fenced"));

  /* Revoke: the keys go at once, and the lease is gone for keepalive and a second revoke. */
  OK(c, etcd_lease_grant(c, 30, &id, NULL));
  OK(c, etcd_put(c, "lease/r", "x", 1, id));
  OK(c, etcd_lease_revoke(c, id));
  assert_int_equal(etcd_get(c, "lease/r", &v, &len, NULL), -ENOENT);
  assert_int_equal(etcd_lease_keepalive(c, id, &left), -ENOENT);
  assert_int_equal(etcd_lease_revoke(c, id), -ENOENT);
  assert_int_equal(etcd_put(c, "lease/r", "x", 1, id), -ENOENT); /* a put on a dead lease is refused */
  etcd_close(c);
}

/* --- watch */

typedef struct {
  char eps[128];
  const char *key;
  int prefix, timeout_ms;
  int64_t from, t_start, t_end;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int entered;
  int rc;
  etcd_kvs_t ev;
  char err[1024];
} watcher_t;

static void *watcher(void *arg) {
  watcher_t *w = arg;
  etcd_t *c;
  w->rc = etcd_connect(&c, w->eps, OP_MS, w->err, sizeof w->err);
  pthread_mutex_lock(&w->mu);
  w->t_start = net_now_ms();
  w->entered = 1;
  pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
  if (w->rc) return NULL;
  w->rc = etcd_watch(c, w->key, w->prefix, w->from, w->timeout_ms, &w->ev);
  w->t_end = net_now_ms();
  snprintf(w->err, sizeof w->err, "%s", etcd_errmsg(c));
  etcd_close(c);
  return NULL;
}

static void watcher_start(watcher_t *w, pthread_t *th) {
  pthread_mutex_init(&w->mu, NULL);
  pthread_cond_init(&w->cv, NULL);
  assert_int_equal(pthread_create(th, NULL, watcher, w), 0);
  pthread_mutex_lock(&w->mu);
  while (!w->entered) pthread_cond_wait(&w->cv, &w->mu);
  pthread_mutex_unlock(&w->mu);
}

static void test_watch(void **state) {
  etcd_t *c = client();
  etcd_kvs_t kvs;
  OK(c, etcd_get_prefix(c, "w/", &kvs));
  int64_t from = kvs.revision;
  etcd_kvs_free(&kvs);

  /* An event written while the watch waits; a write outside the prefix is not one. */
  watcher_t w = {.key = "w/", .prefix = 1, .timeout_ms = 10000, .from = from};
  endpoint(&g_one, 0, w.eps, sizeof w.eps);
  pthread_t th;
  watcher_start(&w, &th);
  OK(c, etcd_put(c, "wx", "no", 2, 0));
  int64_t t_put = net_now_ms();
  OK(c, etcd_put(c, "w/k", "v1", 2, 0));
  pthread_join(th, NULL);
  if (w.rc) fprintf(stderr, "watch: %s\n", w.err);
  assert_int_equal(w.rc, 0);
  assert_int_equal(w.ev.n, 1);
  assert_string_equal(w.ev.kvs[0].key, "w/k");
  assert_memory_equal(w.ev.kvs[0].value, "v1", 2);
  assert_int_equal(w.ev.kvs[0].deleted, 0);
  int64_t rev = mod_rev(c, "w/k");
  assert_int_equal(w.ev.kvs[0].mod_revision, rev);
  assert_int_equal(w.ev.revision, rev);
  printf("  watch: waited from %lld ms before the put; returned %lld ms after it\n",
         (long long)(t_put - w.t_start), (long long)(w.t_end - t_put));
  etcd_kvs_free(&w.ev);

  /* From an older revision the same event is returned at once (history, not luck). */
  OK(c, etcd_watch(c, "w/k", 0, from, 5000, &kvs));
  assert_int_equal(kvs.n, 1);
  assert_int_equal(kvs.kvs[0].mod_revision, rev);
  etcd_kvs_free(&kvs);

  /* Nothing after it: a timeout, in about the time asked for. */
  int64_t t0 = net_now_ms();
  assert_int_equal(etcd_watch(c, "w/", 1, rev, 300, &kvs), -ETIMEDOUT);
  int64_t waited = net_now_ms() - t0;
  printf("  watch: quiet key timed out after %lld ms (asked 300)\n", (long long)waited);
  assert_in_range(waited, 290, 1500);
  assert_int_equal(kvs.n, 0);
  assert_int_equal(kvs.revision, rev);

  /* A delete is an event without a value. */
  OK(c, etcd_delete(c, "w/k", 0, NULL));
  OK(c, etcd_watch(c, "w/k", 0, rev, 5000, &kvs));
  assert_int_equal(kvs.n, 1);
  assert_int_equal(kvs.kvs[0].deleted, 1);
  assert_null(kvs.kvs[0].value);
  assert_true(kvs.revision > rev);
  etcd_kvs_free(&kvs);

  /* Compacted history: a clear error, not a hang or a silent gap. */
  OK(c, etcd_put(c, "w/k", "v2", 2, 0));
  rev = mod_rev(c, "w/k");
  char body[64];
  snprintf(body, sizeof body, "{\"revision\":\"%lld\",\"physical\":true}", (long long)rev);
  assert_true(raw_number(&g_one, 0, "/v3/kv/compaction", body, "\"revision\":\"") != UINT64_MAX);
  assert_int_equal(etcd_watch(c, "w/k", 0, from, 5000, &kvs), -ESTALE);
  assert_non_null(strstr(etcd_errmsg(c), "compacted"));
  printf("  watch: %s\n", etcd_errmsg(c));
  etcd_close(c);
}

/* --- a transaction applied whose reply is lost */

/* A TCP relay to a member that, when armed, forwards the countdown-th transaction and drops
 * the connection when etcd's reply starts: the member applied it, the client cannot know. */
typedef struct {
  int lfd, port, target;
  int countdown; /* txn requests until the one whose reply is dropped; 0: relay everything */
  int dropped, stop;
  pthread_t th, relays[16]; /* one relay thread per connection (curl opens one per txn) */
  int nrelays, fds[16];
} proxy_t;

typedef struct {
  proxy_t *p;
  int cfd;
} relay_arg_t;

static void *relay(void *arg) {
  proxy_t *p = ((relay_arg_t *)arg)->p;
  int cfd = ((relay_arg_t *)arg)->cfd;
  free(arg);
  char err[256], buf[65536];
  int efd = net_connect("127.0.0.1", p->target, 2000, err, sizeof err), arm = 0;
  if (efd < 0) return NULL;
  while (!__atomic_load_n(&p->stop, __ATOMIC_SEQ_CST)) {
    struct pollfd pf[2] = {{cfd, POLLIN, 0}, {efd, POLLIN, 0}};
    if (poll(pf, 2, 100) <= 0) continue;
    if (pf[0].revents) {
      ssize_t n = read(cfd, buf, sizeof buf);
      if (n <= 0) break;
      if (memmem(buf, (size_t)n, "POST /v3/kv/txn", 15) && __atomic_load_n(&p->countdown, __ATOMIC_SEQ_CST) > 0)
        arm = __atomic_sub_fetch(&p->countdown, 1, __ATOMIC_SEQ_CST) == 0;
      if (net_send_all(efd, buf, (size_t)n)) break;
    }
    if (pf[1].revents) {
      ssize_t n = read(efd, buf, sizeof buf);
      if (n <= 0) break;
      if (arm) {
        __atomic_add_fetch(&p->dropped, 1, __ATOMIC_SEQ_CST);
        break;
      }
      if (net_send_all(cfd, buf, (size_t)n)) break;
    }
  }
  close(efd);
  shutdown(cfd, SHUT_RDWR); /* closed by proxy_stop */
  return NULL;
}

static void *proxy_main(void *arg) {
  proxy_t *p = arg;
  while (!__atomic_load_n(&p->stop, __ATOMIC_SEQ_CST)) {
    struct pollfd pf = {p->lfd, POLLIN, 0};
    if (poll(&pf, 1, 100) <= 0) continue;
    int cfd = accept(p->lfd, NULL, NULL);
    relay_arg_t *a = malloc(sizeof *a);
    if (cfd < 0 || !a || p->nrelays == 16) {
      if (cfd >= 0) close(cfd);
      free(a);
      continue;
    }
    *a = (relay_arg_t){p, cfd};
    p->fds[p->nrelays] = cfd;
    if (pthread_create(&p->relays[p->nrelays], NULL, relay, a) == 0) p->nrelays++;
    else close(cfd), free(a);
  }
  return NULL;
}

static void proxy_start(proxy_t *p, int target) {
  char err[256];
  memset(p, 0, sizeof *p);
  p->target = target;
  assert_true((p->lfd = net_listen("127.0.0.1", 0, 4, &p->port, err, sizeof err)) >= 0);
  assert_int_equal(pthread_create(&p->th, NULL, proxy_main, p), 0);
}

static void proxy_stop(proxy_t *p) {
  __atomic_store_n(&p->stop, 1, __ATOMIC_SEQ_CST);
  pthread_join(p->th, NULL);
  for (int i = 0; i < p->nrelays; i++) {
    pthread_join(p->relays[i], NULL);
    close(p->fds[i]);
  }
  close(p->lfd);
}

static void test_lost_txn_reply_counts_once(void **state) {
  if (!g_have_etcd) skip();
  proxy_t p;
  proxy_start(&p, g_one.m[0].client_port);
  char eps[64];
  snprintf(eps, sizeof eps, "127.0.0.1:%d,127.0.0.1:%d", p.port, g_one.m[0].client_port);
  void *v;
  size_t len;
  int64_t r;
  /* add on an absent key: its first transaction applies; the retry on the real member finds
   * version 1 holding our sum. Then on an existing key: the second transaction (the first
   * fails its compare, as the client guesses "absent") applies, its reply lost. */
  for (int round = 1; round <= 2; round++) {
    etcd_t *c = client_of(eps); /* through the proxy: the client stays with member 0 */
    __atomic_store_n(&p.countdown, round, __ATOMIC_SEQ_CST);
    OK(c, etcd_add(c, "lost/n", 5, &r));
    assert_int_equal(__atomic_load_n(&p.dropped, __ATOMIC_SEQ_CST), round);
    assert_int_equal(r, 5 * round);
    OK(c, etcd_get(c, "lost/n", &v, &len, NULL));
    assert_string_equal(v, round == 1 ? "5" : "10");
    free(v);
    etcd_close(c);
  }
  /* compare_set create: the retry finds our value in place, which is a success. */
  etcd_t *c = client_of(eps);
  __atomic_store_n(&p.countdown, 1, __ATOMIC_SEQ_CST);
  int swapped;
  OK(c, etcd_compare_set(c, "lost/leader", NULL, 0, "me", 2, 0, &swapped, &v, &len));
  assert_int_equal(__atomic_load_n(&p.dropped, __ATOMIC_SEQ_CST), 3);
  assert_int_equal(swapped, 1);
  assert_memory_equal(v, "me", 2);
  free(v);
  printf("  lost txn replies: %d dropped after etcd applied them; add counted once, create reported as won\n",
         __atomic_load_n(&p.dropped, __ATOMIC_SEQ_CST));
  etcd_close(c);
  proxy_stop(&p);
}

/* --- errors */

static void test_unreachable_endpoints(void **state) {
  /* Two ports nobody listens on: bound, read, closed. */
  int p[2], fd[2];
  char err[1024], eps[64];
  for (int i = 0; i < 2; i++) assert_true((fd[i] = net_listen("127.0.0.1", 0, 1, &p[i], err, sizeof err)) >= 0);
  for (int i = 0; i < 2; i++) close(fd[i]);
  snprintf(eps, sizeof eps, "127.0.0.1:%d,127.0.0.1:%d", p[0], p[1]);
  etcd_t *c = NULL;
  int64_t t0 = net_now_ms();
  int rc = etcd_connect(&c, eps, 1000, err, sizeof err);
  int64_t ms = net_now_ms() - t0;
  printf("  unreachable (%lld ms): %s\n", (long long)ms, err);
  assert_int_equal(rc, -ECONNREFUSED);
  assert_null(c);
  char want[32];
  for (int i = 0; i < 2; i++) {
    snprintf(want, sizeof want, "127.0.0.1:%d: ", p[i]);
    assert_non_null(strstr(err, want));
  }
  assert_non_null(strstr(err, "etcd connect"));
  assert_null(strchr(err, '\n'));
  assert_in_range(ms, 900, 2500);

  assert_int_equal(etcd_connect(&c, "127.0.0.1:99999", 1000, err, sizeof err), -EINVAL);
  assert_non_null(strstr(err, "99999"));
  assert_int_equal(etcd_connect(&c, "https://127.0.0.1:2379", 1000, err, sizeof err), -EINVAL);
  assert_non_null(strstr(err, "TLS"));
  assert_int_equal(etcd_connect(&c, " , ", 1000, err, sizeof err), -EINVAL);
}

/* --- three members, one killed */

/* Every operation once, under prefix tag/; fails the test on the first error. */
static void every_operation(etcd_t *c, const char *tag) {
  char k[64], k2[64], pre[64];
  snprintf(pre, sizeof pre, "%s/", tag);
  snprintf(k, sizeof k, "%s/k", tag);
  snprintf(k2, sizeof k2, "%s/n", tag);
  void *v;
  size_t len;
  int64_t rev, n, id;
  int swapped, left;
  etcd_kvs_t kvs;
  OK(c, etcd_put(c, k, "\0v", 2, 0));
  OK(c, etcd_get(c, k, &v, &len, &rev));
  assert_int_equal(len, 2);
  assert_memory_equal(v, "\0v", 2);
  free(v);
  OK(c, etcd_get_prefix(c, pre, &kvs));
  assert_int_equal(kvs.n, 1);
  etcd_kvs_free(&kvs);
  OK(c, etcd_compare_set(c, k, "\0v", 2, "w", 1, 0, &swapped, NULL, NULL));
  assert_int_equal(swapped, 1);
  OK(c, etcd_add(c, k2, 3, &n));
  OK(c, etcd_add(c, k2, 4, &n));
  assert_int_equal(n, 7);
  OK(c, etcd_lease_grant(c, 10, &id, NULL));
  OK(c, etcd_lease_keepalive(c, id, &left));
  OK(c, etcd_lease_revoke(c, id));
  OK(c, etcd_watch(c, k, 0, rev, 5000, &kvs)); /* the compare_set's write */
  assert_int_equal(kvs.n, 1);
  etcd_kvs_free(&kvs);
  OK(c, etcd_delete(c, pre, 1, &n));
  assert_int_equal(n, 2);
}

static void test_cluster_survives_a_kill(void **state) {
  if (!g_have_etcd) skip();
  cluster_t *cl = &g_three;
  /* The leader goes first in the list and is the one killed: the client's first choice is
   * then dead and the survivors must elect a new leader. */
  uint64_t leader = raw_number(cl, 0, "/v3/maintenance/status", "{}", "\"leader\":\"");
  int64_t t0, ms;
  assert_true(leader != UINT64_MAX);
  int victim = -1, order[3];
  for (int i = 0; i < 3 && victim < 0; i++)
    if (raw_number(cl, i, "/v3/maintenance/status", "{}", "\"member_id\":\"") == leader) victim = i;
  assert_true(victim >= 0);
  order[0] = victim, order[1] = (victim + 1) % 3, order[2] = (victim + 2) % 3;
  char eps[128], err[1024];
  endpoints(cl, order, eps, sizeof eps);
  etcd_t *a = client_of(eps);
  every_operation(a, "before");

  /* A frozen member (SIGSTOP: its kernel still accepts connections, nothing answers) first in
   * a client's list costs that client one member's share of its timeout, once. */
  int frozen = order[1], forder[3] = {order[1], order[2], order[0]};
  char feps[128];
  endpoints(cl, forder, feps, sizeof feps);
  kill(cl->m[frozen].pid, SIGSTOP);
  t0 = net_now_ms();
  etcd_t *f = client_of(feps);
  int64_t t_conn = net_now_ms() - t0;
  every_operation(f, "frozen");
  ms = net_now_ms() - t0;
  kill(cl->m[frozen].pid, SIGCONT);
  etcd_close(f);
  printf("  cluster: %s frozen and first: connect %lld ms, then every operation %lld ms\n", cl->m[frozen].name,
         (long long)t_conn, (long long)(ms - t_conn));
  assert_in_range(t_conn, OP_MS / 3 - 100, OP_MS);

  /* A watch waiting when the member dies; the event comes after the kill. */
  etcd_kvs_t kvs;
  OK(a, etcd_get_prefix(a, "c/", &kvs));
  watcher_t w = {.key = "c/", .prefix = 1, .timeout_ms = 15000, .from = kvs.revision};
  etcd_kvs_free(&kvs);
  snprintf(w.eps, sizeof w.eps, "%s", eps);
  /* Kill only once the victim holds the watch (its watcher gauge goes up), so that the
   * stream, not the connect, is what fails over. */
  const char *gauge = "\netcd_debugging_mvcc_watcher_total ";
  uint64_t watchers = raw_number(cl, victim, "/metrics", NULL, gauge);
  int64_t until = net_now_ms() + 5000;
  assert_true(watchers != UINT64_MAX);
  pthread_t th;
  watcher_start(&w, &th);
  for (uint64_t now; (now = raw_number(cl, victim, "/metrics", NULL, gauge)) == UINT64_MAX || now <= watchers;)
    assert_true(net_now_ms() < until);

  /* Still the leader (the freeze above must not have caused an election). */
  assert_true(raw_number(cl, order[2], "/v3/maintenance/status", "{}", "\"leader\":\"") == leader);
  t0 = net_now_ms();
  member_kill(cl, victim);
  printf("  cluster: killed leader %s (first of %s)\n", cl->m[victim].name, eps);
  OK(a, etcd_put(a, "c/after", "1", 1, 0));
  ms = net_now_ms() - t0;
  printf("  cluster: first put after the kill took %lld ms (old client)\n", (long long)ms);
  pthread_join(th, NULL);
  if (w.rc) fprintf(stderr, "watch: %s\n", w.err);
  assert_int_equal(w.rc, 0);
  assert_int_equal(w.ev.n, 1);
  assert_string_equal(w.ev.kvs[0].key, "c/after");
  printf("  cluster: the waiting watch got the event %lld ms after the kill\n", (long long)(w.t_end - t0));
  etcd_kvs_free(&w.ev);

  t0 = net_now_ms();
  every_operation(a, "after-old");
  printf("  cluster: every operation, old client: %lld ms\n", (long long)(net_now_ms() - t0));
  t0 = net_now_ms();
  etcd_t *b = client_of(eps); /* a new client, the dead member first */
  every_operation(b, "after-new");
  printf("  cluster: connect + every operation, new client with the dead member first: %lld ms\n",
         (long long)(net_now_ms() - t0));
  etcd_close(b);

  /* A second kill leaves no quorum: a bounded failure that names every member. */
  member_kill(cl, order[1]);
  etcd_t *q = NULL;
  assert_int_equal(etcd_connect(&q, eps, 1500, err, sizeof err) < 0, 1);
  t0 = net_now_ms();
  int rc = etcd_put(a, "c/none", "x", 1, 0);
  ms = net_now_ms() - t0;
  printf("  cluster: without quorum put fails in %lld ms: %s\n", (long long)ms, etcd_errmsg(a));
  assert_true(rc < 0);
  assert_in_range(ms, OP_MS - 100, OP_MS + 2000);
  for (int k = 0; k < 3; k++) {
    char ep[32];
    endpoint(cl, k, ep, sizeof ep);
    assert_non_null(strstr(etcd_errmsg(a), ep));
  }
  assert_null(strchr(etcd_errmsg(a), '\n'));
  assert_non_null(strstr(etcd_errmsg(a), "no leader")); /* refused at once, not held for 7 s */
  etcd_close(a);
}

int main(void) {
  g_have_etcd = access(ETCD_BIN, X_OK) == 0;
  if (!g_have_etcd)
    printf("test_etcd: SKIPPED: %s not found (Debian package etcd-server; scripts/install-deps.sh installs it)\n",
           ETCD_BIN);
  const struct CMUnitTest one[] = {
      cmocka_unit_test(test_put_get_delete_binary), cmocka_unit_test(test_compare_set),
      cmocka_unit_test(test_add_concurrent),        cmocka_unit_test(test_create_index_one_request), cmocka_unit_test(test_put2_clone_grant_ttl),        cmocka_unit_test(test_lease_expiry_fences),
      cmocka_unit_test(test_watch),                 cmocka_unit_test(test_lost_txn_reply_counts_once),
      cmocka_unit_test(test_unreachable_endpoints),
  };
  const struct CMUnitTest three[] = {cmocka_unit_test(test_cluster_survives_a_kill)};
  int failed = cmocka_run_group_tests_name("etcd, one member", one, setup_one, teardown_one);
  failed += cmocka_run_group_tests_name("etcd, three members", three, setup_three, teardown_three);
  return failed != 0;
}
