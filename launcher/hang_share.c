/* hang_share: the hang watch's exchange between nodes (see hang_share.h). The thread's loop is
 * a few calls per period: add this node's step changes to the counter (an add of 0 reads it),
 * post the ask or the digests when the loop has handed them over, look for the ask, and on the
 * asking node read the digests of the nodes still missing. */
#include "launcher/hang_share.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "common/log.h"
#include "common/store.h"

#define CONNECT_MS 5000

struct hang_share {
  hang_share_config_t cfg;
  char secret[1100], run_id[256];
  uv_thread_t thr;
  uv_mutex_t mu;
  uv_cond_t wake;
  int stop;
  store_t *st; /* the thread's; store_interrupt from stop */
  /* under mu */
  uint64_t pending, counter;
  int post_ask, asked, gathering;
  char *mine; /* this node's digests, to post */
  size_t mine_len;
  char **got; /* per node, its digests once read */
  size_t *got_len;
  int ngot;
};

static void keyf(const hang_share_t *s, char *out, size_t len, const char *what) {
  snprintf(out, len, "meshrun/hang/r%d/%s", s->cfg.round, what);
}

/* Reads the digests of the nodes still missing. */
static void read_digests(hang_share_t *s) {
  for (int i = 0; i < s->cfg.nnodes; i++) {
    uv_mutex_lock(&s->mu);
    int have = i == s->cfg.node || s->got[i];
    uv_mutex_unlock(&s->mu);
    if (have) continue;
    char key[128], what[32];
    snprintf(what, sizeof what, "dumps/%d", i);
    keyf(s, key, sizeof key, what);
    void *v = NULL;
    size_t len = 0;
    if (store_get_nowait(s->st, key, &v, &len)) continue;
    uv_mutex_lock(&s->mu);
    s->got[i] = v;
    s->got_len[i] = len;
    s->ngot++;
    uv_mutex_unlock(&s->mu);
  }
}

/* One period's calls. A failed call is tried again next period; the last failure is warned of
 * once. */
static int exchange(hang_share_t *s) {
  char key[128];
  uv_mutex_lock(&s->mu);
  uint64_t delta = s->pending;
  int ask = s->post_ask == 1, gather = s->gathering;
  char *mine = s->mine;
  size_t mine_len = s->mine_len;
  s->pending = 0;
  if (ask) s->post_ask = 2;
  s->mine = NULL;
  uv_mutex_unlock(&s->mu);
  int64_t now = 0;
  keyf(s, key, sizeof key, "progress");
  int rc = store_add(s->st, key, (int64_t)delta, &now);
  if (ask) {
    char me[16];
    snprintf(me, sizeof me, "%d", s->cfg.node);
    keyf(s, key, sizeof key, "ask");
    if (!rc) rc = store_set(s->st, key, me, strlen(me));
  }
  if (mine) {
    char what[32];
    snprintf(what, sizeof what, "dumps/%d", s->cfg.node);
    keyf(s, key, sizeof key, what);
    if (!rc) rc = store_set(s->st, key, mine, mine_len);
    free(mine);
  }
  int exist = 0;
  keyf(s, key, sizeof key, "ask");
  const char *keys[] = {key};
  if (!rc) rc = store_check(s->st, keys, 1, &exist);
  if (!rc && gather) read_digests(s);
  uv_mutex_lock(&s->mu);
  if (rc) s->pending += delta; /* counted next time */
  else s->counter = (uint64_t)now;
  if (exist) s->asked = 1;
  uv_mutex_unlock(&s->mu);
  return rc;
}

static void run(void *arg) {
  hang_share_t *s = arg;
  char err[256];
  store_auth_t auth = {.run_id = s->run_id, .secret = s->secret};
  store_t *st = NULL;
  int rc = store_connect_endpoint(&st, s->cfg.endpoint, &auth, CONNECT_MS, err, sizeof err);
  uv_mutex_lock(&s->mu);
  s->st = st;
  if (rc) log_warn("--hang_timeout: cannot reach the store %s (%s): this node's watch sees its own ranks only",
                   s->cfg.endpoint, err);
  int warned = 0;
  while (!rc && !s->stop) {
    uv_mutex_unlock(&s->mu);
    int e = exchange(s);
    uv_mutex_lock(&s->mu);
    if (s->stop) break; /* stopping interrupts the call: not worth a warning */
    if (e && !warned++) log_warn("--hang_timeout: the store %s: %s", s->cfg.endpoint, store_errmsg(st));
    int fast = s->post_ask || s->asked || s->gathering;
    uv_cond_timedwait(&s->wake, &s->mu, (uint64_t)(fast ? HANG_SHARE_FAST_MS : HANG_SHARE_POLL_MS) * 1000000);
  }
  s->st = NULL;
  uv_mutex_unlock(&s->mu);
  store_close(st);
}

