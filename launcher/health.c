/* health: the check before a round (see health.h). The thread's steps, in order: connect to the
 * store, the GEMM (the trainer's probe, else the host loop), listen and post this node's
 * address, wait for every node's address (so that no node sends to one still busy with its
 * GEMM), the ring transfer, post the result, read every node's. The judgement is pure and runs
 * on the loop's side of the callback. */
#include "launcher/health.h"

#include <errno.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/env.h"
#include "common/err.h"
#include "common/gemm_rate.h"
#include "common/log.h"
#include "common/net.h"
#include "common/store.h"
#include "launcher/health_probe.h"

#define CONNECT_MS 5000
#define NET_CHUNK (256u << 10)
#define POLL_SLICE_MS 100

struct health {
  health_config_t cfg;
  char secret[1100], run_id[256];
  uv_loop_t *loop;
  uv_async_t async;
  health_cb cb;
  void *arg;
  uv_thread_t thr;
  int thread_started;
  atomic_int stop;
  uv_mutex_t mu;
  store_t *st; /* the thread's; interrupted by health_stop under mu */
  /* written by the thread before its async_send, read on the loop after */
  health_result_t *res;
  int rc;
  char err[512];
  double elapsed_s;
};

/* ---- the judgement (pure) ---- */

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

double health_median(const double *v, int n) {
  if (n <= 0) return 0;
  double *s = malloc((size_t)n * sizeof *s);
  if (!s) return 0;
  memcpy(s, v, (size_t)n * sizeof *s);
  qsort(s, (size_t)n, sizeof *s, cmp_double);
  double m = n % 2 ? s[n / 2] : (s[n / 2 - 1] + s[n / 2]) / 2;
  free(s);
  return m;
}

/* Node i's lower fraction of the two medians (1 where a median is 0 or unmeasured). */
static double node_fraction(const health_result_t *r, const health_summary_t *sum) {
  double f = 1;
  if (sum->gemm_median > 0) f = r->gflops / sum->gemm_median;
  if (sum->net_median > 0 && r->mbps > 0 && r->mbps / sum->net_median < f) f = r->mbps / sum->net_median;
  return f;
}

/* "cpu", "cuda x8": what measured node r's GEMM. */
static void node_devices(const health_result_t *r, char *out, size_t len) {
  if (r->devices > 1) snprintf(out, len, "%s x%d", r->device, r->devices);
  else snprintf(out, len, "%s", r->device);
}

void health_flops_text(double gflops, char *out, size_t len) {
  if (gflops >= 1000) snprintf(out, len, "%.1f TFLOP/s", gflops / 1000);
  else snprintf(out, len, "%.1f GFLOP/s", gflops);
}

int health_judge(const health_result_t *res, int n, double min_fraction, int nnodes_min, health_verdict_t *verdict,
                 health_summary_t *sum) {
  memset(sum, 0, sizeof *sum);
  double *v = calloc((size_t)(n > 0 ? n : 1), sizeof *v);
  if (!v) return -1;
  int k = 0;
  for (int i = 0; i < n; i++) v[i] = res[i].gflops;
  sum->gemm_median = health_median(v, n);
  for (int i = 0; i < n; i++)
    if (res[i].mbps > 0) v[k++] = res[i].mbps;
  sum->net_median = health_median(v, k);
  free(v);
  node_devices(&res[0], sum->devices, sizeof sum->devices);
  for (int i = 1; i < n; i++)
    if (strcmp(res[i].device, res[0].device) || res[i].devices != res[0].devices)
      snprintf(sum->devices, sizeof sum->devices, "mixed devices");
  for (int i = 0; i < n; i++) {
    verdict[i] = node_fraction(&res[i], sum) < min_fraction ? HEALTH_WARN : HEALTH_OK;
    sum->unhealthy += verdict[i] == HEALTH_WARN;
  }
  /* Worst first: each pass leaves out the lowest fraction still in, while enough remain. */
  while (n - sum->left_out > nnodes_min) {
    int worst = -1;
    for (int i = 0; i < n; i++)
      if (verdict[i] == HEALTH_WARN && !res[i].keep &&
          (worst < 0 || node_fraction(&res[i], sum) < node_fraction(&res[worst], sum)))
        worst = i;
    if (worst < 0) break;
    verdict[worst] = HEALTH_OUT;
    sum->left_out++;
  }
  return sum->left_out;
}

