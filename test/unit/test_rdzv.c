// deps: launcher/rdzv.c launcher/rdzv_kv_store.c launcher/rdzv_kv_etcd.c common/etcd.c common/http.c launcher/store_server.c common/store.c common/store_proto.c common/net.c common/log.c common/err.c
/* Unit tests of rdzv's pure decision logic: round closing, late joiners, rank assignment,
 * heartbeat verdicts, fatal ends, the end record's JSON round trip and the master record that
 * carries each round's restart count. No sockets, except the last tests: a store that stops
 * answering mid-round must be reported as lost (RDZV_EV_STORE_LOST), not silently end the
 * heartbeats; with a short heartbeat_timeout the watchdog reports it within that timeout (plus
 * its half-interval tick), not after the store client's 5 s reply slack. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "launcher/rdzv.h"
#include "launcher/store_server.h"

static rdzv_node_t mk(int idx, int node_rank, int nproc, const char *addr) {
  rdzv_node_t n = {.idx = idx, .node_rank = node_rank, .nproc = nproc, .addr = addr};
  return n;
}

static void test_close_action(void **state) {
  (void)state;
  /* --nnodes=2:4 */
  assert_int_equal(rdzv_close_action(1, 2, 4), RDZV_CLOSE_WAIT);
  assert_int_equal(rdzv_close_action(2, 2, 4), RDZV_CLOSE_AFTER_LAST_CALL);
  assert_int_equal(rdzv_close_action(3, 2, 4), RDZV_CLOSE_AFTER_LAST_CALL);
  assert_int_equal(rdzv_close_action(4, 2, 4), RDZV_CLOSE_NOW);
  /* fixed size: only the last one closes, at once */
  assert_int_equal(rdzv_close_action(1, 2, 2), RDZV_CLOSE_WAIT);
  assert_int_equal(rdzv_close_action(2, 2, 2), RDZV_CLOSE_NOW);
  assert_int_equal(rdzv_close_action(1, 1, 1), RDZV_CLOSE_NOW);
  /* over-subscribed joins still say "now" (the round is already closed by then) */
  assert_int_equal(rdzv_close_action(5, 2, 4), RDZV_CLOSE_NOW);
}

static void test_late_action(void **state) {
  (void)state;
  assert_int_equal(rdzv_late_action(1, 2), RDZV_LATE_SCALE_UP);
  assert_int_equal(rdzv_late_action(2, 2), RDZV_LATE_WAIT_END);
  assert_int_equal(rdzv_late_action(3, 8), RDZV_LATE_SCALE_UP);
}

static void test_ranks_by_join_order_heterogeneous(void **state) {
  (void)state;
  rdzv_node_t nodes[3] = {mk(1, -1, 2, "a"), mk(2, -1, 4, "b"), mk(3, -1, 1, "c")};
  rdzv_assignment_t a;
  int r0;
  char err[256];
  assert_int_equal(rdzv_assign_ranks(nodes, 3, 2, &a, &r0, err, sizeof err), 0);
  assert_int_equal(a.group_rank, 1);
  assert_int_equal(a.rank_offset, 2);
  assert_int_equal(a.world_size, 7);
  assert_int_equal(a.nnodes, 3);
  assert_int_equal(a.nproc, 4);
  assert_int_equal(r0, 1);
  assert_int_equal(rdzv_assign_ranks(nodes, 3, 3, &a, &r0, err, sizeof err), 0);
  assert_int_equal(a.group_rank, 2);
  assert_int_equal(a.rank_offset, 6);
}

static void test_ranks_by_node_rank(void **state) {
  (void)state;
  /* joined as a, b, c but node ranks say c, a, b */
  rdzv_node_t nodes[3] = {mk(1, 1, 2, "a"), mk(2, 2, 3, "b"), mk(3, 0, 1, "c")};
  rdzv_assignment_t a;
  int r0;
  char err[256];
  assert_int_equal(rdzv_assign_ranks(nodes, 3, 1, &a, &r0, err, sizeof err), 0);
  assert_int_equal(a.group_rank, 1);
  assert_int_equal(a.rank_offset, 1);
  assert_int_equal(r0, 3);
  assert_int_equal(rdzv_assign_ranks(nodes, 3, 2, &a, &r0, err, sizeof err), 0);
  assert_int_equal(a.group_rank, 2);
  assert_int_equal(a.rank_offset, 3);
  assert_int_equal(a.world_size, 6);
  /* one node without a node rank: join order for all */
  nodes[1].node_rank = -1;
  assert_int_equal(rdzv_assign_ranks(nodes, 3, 3, &a, &r0, err, sizeof err), 0);
  assert_int_equal(a.group_rank, 2);
  assert_int_equal(r0, 1);
}