hang_share_t *hang_share_start(const hang_share_config_t *cfg) {
  hang_share_t *s = calloc(1, sizeof *s);
  int n = cfg->nnodes > 0 ? cfg->nnodes : 1;
  if (s) {
    s->got = calloc((size_t)n, sizeof *s->got);
    s->got_len = calloc((size_t)n, sizeof *s->got_len);
  }
  if (!s || !s->got || !s->got_len) {
    log_warn("--hang_timeout: out of memory; this node's watch sees its own ranks only");
    if (s) free(s->got), free(s->got_len);
    free(s);
    return NULL;
  }
  s->cfg = *cfg;
  snprintf(s->secret, sizeof s->secret, "%s", cfg->secret ? cfg->secret : "");
  snprintf(s->run_id, sizeof s->run_id, "%s", cfg->run_id ? cfg->run_id : "");
  s->cfg.secret = s->secret;
  s->cfg.run_id = s->run_id;
  uv_mutex_init(&s->mu);
  uv_cond_init(&s->wake);
  if (uv_thread_create(&s->thr, run, s)) {
    log_warn("--hang_timeout: cannot start a thread; this node's watch sees its own ranks only");
    uv_cond_destroy(&s->wake);
    uv_mutex_destroy(&s->mu);
    free(s->got);
    free(s->got_len);
    free(s);
    return NULL;
  }
  return s;
}

void hang_share_stop(hang_share_t *s) {
  if (!s) return;
  uv_mutex_lock(&s->mu);
  s->stop = 1;
  store_interrupt(s->st); /* its call in progress fails at once */
  uv_cond_signal(&s->wake);
  uv_mutex_unlock(&s->mu);
  uv_thread_join(&s->thr);
  for (int i = 0; i < s->cfg.nnodes; i++) free(s->got[i]);
  free(s->got);
  free(s->got_len);
  free(s->mine);
  uv_cond_destroy(&s->wake);
  uv_mutex_destroy(&s->mu);
  free(s);
}

void hang_share_progress(hang_share_t *s, uint64_t delta) {
  uv_mutex_lock(&s->mu);
  s->pending += delta;
  uv_mutex_unlock(&s->mu);
}

uint64_t hang_share_counter(hang_share_t *s) {
  uv_mutex_lock(&s->mu);
  uint64_t v = s->counter;
  uv_mutex_unlock(&s->mu);
  return v;
}

void hang_share_ask(hang_share_t *s) {
  uv_mutex_lock(&s->mu);
  if (!s->post_ask) s->post_ask = 1;
  uv_cond_signal(&s->wake);
  uv_mutex_unlock(&s->mu);
}

int hang_share_asked(hang_share_t *s) {
  uv_mutex_lock(&s->mu);
  int v = s->asked;
  uv_mutex_unlock(&s->mu);
  return v;
}

void hang_share_publish(hang_share_t *s, const char *text, size_t len) {
  if (len > HANG_SHARE_MAX) { /* whole digests only: cut before the header that passes the bound */
    size_t k = HANG_SHARE_MAX;
    while (k > 0 && strncmp(text + k, "\n{\"type\":\"header\"", 17)) k--;
    len = k ? k + 1 : 0;
  }
  char *copy = malloc(len + 1);
  if (!copy) return;
  memcpy(copy, text, len);
  copy[len] = 0;
  uv_mutex_lock(&s->mu);
  free(s->mine);
  s->mine = copy;
  s->mine_len = len;
  uv_cond_signal(&s->wake);
  uv_mutex_unlock(&s->mu);
}

void hang_share_gather(hang_share_t *s) {
  uv_mutex_lock(&s->mu);
  s->gathering = 1;
  uv_cond_signal(&s->wake);
  uv_mutex_unlock(&s->mu);
}

int hang_share_gathered(hang_share_t *s, char **text, size_t *len) {
  uv_mutex_lock(&s->mu);
  size_t total = 0;
  for (int i = 0; i < s->cfg.nnodes; i++) total += s->got[i] ? s->got_len[i] : 0;
  char *t = total ? malloc(total + 1) : NULL;
  size_t k = 0;
  for (int i = 0; t && i < s->cfg.nnodes; i++) {
    if (!s->got[i]) continue;
    memcpy(t + k, s->got[i], s->got_len[i]);
    k += s->got_len[i];
  }
  if (t) t[k] = 0;
  int n = s->ngot;
  uv_mutex_unlock(&s->mu);
  *text = t;
  *len = k;
  return n;
}