void health_line(const health_result_t *res, int n, int i, health_verdict_t v, const health_summary_t *sum,
                 double min_fraction, int nnodes_min, int nnodes_max, char *out, size_t len) {
  const health_result_t *r = &res[i];
  int k;
  int net = sum->net_median > 0 && r->mbps > 0 && r->mbps / sum->net_median < min_fraction &&
            !(sum->gemm_median > 0 && r->gflops / sum->gemm_median < min_fraction);
  if (net)
    k = snprintf(out, len, "health check: node %d (host %s) link to the next node %.0f MB/s is %.2f of the median "
                 "%.0f MB/s", i, r->host, r->mbps, r->mbps / sum->net_median, sum->net_median);
  else {
    char rate[32], med[32], dev[40];
    health_flops_text(r->gflops, rate, sizeof rate);
    health_flops_text(sum->gemm_median, med, sizeof med);
    node_devices(r, dev, sizeof dev);
    k = snprintf(out, len, "health check: node %d (host %s) GEMM %s on %s is %.2f of the median %s", i, r->host, rate,
                 dev, sum->gemm_median > 0 ? r->gflops / sum->gemm_median : 1, med);
  }
  if (k < 0 || (size_t)k >= len) return;
  out += k;
  len -= (size_t)k;
  int remain = n - sum->left_out;
  if (v == HEALTH_OUT)
    snprintf(out, len, ": left out of this round (%d of --nnodes %d:%d remain)", remain, nnodes_min, nnodes_max);
  else if (remain - 1 < nnodes_min)
    snprintf(out, len, " (below %g): kept: leaving it out would leave %d node(s), fewer than --nnodes %d:%d allows",
             min_fraction, remain - 1, nnodes_min, nnodes_max);
  else
    snprintf(out, len, " (below %g): kept: it serves the rendezvous store", min_fraction);
}

/* ---- the measurements ---- */

static double mono_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* c += a b, n x n, row-major; i-k-j so that the inner loop runs along rows. */
static void gemm(const float *a, const float *b, float *c, int n) {
  for (int i = 0; i < n; i++)
    for (int k = 0; k < n; k++) {
      float aik = a[i * n + k];
      for (int j = 0; j < n; j++) c[i * n + j] += aik * b[k * n + j];
    }
}

/* One product of the host loop: the matrices after each other in m (three of HEALTH_GEMM_N^2). */
static void host_product(void *m) {
  const size_t nn = (size_t)HEALTH_GEMM_N * HEALTH_GEMM_N;
  gemm(m, (float *)m + nn, (float *)m + 2 * nn, HEALTH_GEMM_N);
}

/* GFLOP/s of the host loop: the best of HEALTH_GEMM_SLICES slices of products (gemm_rate.h). */
static double measure_gemm(health_t *h) {
  const int n = HEALTH_GEMM_N;
  size_t nn = (size_t)n * n;
  float *m = malloc(3 * nn * sizeof *m);
  if (!m) return 0;
  for (size_t i = 0; i < 3 * nn; i++) m[i] = (float)((i * 7919) % 17) * 0.01f;
  const double best = gemm_rate_best(host_product, m, 2.0 * n * n * n, HEALTH_GEMM_SLICES, HEALTH_GEMM_SLICE_S,
                                     env_fraction(GEMM_RATE_FAULT_ENV), &h->stop);
  free(m);
  return best;
}

/* This node's GEMM into mine: the trainer's probe on the workers' devices, else (no trainer
 * beside meshrun, or it failed: one warning says why) the host loop. Nothing on a stop. */
static void node_gemm(health_t *h, health_result_t *mine, double deadline) {
  char path[4096], why[700], rate[32], dev[40];
  health_probe_t p;
  double t0 = mono_s(), left = deadline - t0;
  int rc = health_probe_path(path, sizeof path, why, sizeof why);
  if (!rc) {
    char perr[600];
    rc = health_probe_run(path, h->cfg.nproc, left < HEALTH_PROBE_TIMEOUT_S ? left : HEALTH_PROBE_TIMEOUT_S, &h->stop,
                          &p, perr, sizeof perr);
    if (rc) snprintf(why, sizeof why, "the trainer's GEMM probe (%.380s %s) failed: %.250s", path, HEALTH_PROBE_FLAG,
                     perr);
  }
  if (atomic_load(&h->stop)) return;
  if (!rc) {
    mine->gflops = p.gflops;
    mine->devices = p.devices;
    snprintf(mine->device, sizeof mine->device, "%s", p.device);
    health_flops_text(p.gflops, rate, sizeof rate);
    node_devices(mine, dev, sizeof dev);
    log_info("health check: this node's GEMM %s on %s in %s (%s %s, %.2fs)", rate, dev, p.dtype, path,
             HEALTH_PROBE_FLAG, mono_s() - t0);
    return;
  }
  log_warn("health check: %s: the GEMM runs on this host's CPU", why);
  mine->gflops = measure_gemm(h);
  mine->devices = 1;
  snprintf(mine->device, sizeof mine->device, "%s", HEALTH_HOST_DEVICE);
}