static void test_ranks_errors(void **state) {
  (void)state;
  rdzv_node_t nodes[2] = {mk(1, 0, 1, "hostA"), mk(2, 0, 1, "hostB")};
  rdzv_assignment_t a;
  int r0;
  char err[256] = "";
  assert_int_equal(rdzv_assign_ranks(nodes, 2, 1, &a, &r0, err, sizeof err), -EINVAL);
  assert_non_null(strstr(err, "--node_rank=0"));
  assert_non_null(strstr(err, "hostA"));
  nodes[1].node_rank = 1;
  assert_int_equal(rdzv_assign_ranks(nodes, 2, 9, &a, &r0, err, sizeof err), -EINVAL);
  assert_non_null(strstr(err, "not a participant"));
}

static void test_node_list_parse(void **state) {
  (void)state;
  const char *text = "-1 2 10.0.0.1\n-1 1 host-b.example\n7\t8\t[fd00::3]\n";
  int oom = 1;
  rdzv_node_t *nodes = rdzv_parse_node_list(text, strlen(text), 3, &oom);
  assert_non_null(nodes);
  assert_int_equal(oom, 0);
  assert_int_equal(nodes[0].idx, 1);
  assert_int_equal(nodes[0].node_rank, -1);
  assert_int_equal(nodes[0].nproc, 2);
  assert_string_equal(nodes[0].addr, "10.0.0.1");
  assert_string_equal(nodes[1].addr, "host-b.example");
  assert_int_equal(nodes[2].idx, 3);
  assert_int_equal(nodes[2].node_rank, 7);
  assert_int_equal(nodes[2].nproc, 8);
  assert_string_equal(nodes[2].addr, "[fd00::3]");
  free(nodes);
  /* The count must match, every line must end, and each field must be there and in range. */
  char long_addr[RDZV_ADDR_MAX + 16];
  snprintf(long_addr, sizeof long_addr, "0 1 %0*d\n", RDZV_ADDR_MAX, 0);
  const char *bad[] = {
      "-1 1 a\n",              /* one line for two nodes */
      "-1 1 a\n-1 1 b\n-1 1 c\n", /* three */
      "-1 1 a\n-1 1 b",         /* the last line unended */
      "-1 1 a\nx 1 b\n",        /* not a number */
      "-1 1 a\n-1 1\n",         /* no address */
      "-1 1 a\n-1 1 \n",        /* an empty one */
      "-1 1 a\n- 1 b\n",        /* a sign alone */
      "-1 1 a\n99999999999 1 b\n", /* 11 digits */
      "-1 1 a\n3000000000 1 b\n", /* past INT_MAX */
      "-1 1 a\n-1 1 b c\n",     /* something after the address */
      long_addr,
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    oom = 1;
    nodes = rdzv_parse_node_list(bad[i], strlen(bad[i]), 2, &oom);
    if (nodes) fail_msg("accepted malformed list %zu: %s", i, bad[i]);
    assert_int_equal(oom, 0);
  }
}

/* Many nodes with node ranks in a scrambled order (the sort) and without (join order, no sort):
 * each node's group rank is its node rank, or its join position. */
static void test_ranks_many_nodes(void **state) {
  (void)state;
  enum { N = 2048 };
  rdzv_node_t *nodes = calloc(N, sizeof *nodes);
  assert_non_null(nodes);
  for (int i = 0; i < N; i++) nodes[i] = mk(i + 1, (int)((i * 1237L) % N), 1 + i % 3, "h");
  rdzv_assignment_t a;
  int r0 = 0;
  char err[256];
  for (int i = 0; i < N; i += 97) {
    assert_int_equal(rdzv_assign_ranks(nodes, N, i + 1, &a, &r0, err, sizeof err), 0);
    assert_int_equal(a.group_rank, nodes[i].node_rank);
    assert_int_equal(nodes[r0 - 1].node_rank, 0);
    int offset = 0; /* nproc of the nodes with lower node ranks */
    for (int j = 0; j < N; j++)
      if (nodes[j].node_rank < nodes[i].node_rank) offset += nodes[j].nproc;
    assert_int_equal(a.rank_offset, offset);
  }
  for (int i = 0; i < N; i++) nodes[i].node_rank = -1;
  assert_int_equal(rdzv_assign_ranks(nodes, N, 1500, &a, &r0, err, sizeof err), 0);
  assert_int_equal(a.group_rank, 1499);
  assert_int_equal(r0, 1);
  free(nodes);
}

static void test_heartbeat_verdicts(void **state) {
  (void)state;
  rdzv_hb_t hb;
  assert_int_equal(rdzv_hb_init(&hb, 3, 100.0), 0);
  assert_false(rdzv_hb_is_dead(&hb, 0, 100.5, 1.0));
  rdzv_hb_observe(&hb, 0, 1, 100.8);
  rdzv_hb_observe(&hb, 1, 0, 100.8); /* unchanged counter: no news */
  assert_false(rdzv_hb_is_dead(&hb, 0, 101.5, 1.0));
  assert_true(rdzv_hb_is_dead(&hb, 1, 101.5, 1.0));
  rdzv_hb_observe(&hb, 1, 7, 101.6); /* it came back */
  assert_false(rdzv_hb_is_dead(&hb, 1, 102.0, 1.0));
  assert_true(rdzv_hb_is_dead(&hb, 2, 101.01, 1.0));
  assert_false(rdzv_hb_is_dead(&hb, 9, 1e9, 1.0)); /* out of range: never dead */
  rdzv_hb_free(&hb);
  rdzv_hb_free(&hb); /* twice is fine */
}

/* The ring: each node follows the next participant not done, and a peer followed from now on
 * starts its silence afresh. */
static void test_hb_ring(void **state) {
  (void)state;
  char done[4] = {0, 0, 0, 0};
  assert_int_equal(rdzv_hb_next(done, 4, 0), 1);
  assert_int_equal(rdzv_hb_next(done, 4, 3), 0); /* wraps around */
  done[1] = done[2] = 1;
  assert_int_equal(rdzv_hb_next(done, 4, 0), 3); /* skips the done */
  done[3] = 1;
  assert_int_equal(rdzv_hb_next(done, 4, 0), -1); /* everyone else is done */
  assert_int_equal(rdzv_hb_next(done, 1, 0), -1); /* alone */
  /* Every death is seen: for any set of dead nodes with one alive, some live node's next is dead. */
  for (int mask = 1; mask < 15; mask++) {
    char none[4] = {0, 0, 0, 0};
    int seen = 0;
    for (int me = 0; me < 4; me++)
      if (!(mask >> me & 1) && (mask >> rdzv_hb_next(none, 4, me) & 1)) seen = 1;
    assert_true(seen);
  }
  rdzv_hb_t hb;
  assert_int_equal(rdzv_hb_init(&hb, 4, 100.0), 0);
  rdzv_hb_follow(&hb, 1, 0, 100.5); /* the first followed: its silence counts from the round's start */
  assert_true(rdzv_hb_is_dead(&hb, 1, 101.2, 1.0));
  rdzv_hb_follow(&hb, 1, 0, 101.2); /* unchanged: still dead */
  assert_true(rdzv_hb_is_dead(&hb, 1, 101.2, 1.0));
  rdzv_hb_follow(&hb, 3, 0, 101.2); /* switched to slot 3: afresh, though its counter never moved */
  assert_int_equal(hb.watched, 3);
  assert_false(rdzv_hb_is_dead(&hb, 3, 102.0, 1.0));
  assert_true(rdzv_hb_is_dead(&hb, 3, 102.3, 1.0));
  rdzv_hb_follow(&hb, 3, 5, 102.3); /* it moved */
  assert_false(rdzv_hb_is_dead(&hb, 3, 103.0, 1.0));
  rdzv_hb_free(&hb);
}