typedef struct {
  int lfd, in, out;       /* listener, from the previous node, to the next */
  size_t sent, got;
  int acked, answered;
  char *buf;
} ring_t;

/* One poll round of the ring transfer: accept, receive (answering one byte when all is in),
 * send, read the answer. 0, or -1 with err. */
static int ring_step(ring_t *r, int wait_ms, char *err, size_t errlen) {
  struct pollfd p[2] = {{.fd = r->in >= 0 ? r->in : r->lfd, .events = POLLIN},
                        {.fd = r->out, .events = r->sent < HEALTH_NET_BYTES ? POLLOUT : POLLIN}};
  if (r->answered) p[0].fd = -1;
  if (r->acked) p[1].fd = -1;
  if (poll(p, 2, wait_ms) < 0 && errno != EINTR) return err_set(err, errlen, -1, "poll: %s", strerror(errno));
  if (p[0].revents && r->in < 0) {
    r->in = accept(r->lfd, NULL, NULL);
    if (r->in < 0) return err_set(err, errlen, -1, "accepting the previous node: %s", strerror(errno));
  } else if (p[0].revents) {
    ssize_t k = recv(r->in, r->buf, NET_CHUNK, MSG_DONTWAIT);
    if (k <= 0 && !(k < 0 && (errno == EAGAIN || errno == EINTR)))
      return err_set(err, errlen, -1, "the previous node's bytes: %s", k ? strerror(errno) : "it closed");
    if (k > 0) r->got += (size_t)k;
    if (r->got >= HEALTH_NET_BYTES) {
      if (net_send_all(r->in, "k", 1)) return err_set(err, errlen, -1, "answering the previous node");
      r->answered = 1;
    }
  }
  if (p[1].revents && r->sent < HEALTH_NET_BYTES) {
    size_t want = HEALTH_NET_BYTES - r->sent < NET_CHUNK ? HEALTH_NET_BYTES - r->sent : NET_CHUNK;
    ssize_t k = send(r->out, r->buf, want, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (k < 0 && errno != EAGAIN && errno != EINTR)
      return err_set(err, errlen, -1, "sending to the next node: %s", strerror(errno));
    if (k > 0) r->sent += (size_t)k;
  } else if (p[1].revents) {
    char c;
    ssize_t k = recv(r->out, &c, 1, MSG_DONTWAIT);
    if (k == 0 || (k < 0 && errno != EAGAIN && errno != EINTR))
      return err_set(err, errlen, -1, "the next node's answer: %s", k ? strerror(errno) : "it closed");
    if (k == 1) r->acked = 1;
  }
  return 0;
}

/* The ring transfer over the sockets: MB/s to the next node, or -1 with err. */
static double ring_transfer(health_t *h, ring_t *r, const char *host, int port, double deadline, char *err,
                            size_t errlen) {
  char cerr[256];
  /* Once: the next node listened before it posted its address, so a refusal means it is gone
   * (the rendezvous then ends the round), and a stop must not wait for retries. */
  double left_ms = (deadline - mono_s()) * 1000;
  r->out = net_connect_once(host, port, left_ms < CONNECT_MS ? (int)left_ms + 1 : CONNECT_MS, cerr, sizeof cerr);
  if (r->out < 0) return err_set(err, errlen, -1, "connecting to the next node: %s", cerr);
  double t0 = mono_s();
  while (!(r->acked && r->answered)) {
    if (atomic_load(&h->stop)) return err_set(err, errlen, -1, "stopped");
    double left = deadline - mono_s();
    if (left <= 0)
      return err_set(err, errlen, -1, "the ring transfer did not finish in time (sent %zu, received %zu of %u bytes)",
                     r->sent, r->got, HEALTH_NET_BYTES);
    if (ring_step(r, left * 1000 < POLL_SLICE_MS ? (int)(left * 1000) + 1 : POLL_SLICE_MS, err, errlen)) return -1;
  }
  double dt = mono_s() - t0;
  return HEALTH_NET_BYTES / (dt > 1e-6 ? dt : 1e-6) / 1e6 * env_fraction(HEALTH_FAULT_NET_ENV);
}

static void keyf(const health_t *h, char *out, size_t len, const char *what, int node) {
  snprintf(out, len, "meshrun/health/r%d/%s/%d", h->cfg.round, what, node);
}

/* Waits for key "what/<i>" of every node; vals[i] malloc'ed (the caller frees each). */
static int gather(health_t *h, const char *what, char **vals, double deadline, char *err, size_t errlen) {
  int n = h->cfg.nnodes, rc = -1;
  char (*keys)[96] = calloc((size_t)n, sizeof *keys);
  const char **kp = calloc((size_t)n, sizeof *kp);
  size_t *lens = calloc((size_t)n, sizeof *lens);
  if (!keys || !kp || !lens) {
    err_set(err, errlen, -1, "out of memory");
    goto out;
  }
  for (int i = 0; i < n; i++) {
    keyf(h, keys[i], sizeof keys[i], what, i);
    kp[i] = keys[i];
  }
  int ms = (int)((deadline - mono_s()) * 1000);
  int src = store_multi_get(h->st, kp, (size_t)n, (void **)vals, lens, ms > 0 ? ms : 1);
  if (src == STORE_ETIMEDOUT) {
    int missing = -1;
    for (int i = 0; i < n && missing < 0; i++) {
      int ex = 0;
      if (!store_check(h->st, &kp[i], 1, &ex) && !ex) missing = i;
    }
    err_set(err, errlen, -1, "no %s from node %d within %gs", strcmp(what, "ep") ? "result" : "address", missing,
            h->cfg.timeout_s);
  } else if (src) {
    err_set(err, errlen, -1, "the store %s: %s", h->cfg.endpoint, store_errmsg(h->st));
  } else {
    rc = 0;
  }
out:
  free(keys);
  free(kp);
  free(lens);
  return rc;
}

/* Listens, posts this node's address, waits for everyone's, runs the ring. MB/s or -1. */
static double measure_net(health_t *h, double deadline, char *err, size_t errlen) {
  int n = h->cfg.nnodes, next = (h->cfg.node + 1) % n, port = 0;
  ring_t r = {.lfd = -1, .in = -1, .out = -1};
  char **eps = calloc((size_t)n, sizeof *eps), key[96], val[300], host[256], cerr[256];
  double rate = -1;
  r.buf = calloc(1, NET_CHUNK);
  if (!eps || !r.buf) {
    err_set(err, errlen, -1, "out of memory");
    goto out;
  }
  if ((r.lfd = net_listen(h->cfg.addr, 0, 4, &port, cerr, sizeof cerr)) < 0) {
    err_set(err, errlen, -1, "listening for the previous node: %s", cerr);
    goto out;
  }
  snprintf(val, sizeof val, "%s %d", h->cfg.addr, port);
  keyf(h, key, sizeof key, "ep", h->cfg.node);
  if (store_set(h->st, key, val, strlen(val))) {
    err_set(err, errlen, -1, "the store %s: %s", h->cfg.endpoint, store_errmsg(h->st));
    goto out;
  }
  if (gather(h, "ep", eps, deadline, err, errlen)) goto out;
  if (sscanf(eps[next], "%255s %d", host, &port) != 2) {
    err_set(err, errlen, -1, "node %d's address \"%.100s\" is not \"host port\"", next, eps[next]);
    goto out;
  }
  rate = ring_transfer(h, &r, host, port, deadline, err, errlen);
out:
  for (int i = 0; eps && i < n; i++) free(eps[i]);
  free(eps);
  free(r.buf);
  if (r.lfd >= 0) close(r.lfd);
  if (r.in >= 0) close(r.in);
  if (r.out >= 0) close(r.out);
  return rate;
}

/* Posts this node's result and reads everyone's into h->res. */
static int exchange(health_t *h, const health_result_t *mine, double deadline, char *err, size_t errlen) {
  int n = h->cfg.nnodes, rc = 0;
  char key[96], val[160];
  snprintf(val, sizeof val, "%.6g %.6g %d %s %s %d", mine->gflops, mine->mbps, mine->keep, mine->host, mine->device,
           mine->devices);
  keyf(h, key, sizeof key, "res", h->cfg.node);
  if (store_set(h->st, key, val, strlen(val)))
    return err_set(err, errlen, -1, "the store %s: %s", h->cfg.endpoint, store_errmsg(h->st));
  char **vals = calloc((size_t)n, sizeof *vals);
  h->res = calloc((size_t)n, sizeof *h->res);
  if (!vals || !h->res) rc = err_set(err, errlen, -1, "out of memory");
  if (!rc) rc = gather(h, "res", vals, deadline, err, errlen);
  for (int i = 0; !rc && i < n; i++) {
    health_result_t *r = &h->res[i];
    /* A meshrun from before the probe posts four fields: its GEMM was the host loop. */
    snprintf(r->device, sizeof r->device, "%s", HEALTH_HOST_DEVICE);
    r->devices = 1;
    int f = sscanf(vals[i], "%lf %lf %d %63s %15s %d", &r->gflops, &r->mbps, &r->keep, r->host, r->device,
                   &r->devices);
    if (f != 4 && f != 6)
      rc = err_set(err, errlen, -1, "node %d's result \"%.100s\" is not \"gflops mbps keep host device devices\"",
                   i, vals[i]);
  }
  for (int i = 0; vals && i < n; i++) free(vals[i]);
  free(vals);
  return rc;
}

static int check(health_t *h, char *err, size_t errlen) {
  double t0 = mono_s(), deadline = t0 + h->cfg.timeout_s;
  store_auth_t auth = {.run_id = h->run_id, .secret = h->secret};
  store_t *st = NULL;
  char cerr[256];
  int rc = store_connect_endpoint(&st, h->cfg.endpoint, &auth, CONNECT_MS, cerr, sizeof cerr);
  uv_mutex_lock(&h->mu);
  h->st = st;
  if (atomic_load(&h->stop)) store_interrupt(st);
  uv_mutex_unlock(&h->mu);
  if (rc) return err_set(err, errlen, -1, "cannot reach the store %s: %s", h->cfg.endpoint, cerr);
  health_result_t mine = {.keep = h->cfg.keep};
  net_hostname(mine.host, sizeof mine.host);
  for (char *p = mine.host; *p; p++)
    if (*p == ' ') *p = '_';
  node_gemm(h, &mine, deadline);
  if (atomic_load(&h->stop)) return err_set(err, errlen, -1, "stopped");
  if (h->cfg.nnodes > 1 && (mine.mbps = measure_net(h, deadline, err, errlen)) < 0) return -1;
  if (exchange(h, &mine, deadline, err, errlen)) return -1;
  h->elapsed_s = mono_s() - t0;
  return 0;
}

static void run(void *arg) {
  health_t *h = arg;
  h->rc = check(h, h->err, sizeof h->err);
  uv_async_send(&h->async);
}

static void on_async(uv_async_t *a) {
  health_t *h = a->data;
  if (atomic_load(&h->stop) || !h->cb) return;
  health_cb cb = h->cb;
  h->cb = NULL; /* once */
  cb(h, h->arg);
}

health_t *health_start(uv_loop_t *loop, const health_config_t *cfg, health_cb cb, void *arg, char *err,
                       size_t errlen) {
  health_t *h = calloc(1, sizeof *h);
  if (!h) {
    err_set(err, errlen, -1, "out of memory");
    return NULL;
  }
  h->cfg = *cfg;
  snprintf(h->secret, sizeof h->secret, "%s", cfg->secret ? cfg->secret : "");
  snprintf(h->run_id, sizeof h->run_id, "%s", cfg->run_id ? cfg->run_id : "");
  h->loop = loop;
  h->cb = cb;
  h->arg = arg;
  uv_mutex_init(&h->mu);
  uv_async_init(loop, &h->async, on_async);
  h->async.data = h;
  if (uv_thread_create(&h->thr, run, h)) {
    err_set(err, errlen, -1, "cannot start a thread");
    health_stop(h);
    return NULL;
  }
  h->thread_started = 1;
  return h;
}

int health_results(health_t *h, const health_result_t **res, int *n, double *elapsed_s, char *err, size_t errlen) {
  if (h->rc) return err_set(err, errlen, -1, "%s", h->err);
  *res = h->res;
  *n = h->cfg.nnodes;
  *elapsed_s = h->elapsed_s;
  return 0;
}

static void on_closed(uv_handle_t *hd) {
  health_t *h = hd->data;
  free(h->res);
  uv_mutex_destroy(&h->mu);
  free(h);
}

void health_stop(health_t *h) {
  if (!h) return;
  uv_mutex_lock(&h->mu);
  atomic_store(&h->stop, 1);
  store_interrupt(h->st);
  uv_mutex_unlock(&h->mu);
  if (h->thread_started) uv_thread_join(&h->thr);
  store_close(h->st);
  h->st = NULL;
  uv_close((uv_handle_t *)&h->async, on_closed);
}