static void test_end_fatal(void **state) {
  (void)state;
  assert_false(rdzv_end_fatal(RDZV_END_FAILURE, 1, 1, 2, 2));
  assert_true(rdzv_end_fatal(RDZV_END_FAILURE, 2, 1, 2, 2));
  assert_true(rdzv_end_fatal(RDZV_END_FAILURE, 1, 0, 2, 2));
  assert_false(rdzv_end_fatal(RDZV_END_DEAD_NODE, 0, 0, 1, 1));
  assert_true(rdzv_end_fatal(RDZV_END_DEAD_NODE, 0, 5, 1, 2));
  assert_false(rdzv_end_fatal(RDZV_END_SCALE_UP, 99, 0, 1, 2));
}

/* P/r<r>/master carries MASTER_ADDR, MASTER_PORT and the round's failure count, so every node
 * gives its workers the same TORCHELASTIC_RESTART_COUNT. */
static void test_master_record(void **state) {
  (void)state;
  char buf[RDZV_ADDR_MAX + 64];
  rdzv_assignment_t a;
  memset(&a, 0, sizeof a);
  assert_int_equal(rdzv_master_encode(buf, sizeof buf, "fe80::1%eth0", 41234, 3, 0), 0);
  assert_string_equal(buf, "fe80::1%eth0 41234 3");
  /* Not NUL-terminated, as a store value may be: trailing bytes past len are ignored. */
  char raw[64];
  memcpy(raw, buf, strlen(buf));
  memcpy(raw + strlen(buf), "9999", 5);
  assert_int_equal(rdzv_master_decode(raw, strlen(buf), &a), 0);
  assert_string_equal(a.master_addr, "fe80::1%eth0");
  assert_int_equal(a.master_port, 41234);
  assert_int_equal(a.failures, 3);

  assert_int_equal(rdzv_master_encode(buf, sizeof buf, "node0", 29500, 0, 0), 0);
  assert_int_equal(rdzv_master_decode(buf, strlen(buf), &a), 0);
  assert_string_equal(a.master_addr, "node0");
  assert_int_equal(a.failures, 0);
  assert_int_equal(a.store_port, 0);

  /* etcd: the round's store rides along, on the same address. */
  assert_int_equal(rdzv_master_encode(buf, sizeof buf, "10.0.0.2", 29500, 1, 41000), 0);
  assert_string_equal(buf, "10.0.0.2 29500 1 41000");
  assert_int_equal(rdzv_master_decode(buf, strlen(buf), &a), 0);
  assert_int_equal(a.store_port, 41000);
  assert_int_equal(a.failures, 1);

  /* An addr with a space would shift the fields; a buffer too small must not truncate. */
  assert_int_equal(rdzv_master_encode(buf, sizeof buf, "a b", 1, 0, 0), -EINVAL);
  assert_int_equal(rdzv_master_encode(buf, sizeof buf, "", 1, 0, 0), -EINVAL);
  assert_int_equal(rdzv_master_encode(buf, 8, "127.0.0.1", 29500, 0, 0), -ENAMETOOLONG);

  /* The old two-field form, extra fields, bad ports and counts are malformed. */
  const char *bad[] = {"127.0.0.1 29500", "127.0.0.1 29500 1 2 3", "127.0.0.1 29500 1 0", "127.0.0.1 29500 1 70000",
                       "127.0.0.1 29500 1 2x", "127.0.0.1 0 1", "127.0.0.1 70000 1",
                       "127.0.0.1 29500 -1", "127.0.0.1 29500 x", "", "127.0.0.1 29500 1x"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    assert_int_equal(rdzv_master_decode(bad[i], strlen(bad[i]), &a), -EINVAL);
}

static void test_end_json_round_trip(void **state) {
  (void)state;
  rdzv_end_t e = {.kind = RDZV_END_FAILURE, .fatal = 1, .exit_code = 137, .rank = 5, .local_rank = 1,
                  .signal = 9, .time = 1700000000.25, .node_idx = 2};
  strcpy(e.host, "node-a");
  strcpy(e.message, "RuntimeError: \"quoted\"\nsecond line");
  strcpy(e.reason, "rank 5 died");
  char *s = rdzv_end_encode(&e);
  assert_non_null(s);
  rdzv_end_t d;
  assert_int_equal(rdzv_end_decode(s, strlen(s), &d), 0);
  assert_int_equal(d.kind, e.kind);
  assert_int_equal(d.fatal, 1);
  assert_int_equal(d.exit_code, 137);
  assert_int_equal(d.rank, 5);
  assert_int_equal(d.local_rank, 1);
  assert_int_equal(d.signal, 9);
  assert_int_equal(d.node_idx, 2);
  assert_true(d.time == e.time);
  assert_string_equal(d.host, "node-a");
  assert_string_equal(d.message, e.message);
  assert_string_equal(d.reason, e.reason);
  free(s);
  assert_int_equal(rdzv_end_decode("{\"kind\":\"nope\"}", 15, &d), -EINVAL);
  assert_int_equal(rdzv_end_decode("garbage", 7, &d), -EINVAL);
}

/* ---- a store that stops answering while a round runs ---- */

typedef struct {
  uv_loop_t loop;
  uv_async_t freeze, stop;
  uv_timer_t poll;
  uv_sem_t release;
  store_server_t *srv;
  int port;
  uint64_t frozen_at; /* uv_hrtime() when the store stopped answering */
} frozen_store_t;

/* Freezes once the watch thread is connected and parked on the round's end key: from then on
 * its connection stays open and nothing is answered. */
static void fs_on_poll(uv_timer_t *t) {
  frozen_store_t *fs = t->data;
  if (store_server_num_waiters(fs->srv) == 0) return;
  uv_timer_stop(t);
  fs->frozen_at = uv_hrtime();
  uv_sem_wait(&fs->release); /* the store's loop stops here */
}

static void fs_on_freeze(uv_async_t *h) {
  frozen_store_t *fs = h->data;
  uv_timer_start(&fs->poll, fs_on_poll, 1, 1);
}

static void fs_on_stop(uv_async_t *h) {
  frozen_store_t *fs = h->data;
  store_server_close(fs->srv);
  uv_close((uv_handle_t *)&fs->freeze, NULL);
  uv_close((uv_handle_t *)&fs->stop, NULL);
  uv_close((uv_handle_t *)&fs->poll, NULL);
}

static void fs_thread(void *arg) { uv_run(&((frozen_store_t *)arg)->loop, UV_RUN_DEFAULT); }

typedef struct {
  rdzv_t *rz;
  frozen_store_t *fs;
  uv_timer_t deadline;
  int assigned, errors, lost, timed_out;
  uint64_t lost_at; /* uv_hrtime() of the STORE_LOST event */
  char message[RDZV_MSG_MAX];
} watch_probe_t;

static void probe_finish(watch_probe_t *p) {
  rdzv_shutdown(p->rz);
  uv_close((uv_handle_t *)&p->deadline, NULL);
}

static void probe_on_event(rdzv_t *rz, const rdzv_event_t *ev, void *arg) {
  watch_probe_t *p = arg;
  (void)rz;
  if (ev->kind == RDZV_EV_ASSIGNED) {
    p->assigned = 1;
    uv_async_send(&p->fs->freeze);
  } else if (ev->kind == RDZV_EV_ERROR || ev->kind == RDZV_EV_STORE_LOST) {
    if (ev->kind == RDZV_EV_ERROR) p->errors++;
    else p->lost++;
    p->lost_at = uv_hrtime();
    snprintf(p->message, sizeof p->message, "%s", ev->message);
    probe_finish(p);
  }
}

static void probe_on_deadline(uv_timer_t *t) {
  watch_probe_t *p = t->data;
  p->timed_out = 1;
  probe_finish(p);
}

/* Runs one round against a store that freezes once the watch thread waits on it; returns the
 * seconds from the freeze to the report. */
static double run_frozen(double heartbeat_timeout_s, watch_probe_t *pp) {
  frozen_store_t fs;
  memset(&fs, 0, sizeof fs);
  char err[512];
  assert_int_equal(uv_loop_init(&fs.loop), 0);
  assert_int_equal(store_server_start(&fs.srv, &fs.loop, "127.0.0.1", 0, NULL, &fs.port, err, sizeof err), 0);
  assert_int_equal(uv_sem_init(&fs.release, 0), 0);
  uv_async_init(&fs.loop, &fs.freeze, fs_on_freeze);
  uv_async_init(&fs.loop, &fs.stop, fs_on_stop);
  uv_timer_init(&fs.loop, &fs.poll);
  fs.freeze.data = fs.stop.data = fs.poll.data = &fs;
  uv_thread_t thr;
  assert_int_equal(uv_thread_create(&thr, fs_thread, &fs), 0);

  uv_loop_t loop;
  assert_int_equal(uv_loop_init(&loop), 0);
  rdzv_config_t cfg = {.store_port = fs.port, .nnodes_min = 1, .nnodes_max = 1, .node_rank = -1, .nproc = 1,
                       .join_timeout_s = 10, .last_call_timeout_s = 0.1, .close_timeout_s = 10,
                       .heartbeat_interval_s = 0.1, .heartbeat_timeout_s = heartbeat_timeout_s, .max_restarts = 0};
  snprintf(cfg.store_host, sizeof cfg.store_host, "127.0.0.1");
  snprintf(cfg.run_id, sizeof cfg.run_id, "frozen");
  snprintf(cfg.addr, sizeof cfg.addr, "127.0.0.1");
  watch_probe_t p;
  memset(&p, 0, sizeof p);
  p.fs = &fs;
  uv_timer_init(&loop, &p.deadline);
  p.deadline.data = &p;
  /* The client gives up on a reply after the wait (0.1 s) plus its 5 s slack; 30 s bounds the test. */
  uv_timer_start(&p.deadline, probe_on_deadline, 30000, 0);
  assert_int_equal(rdzv_create(&p.rz, &loop, &cfg, probe_on_event, &p, err, sizeof err), 0);
  rdzv_join(p.rz);
  uv_run(&loop, UV_RUN_DEFAULT);

  uv_sem_post(&fs.release);
  uv_async_send(&fs.stop);
  uv_thread_join(&thr);
  uv_sem_destroy(&fs.release);
  assert_int_equal(uv_loop_close(&fs.loop), 0);
  assert_int_equal(rdzv_destroy(p.rz, 10000), 0);
  assert_int_equal(uv_loop_close(&loop), 0);
  /* The round ran, then exactly one report came, and it was "lost", not another error. */
  assert_true(p.assigned);
  assert_false(p.timed_out);
  assert_int_equal(p.errors, 0);
  assert_int_equal(p.lost, 1);
  *pp = p;
  return p.lost_at > fs.frozen_at ? (double)(p.lost_at - fs.frozen_at) / 1e9 : 0;
}

/* A heartbeat_timeout longer than the client's reply slack: the failed call reports it. */
static void test_store_that_stops_answering_is_reported(void **state) {
  (void)state;
  watch_probe_t p;
  double t = run_frozen(30, &p);
  print_message("store lost after %.2f s: %s\n", t, p.message);
  assert_non_null(strstr(p.message, "rendezvous store at 127.0.0.1:"));
  assert_non_null(strstr(p.message, "lost"));
  assert_non_null(strstr(p.message, "--rdzv_backend=etcd"));
}

/* heartbeat_timeout 0.5 s: the watchdog reports the silence in 0.5 s plus one tick (0.05 s),
 * long before the 5 s slack; allowed: under 1.5 s. */
static void test_silent_store_is_lost_within_heartbeat_timeout(void **state) {
  (void)state;
  watch_probe_t p;
  double t = run_frozen(0.5, &p);
  print_message("silent store reported after %.3f s (heartbeat_timeout 0.5 s, allowed < 1.5 s): %s\n", t,
                p.message);
  assert_true(t > 0 && t < 1.5);
  assert_non_null(strstr(p.message, "no reply for"));
  assert_non_null(strstr(p.message, "heartbeat_timeout=0.5s"));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_close_action),
      cmocka_unit_test(test_late_action),
      cmocka_unit_test(test_ranks_by_join_order_heterogeneous),
      cmocka_unit_test(test_ranks_by_node_rank),
      cmocka_unit_test(test_ranks_errors),
      cmocka_unit_test(test_node_list_parse),
      cmocka_unit_test(test_ranks_many_nodes),
      cmocka_unit_test(test_heartbeat_verdicts),
      cmocka_unit_test(test_hb_ring),
      cmocka_unit_test(test_end_fatal),
      cmocka_unit_test(test_master_record),
      cmocka_unit_test(test_end_json_round_trip),
      cmocka_unit_test(test_store_that_stops_answering_is_reported),
      cmocka_unit_test(test_silent_store_is_lost_within_heartbeat_timeout),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
