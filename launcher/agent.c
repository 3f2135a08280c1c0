/* agent: meshrun's per-round state machine (see agent.h), on one libuv loop.
 *
 * Events in: rdzv (round assigned, round ended, drained, done, store lost, fatal error),
 * workers (one exited; all idle), signals, the join backstop timer. A round ends for this node
 * in one place, round_over(), and only when both halves are in: the reason (the store's end
 * key, seen by rdzv's watch thread, identical on every node) and the local workers idle. So
 * every node decides "restart" or "fatal" from the same record, and never spawns over live
 * workers. A fatal end on the node that serves the store waits for one more thing, rdzv's word
 * that the other nodes have read it (RDZV_EV_DRAINED): leaving takes the store with it.
 *
 * What ends the job instead of a restart: a worker's failure it calls permanent (exit 2
 * or 78, or its error file) or that its interpreter's import error makes so (the last line of
 * its stderr; launcher/errfile decides), failures past --max_restarts, too few nodes left, and
 * the store lost (its node died: AGENT_EXIT_STORE_LOST on every other node).
 *
 * The store and other jobs. The store belongs to this job (its run id and secret), but jobs
 * that hold the same secret may share its port: the server keeps each job's keys apart. So
 * when this job ends while other jobs still have connections, the agent keeps the loop, the
 * store and the signal handlers, and leaves once the last of them is gone (a timer checks;
 * INT/TERM/HUP end the wait at once). A second job that finds the endpoint held by a store
 * that refuses its secret stops at once: rendezvous there can never succeed.
 * Not here: what the keys are (rdzv), how children are made (workers). */
#include "launcher/agent.h"

#include <arpa/inet.h>
#include <errno.h>
#include <ftw.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "common/err.h"
#include "common/log.h"
#include "common/net.h"
#include "common/store.h"
#include "launcher/errfile.h"
#include "launcher/hang.h"
#include "launcher/health.h"
#include "launcher/rdzv.h"
#include "launcher/store_server.h"
#include "launcher/workers.h"

/* How long meshrun's exit waits for the rendezvous threads to return (they usually do in
 * microseconds once their sockets are shut down). */
#define RDZV_JOIN_WAIT_MS 500
/* While other jobs use this agent's store after its job ended: how often it looks whether
 * they have all gone (the server has no event for it; a connection closing is rare here). */
#define LINGER_CHECK_MS 100
/* --health_check: what the check may take past heartbeat_timeout (a peer that never posts its
 * result is by then a dead node to the rendezvous, which ends the round). */
#define HEALTH_SLACK_S 10.0

/* CHECKING: the round is assigned and --health_check measures the nodes before its workers
 * start (launcher/health). */
typedef enum { AGENT_JOINING = 0, AGENT_CHECKING, AGENT_RUNNING, AGENT_STOPPING, AGENT_FINISHING, AGENT_EXITING } agent_state_t;

static const int FORWARDED[] = {WORKERS_FORWARDED_SIGNALS};
#define NFORWARDED ((int)(sizeof FORWARDED / sizeof FORWARDED[0]))

typedef struct {
  uv_loop_t loop;
  launcher_opts_t *opts;
  agent_state_t state;
  store_server_t *srv;
  store_t *probe; /* host_or_join's connection to another node's store, for rdzv to take over */
  char store_host[256];
  int store_port;
  char store_ep[300];
  rdzv_t *rz;
  workers_t *wk;
  hang_t *hang; /* --hang_timeout's watch; NULL when off */
  health_t *health;      /* --health_check's check of the round being assigned, while CHECKING */
  workers_round_t round; /* what the workers start with once the check has passed */
  int health_out;        /* the check left this node out: it leaves once the round has ended */
  char addr[RDZV_ADDR_MAX]; /* this node's address (node_address) */
  rdzv_assignment_t asg;
  uv_signal_t sigs[NFORWARDED];
  uv_timer_t join_timer;
  uv_timer_t linger_timer; /* running while the store serves only other jobs */
  int lingering;
  char base_dir[PATH_MAX]; /* <log_dir>/<run_id>_<random>, or a temporary directory */
  int base_is_tmp;
  int base_shared;        /* base_dir is $TMPDIR/meshrun-<uid>, shared: our files carry file_prefix */
  char file_prefix[200];  /* "<run id>-<pid>-<random>-" there, else "" */
  int have_end;    /* the round's end record is in */
  rdzv_end_t end;
  int drained;     /* store host: the other nodes have read the round's fatal end */
  int drains;      /* c10d's store host: waits for drained before leaving on a fatal end (with
                    * etcd, the job's state outlives every node, and no node waits) */
  int local_failure; /* this node reported the round's failure */
  int exit_code;
  int shutdown_sig;  /* INT/TERM/HUP received */
} agent_t;

static void fmt_time(double t, char *out, size_t len) {
  time_t s = (time_t)t;
  struct tm tm;
  gmtime_r(&s, &tm);
  size_t n = strftime(out, len, "%Y-%m-%dT%H:%M:%S", &tm);
  snprintf(out + n, len - n, ".%03dZ", (int)((t - (double)s) * 1000));
}

static const char *sig_name(int sig, char *buf, size_t len) {
  const char *abbrev = sigabbrev_np(sig);
  if (abbrev) snprintf(buf, len, "SIG%s", abbrev);
  else snprintf(buf, len, "signal %d", sig);
  return buf;
}

static void close_all(agent_t *a);

/* Leaves: workers first (a grace period if they run), then every handle, so uv_run returns. */
static void agent_exit(agent_t *a, int code) {
  if (a->state == AGENT_EXITING) return;
  a->state = AGENT_EXITING;
  a->exit_code = code;
  hang_unwatch(a->hang);
  health_stop(a->health);
  a->health = NULL;
  uv_timer_stop(&a->join_timer);
  rdzv_shutdown(a->rz); /* no rdzv event comes after this; agent_run destroys it */
  if (a->wk && !workers_idle(a->wk)) {
    workers_stop(a->wk, SIGTERM, a->opts->shutdown_timeout_s, "exit");
    return; /* on_idle finishes */
  }
  close_all(a);
}

/* The last handles: signals, timers, the store. uv_run returns once they have closed. */
static void close_store(agent_t *a) {
  a->lingering = 0;
  for (int i = 0; i < NFORWARDED; i++)
    if (!uv_is_closing((uv_handle_t *)&a->sigs[i])) uv_close((uv_handle_t *)&a->sigs[i], NULL);
  if (!uv_is_closing((uv_handle_t *)&a->linger_timer)) uv_close((uv_handle_t *)&a->linger_timer, NULL);
  store_server_close(a->srv);
  a->srv = NULL;
}

static void on_linger(uv_timer_t *t) {
  agent_t *a = t->data;
  size_t n = store_server_num_foreign(a->srv);
  if (n) return;
  log_info("the other jobs have left the store: exiting");
  close_store(a);
}

static void close_all(agent_t *a) {
  /* Whatever may linger in the workers' process groups goes now, success or not. */
  workers_kill_all(a->wk);
  workers_close(a->wk);
  hang_close(a->hang);
  a->hang = NULL;
  if (!uv_is_closing((uv_handle_t *)&a->join_timer)) uv_close((uv_handle_t *)&a->join_timer, NULL);
  /* Other jobs sharing the port would lose their store: serve them until they leave. */
  size_t foreign = a->srv ? store_server_num_foreign(a->srv) : 0;
  if (foreign && !a->lingering) {
    log_info("job '%s' is done; the store stays up for %zu connection(s) of other jobs", a->opts->rdzv_id, foreign);
    a->lingering = 1;
    uv_timer_start(&a->linger_timer, on_linger, LINGER_CHECK_MS, LINGER_CHECK_MS);
    return;
  }
  close_store(a);
}

static void print_summary(agent_t *a) {
  const rdzv_end_t *e = &a->end;
  char tbuf[64], sbuf[32];
  log_error("job failed: %s", e->reason);
  if (e->kind == RDZV_END_FAILURE && e->rank >= 0) {
    fmt_time(e->time, tbuf, sizeof tbuf);
    log_error("root cause (first observed failure):");
    log_error("  rank:      %d (local_rank %d)", e->rank, e->local_rank);
    log_error("  host:      %s", e->host);
    char cmd[256] = "";
    size_t k = 0;
    char **argv = cli_worker_argv(a->opts); /* what every node's workers exec'd */
    for (int i = 0; argv && argv[i] && k < sizeof cmd - 1; i++)
      k += (size_t)snprintf(cmd + k, sizeof cmd - k, "%s%s", i ? " " : "", argv[i]);
    free(argv);
    if (k >= sizeof cmd - 1) strcpy(cmd + sizeof cmd - 4, "...");
    log_error("  program:   %s", cmd);
    if (e->signal)
      log_error("  exitcode:  %d (%s)", e->exit_code, sig_name(e->signal, sbuf, sizeof sbuf));
    else
      log_error("  exitcode:  %d", e->exit_code);
    log_error("  time:      %s", tbuf);
    if (e->message[0]) log_error("  message:   %s", e->message);
    else log_error("  message:   <no error file written>");
  }
}

static void start_join(agent_t *a) {
  a->state = AGENT_JOINING;
  a->have_end = 0;
  a->drained = 0;
  a->local_failure = 0;
  /* The rdzv thread enforces join_timeout with precise messages (and handshake_timeout on an
   * endpoint that accepts and never answers); this timer is the backstop for a store that
   * answered the handshake and then stalls a request. */
  rdzv_join(a->rz);
}

static void on_join_timeout(uv_timer_t *t) {
  agent_t *a = t->data;
  if (a->state != AGENT_JOINING) return;
  log_error("%s %s: rendezvous did not complete within join_timeout=%gs (no meshrun store answered, or too few "
            "nodes joined)",
            a->opts->rdzv_endpoint_from, a->store_ep, a->opts->join_timeout_s);
  agent_exit(a, 1);
}

static void arm_join_timer(agent_t *a) {
  /* From now: before the first uv_run the loop's clock still reads its start, and probing the
   * endpoint (host_or_join) can take seconds. */
  uv_update_time(&a->loop);
  uv_timer_start(&a->join_timer, on_join_timeout, (uint64_t)(a->opts->join_timeout_s * 1000) + 2000, 0);
}

/* Both halves of a round's end are in: restart or leave. A fatal end on the store's node has a
 * third: the other nodes have read it (rdzv's DRAINED), since leaving takes the store away. */
static void round_over(agent_t *a) {
  if (a->state != AGENT_STOPPING || !a->have_end || !workers_idle(a->wk)) return;
  if (a->end.fatal && a->drains && !a->drained) return;
  if (a->end.fatal) {
    print_summary(a);
    agent_exit(a, a->end.exit_code ? a->end.exit_code : 1);
    return;
  }
  if (a->health_out) {
    /* As an elastic node that leaves: the others go on without it; started again once healthy,
     * it joins the job as a scale-up. */
    log_error("round %d ended (%s): this node was left out by --health_check: exiting", a->asg.round,
              rdzv_end_kind_name(a->end.kind));
    agent_exit(a, 1);
    return;
  }
  log_info("round %d ended (%s): %s; re-rendezvous", a->asg.round, rdzv_end_kind_name(a->end.kind), a->end.reason);
  start_join(a);
  arm_join_timer(a);
}

/* The one line for a Python worker that cannot import: who, what, and where to install it:
 * "rank 0 (python3) cannot import 'x' (ModuleNotFoundError): install it for /usr/bin/python3;
 * no restart tried", with "or set PYTHON_EXEC" when meshrun chose the interpreter (a *.py or -m
 * PROGRAM). A program that runs Python some other way (a shell script) is named instead of an
 * interpreter meshrun cannot know. */
static void python_line(const workers_t *w, const launcher_opts_t *o, int rank, const char *exc, const char *what,
                        char *out, size_t len) {
  char python[PATH_MAX], prog[PATH_MAX];
  workers_python(w, python, sizeof python);
  char **argv = cli_worker_argv(o);
  snprintf(prog, sizeof prog, "%s", python[0] ? python : argv ? argv[0] : "?");
  free(argv);
  const char *base = strrchr(prog, '/');
  base = base ? base + 1 : prog;
  if (python[0])
    snprintf(out, len, "rank %d (%.100s) cannot import %.300s (%s): install it for %.400s%s; no restart tried", rank,
             base, what, exc, python, o->python ? " or set PYTHON_EXEC" : "");
  else
    snprintf(out, len, "rank %d (%.100s) cannot import %.300s (%s): install it for the Python that %.100s runs; no "
             "restart tried", rank, base, what, exc, base);
}

static void on_worker_exit(workers_t *w, const workers_info_t *info, void *arg) {
  agent_t *a = arg;
  char sbuf[32];
  if (info->exit_code == 0) {
    log_debug("rank %d exited 0", info->rank);
    return;
  }
  if (a->state != AGENT_RUNNING) {
    log_debug("rank %d exited with %d while stopping", info->rank, info->exit_code);
    return;
  }
  /* The first failure of the round on this node: the root cause if this node wins the claim. */
  rdzv_end_t e = {.kind = RDZV_END_FAILURE, .exit_code = info->exit_code, .rank = info->rank,
                  .local_rank = info->local_rank, .signal = info->term_signal, .time = info->exit_time};
  net_hostname(e.host, sizeof e.host);
  char ts[64], err[256];
  int restart = ERRFILE_RESTART_UNSAID;
  /* No file is the usual case (the worker wrote none); any other fault is worth saying. */
  int erc = errfile_read(info->error_file, e.message, sizeof e.message, ts, sizeof ts, &restart, err, sizeof err);
  if (erc && erc != -ENOENT) snprintf(e.message, sizeof e.message, "(unreadable error file: %.900s)", err);
  int n;
  if (info->term_signal)
    n = snprintf(e.reason, sizeof e.reason, "rank %d (pid %d) on %s died by %s", info->rank, (int)info->pid, e.host,
                 sig_name(info->term_signal, sbuf, sizeof sbuf));
  else
    n = snprintf(e.reason, sizeof e.reason, "rank %d (pid %d) on %s exited with code %d", info->rank,
                 (int)info->pid, e.host, info->exit_code);
  /* A Python worker's last line, when it exited 1 and its error file (if any) says nothing
   * about restarting: an import failure is no restart's to cure. */
  char exc[32] = "", what[256] = "";
  int import_error = 0;
  if (info->exit_code == 1 && !info->term_signal && restart == ERRFILE_RESTART_UNSAID) {
    char tail[WORKERS_TAIL_BYTES];
    size_t tn = workers_stderr_tail(w, info->local_rank, tail, sizeof tail);
    import_error = errfile_import_error(tail, tn, exc, sizeof exc, what, sizeof what);
  }
  /* The worker knows a restart cannot help (a bad plan, a missing file), by its error file or
   * by its exit code, or its interpreter lacks a module: the job ends now, whatever budget is
   * left. The end record is fatal and travels to every node, so each one stops with this code
   * and says why. */
  errfile_verdict_t v = errfile_verdict(info->exit_code, info->term_signal, restart, import_error);
  char *tail = n > 0 && (size_t)n < sizeof e.reason ? e.reason + n : NULL;
  size_t left = tail ? sizeof e.reason - (size_t)n : 0;
  if (v == ERRFILE_PERMANENT_BY_FILE) {
    e.fatal = 1;
    if (tail)
      snprintf(tail, left, "; no restart tried: its error file asks for none (\"meshrun\": {\"restart\": false})");
  } else if (v == ERRFILE_PERMANENT_BY_CODE) {
    const char *meaning = errfile_exit_meaning(info->exit_code);
    e.fatal = 1;
    if (tail) snprintf(tail, left, "; no restart tried: exit code %d is permanent (%s)", info->exit_code, meaning);
    if (!e.message[0])
      snprintf(e.message, sizeof e.message, "exit code %d (permanent: %s; meshrun does not restart it)",
               info->exit_code, meaning);
  } else if (v == ERRFILE_PERMANENT_BY_IMPORT) {
    python_line(w, a->opts, info->rank, exc, what, e.message, sizeof e.message);
    log_error("%s", e.message);
    e.fatal = 1;
    if (tail) snprintf(tail, left, "; no restart tried: Python cannot import %s (%s)", what, exc);
  }
  log_warn("%s: stopping the other workers", e.reason);
  hang_unwatch(a->hang);
  a->state = AGENT_STOPPING;
  a->local_failure = 1;
  workers_stop(a->wk, SIGTERM, a->opts->shutdown_timeout_s, "failure");
  rdzv_end_round(a->rz, &e);
}

/* The hang watch named a hang (its diagnosis is logged): the round ends as for a failure of the
 * rank it names, and counts against --max_restarts like one. */
static void on_hang(hang_t *h, const char *summary, const diag_rank_t *named, void *arg) {
  agent_t *a = arg;
  if (a->state != AGENT_RUNNING) return;
  int rank = named ? named->rank : -1;
  rdzv_end_t e = {.kind = RDZV_END_FAILURE, .exit_code = 1, .rank = rank, .local_rank = rank - a->asg.rank_offset};
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  e.time = ts.tv_sec + ts.tv_nsec * 1e-9;
  net_hostname(e.host, sizeof e.host);
  if (named && named->node >= 0) { /* a rank of another node, perhaps: its own host and local rank */
    e.local_rank = named->local_rank;
    if (named->host[0]) snprintf(e.host, sizeof e.host, "%s", named->host);
  }
  snprintf(e.reason, sizeof e.reason, "%.*s", (int)strcspn(summary, "\n"), summary);
  snprintf(e.message, sizeof e.message, "no step for --hang_timeout=%gs: %.900s", a->opts->hang_timeout_s, e.reason);
  log_warn("hang: stopping the workers");
  a->state = AGENT_STOPPING;
  a->local_failure = 1;
  workers_stop(a->wk, SIGTERM, a->opts->shutdown_timeout_s, "failure");
  rdzv_end_round(a->rz, &e);
}

static void on_workers_idle(workers_t *w, void *arg) {
  agent_t *a = arg;
  switch (a->state) {
  case AGENT_RUNNING:
    /* Every worker exited 0. */
    if (workers_count(w) == 1) log_info("round %d: the worker exited 0", a->asg.round);
    else log_info("round %d: all %d workers exited 0", a->asg.round, workers_count(w));
    a->state = AGENT_FINISHING;
    rdzv_done(a->rz);
    break;
  case AGENT_STOPPING: round_over(a); break;
  case AGENT_EXITING: close_all(a); break;
  default: break;
  }
}

/* Where a round's worker files go: <base>/attempt_<round>, or, when no worker writes a log
 * and the base is temporary, the base itself: the only files are the error files and the stop
 * file, each round clears them before it starts, and a directory fewer to make and remove per
 * node was measurable in a 1024-node start on one machine. */
static int make_attempt_dir(agent_t *a, int attempt, char *out, size_t len) {
  if (a->base_is_tmp) return snprintf(out, len, "%s", a->base_dir) >= (int)len ? -ENAMETOOLONG : 0;
  if (snprintf(out, len, "%.4000s/attempt_%d", a->base_dir, attempt) >= (int)len) return -ENAMETOOLONG;
  return 0;
}

/* The round's workers run: the hang watch, which several nodes keep together through the
 * workers' store (launcher/hang.h). */
static void watch_hangs(agent_t *a, const workers_round_t *r) {
  hang_share_config_t job = {.secret = r->store_secret, .run_id = r->run_id, .round = r->round,
                             .node = r->group_rank, .nnodes = r->group_world_size};
  snprintf(job.endpoint, sizeof job.endpoint, "%s", r->store_endpoint);
  hang_watch(a->hang, a->wk, &job);
}

/* The workers' view of the assigned round. */
static void round_of(agent_t *a, workers_round_t *out) {
  const rdzv_assignment_t *g = &a->asg;
  /* Two counters: the round names everything of this round (attempt dir, MESHRUN_ROUND) and
   * goes up on every restart; the restart count, torchrun's, only on failures, so a node
   * joining or leaving does not look like a failure to the program. */
  workers_round_t r = {.restart_count = g->failures, .round = g->round, .rank_offset = g->rank_offset, .world_size = g->world_size,
                       .group_rank = g->group_rank, .group_world_size = g->nnodes, .nproc = g->nproc,
                       .master_port = g->master_port, .max_restarts = a->opts->max_restarts,
                       .log_files = a->opts->log_dir[0] != 0};
  snprintf(r.master_addr, sizeof r.master_addr, "%s", g->master_addr);
  /* The workers' store: the rendezvous store (c10d), or the round's first node's (etcd). */
  if (g->store_port > 0) net_format_endpoint(r.store_endpoint, sizeof r.store_endpoint, g->master_addr, g->store_port);
  else snprintf(r.store_endpoint, sizeof r.store_endpoint, "%s", a->store_ep);
  memcpy(r.store_secret, a->opts->secret, sizeof r.store_secret);
  snprintf(r.run_id, sizeof r.run_id, "%s", a->opts->rdzv_id);
  snprintf(r.job_id, sizeof r.job_id, "%.127s@%.300s", a->opts->rdzv_id, a->store_ep);
  make_attempt_dir(a, g->round, r.attempt_dir, sizeof r.attempt_dir);
  snprintf(r.file_prefix, sizeof r.file_prefix, "%s", a->file_prefix);
  *out = r;
}

/* The round's workers start (after the health check, when on). */
static void start_workers(agent_t *a) {
  char err[512];
  a->state = AGENT_RUNNING;
  int wrc = workers_start(a->wk, &a->round, err, sizeof err);
  if (wrc) {
    log_error("starting workers: %s", err);
    agent_exit(a, wrc == -ENOEXEC ? 127 : 1); /* the program cannot run: a shell's "command not found" */
  } else {
    watch_hangs(a, &a->round);
  }
}

static void end_health(agent_t *a) {
  health_stop(a->health);
  a->health = NULL;
}

/* Names the nodes the check found unhealthy; the reason of the round's end (the first node
 * left out) into e. Returns how many it leaves out, or -1 when out of memory. */
static int judge_health(agent_t *a, const health_result_t *res, int n, double dt, rdzv_end_t *e) {
  const launcher_opts_t *o = a->opts;
  health_verdict_t *v = calloc((size_t)n, sizeof *v);
  health_summary_t sum;
  if (!v || health_judge(res, n, o->health_min_fraction, o->nnodes_min, v, &sum) < 0) {
    free(v);
    return -1;
  }
  char link[64] = "", rate[32];
  if (sum.net_median > 0) snprintf(link, sizeof link, ", median link %.0f MB/s", sum.net_median);
  health_flops_text(sum.gemm_median, rate, sizeof rate);
  log_info("health check: round %d, %d node(s) in %.2fs: median GEMM %s on %s%s, %d below %g of a median",
           a->asg.round, n, dt, rate, sum.devices, link, sum.unhealthy, o->health_min_fraction);
  char line[RDZV_MSG_MAX];
  for (int i = 0; i < n; i++) {
    if (v[i] == HEALTH_OK) continue;
    health_line(res, n, i, v[i], &sum, o->health_min_fraction, o->nnodes_min, o->nnodes_max, line, sizeof line);
    log_warn("%s", line);
    if (v[i] == HEALTH_OUT && !e->reason[0]) {
      snprintf(e->reason, sizeof e->reason, "%s", line);
      snprintf(e->host, sizeof e->host, "%s", res[i].host);
    }
  }
  a->health_out = v[a->asg.group_rank] == HEALTH_OUT;
  free(v);
  return sum.left_out;
}

/* The check is over. Every node judged the same results alike: with nobody left out the
 * workers start; otherwise every node asks to end the round (the first claim writes the end,
 * of kind health: no failure counted), the nodes left out leave on that end and the others
 * join the next round without them. A check that could not finish (a peer gone, the store)
 * leaves the round unchecked: the rendezvous sees to dead peers. */
static void on_health(health_t *h, void *arg) {
  agent_t *a = arg;
  const health_result_t *res;
  int n, out = 0;
  double dt;
  char err[512];
  rdzv_end_t e = {.kind = RDZV_END_HEALTH, .exit_code = 1, .rank = -1, .local_rank = -1};
  if (a->state != AGENT_CHECKING) return;
  if (health_results(h, &res, &n, &dt, err, sizeof err))
    log_warn("health check: %s: round %d goes on unchecked", err, a->asg.round);
  else if ((out = judge_health(a, res, n, dt, &e)) < 0)
    log_warn("health check: out of memory: round %d goes on unchecked", a->asg.round);
  end_health(a);
  if (a->have_end) { /* another node's end of the round for the check came first */
    a->state = AGENT_STOPPING;
    round_over(a);
    return;
  }
  if (out <= 0) {
    start_workers(a);
    return;
  }
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  e.time = ts.tv_sec + ts.tv_nsec * 1e-9;
  a->state = AGENT_STOPPING;
  rdzv_end_round(a->rz, &e);
}

/* The round is assigned: --health_check measures the nodes before the workers start. */
static void start_health(agent_t *a) {
  const rdzv_assignment_t *g = &a->asg;
  health_config_t cfg = {.secret = a->round.store_secret, .run_id = a->round.run_id, .round = g->round,
                         .node = g->group_rank, .nnodes = g->nnodes, .nproc = g->nproc,
                         .keep = a->srv && a->opts->rdzv_backend != RDZV_BACKEND_ETCD,
                         .timeout_s = a->opts->heartbeat_timeout_s + HEALTH_SLACK_S};
  char err[512];
  snprintf(cfg.endpoint, sizeof cfg.endpoint, "%s", a->round.store_endpoint);
  snprintf(cfg.addr, sizeof cfg.addr, "%s", a->addr);
  a->state = AGENT_CHECKING;
  a->health_out = 0;
  if (!(a->health = health_start(&a->loop, &cfg, on_health, a, err, sizeof err))) {
    log_warn("health check: %s: round %d goes on unchecked", err, g->round);
    start_workers(a);
  }
}

static void on_rdzv(rdzv_t *rz, const rdzv_event_t *ev, void *arg) {
  agent_t *a = arg;
  if (a->state == AGENT_EXITING) return;
  switch (ev->kind) {
  case RDZV_EV_ASSIGNED: {
    if (a->state != AGENT_JOINING) return;
    uv_timer_stop(&a->join_timer);
    a->asg = ev->assignment;
    const rdzv_assignment_t *g = &a->asg;
    if (a->opts->rdzv_backend == RDZV_BACKEND_ETCD) a->drains = g->serves_store; /* the round's first node */
    log_info("round %d: node %d of %d (group rank %d), ranks %d..%d of %d, master %s:%d, %d failure restart%s so far",
             g->round, g->group_rank, g->nnodes, g->group_rank, g->rank_offset, g->rank_offset + g->nproc - 1,
             g->world_size, g->master_addr, g->master_port, g->failures, g->failures == 1 ? "" : "s");
    round_of(a, &a->round);
    if (a->opts->health_check) start_health(a);
    else start_workers(a);
    break;
  }
  case RDZV_EV_ROUND_END:
    if (a->state == AGENT_CHECKING && ev->end.kind == RDZV_END_HEALTH) {
      /* Another node judged first: every result is in, so this node's own judgement, which
       * says whether it leaves, follows at once (on_health). */
      a->end = ev->end;
      a->have_end = 1;
      return;
    }
    if (a->state == AGENT_CHECKING) {
      log_warn("round %d ended elsewhere (%s) during the health check: %s", a->asg.round,
               rdzv_end_kind_name(ev->end.kind), ev->end.reason);
      end_health(a);
      a->state = AGENT_STOPPING;
    }
    if (a->state == AGENT_RUNNING) {
      log_warn("round %d ended elsewhere (%s): %s; stopping workers", a->asg.round,
               rdzv_end_kind_name(ev->end.kind), ev->end.reason);
      a->state = AGENT_STOPPING;
      hang_unwatch(a->hang);
      workers_stop(a->wk, SIGTERM, a->opts->shutdown_timeout_s, rdzv_end_kind_name(ev->end.kind));
    }
    if (a->state != AGENT_STOPPING) return; /* FINISHING: our work is done */
    a->end = ev->end;
    a->have_end = 1;
    round_over(a);
    break;
  case RDZV_EV_DONE:
    if (a->state == AGENT_FINISHING) agent_exit(a, 0);
    break;
  case RDZV_EV_DRAINED:
    a->drained = 1;
    round_over(a);
    break;
  case RDZV_EV_ERROR:
    log_error("%s", ev->message);
    agent_exit(a, 1);
    break;
  case RDZV_EV_FENCED:
    /* etcd: this node is out of every round. Its workers go (the others have restarted
     * without them, or will), then it joins again as a new member: never on its old round. */
    log_warn("%s; stopping workers and joining again", ev->message);
    if (a->state == AGENT_JOINING) {
      rdzv_join(a->rz);
      return;
    }
    if (a->state == AGENT_CHECKING) {
      end_health(a);
      a->state = AGENT_STOPPING;
    }
    if (a->state == AGENT_RUNNING) {
      a->state = AGENT_STOPPING;
      hang_unwatch(a->hang);
      workers_stop(a->wk, SIGTERM, a->opts->shutdown_timeout_s, "fenced");
    }
    if (a->state != AGENT_STOPPING) return;
    memset(&a->end, 0, sizeof a->end);
    a->end.kind = RDZV_END_DEAD_NODE;
    snprintf(a->end.reason, sizeof a->end.reason, "%s", ev->message);
    a->have_end = 1;
    round_over(a);
    break;
  case RDZV_EV_STORE_LOST:
    /* Whatever the round was doing: without the store there is no next round, no restart and
     * no way to tell the other nodes anything. */
    log_error("error: %s (exit %d)", ev->message, AGENT_EXIT_STORE_LOST);
    agent_exit(a, AGENT_EXIT_STORE_LOST);
    break;
  }
}

static void on_signal(uv_signal_t *h, int sig) {
  agent_t *a = h->data;
  char sbuf[32];
  if (a->lingering && sig != SIGUSR1 && sig != SIGUSR2) {
    /* Told to stop while serving other jobs only: they lose the store, as they would on any
     * node's exit; this job's exit code stays its own. */
    log_warn("got %s: closing the store under %zu connection(s) of other jobs", sig_name(sig, sbuf, sizeof sbuf),
             store_server_num_foreign(a->srv));
    close_store(a);
    return;
  }
  if (sig == SIGUSR1 || sig == SIGUSR2) {
    log_info("forwarding %s to the workers", sig_name(sig, sbuf, sizeof sbuf));
    if (a->wk) workers_signal(a->wk, sig);
    return;
  }
  if (a->shutdown_sig) {
    /* A second INT/TERM/HUP: no more grace. */
    log_warn("%s again: SIGKILL to the workers", sig_name(sig, sbuf, sizeof sbuf));
    workers_kill_all(a->wk);
    return;
  }
  a->shutdown_sig = sig;
  log_warn("got %s: forwarding to the workers, then shutting down (grace %gs)", sig_name(sig, sbuf, sizeof sbuf),
           a->opts->shutdown_timeout_s);
  /* Forward the signal itself (torchrun does the same), SIGKILL after the grace period. */
  if (a->wk) workers_stop(a->wk, sig, a->opts->shutdown_timeout_s, "signal");
  agent_exit(a, 128 + sig);
}

/* The MASTER_ADDR of a loopback job, or NULL when host is not loopback. It stays in the
 * endpoint's family: an IPv6 endpoint may be used on a host whose workers cannot reach
 * 127.0.0.1 the same way. torch takes MASTER_ADDR bare, so "::1" goes without brackets. */
static const char *loopback_addr(const char *h) {
  struct in6_addr a6;
  if (!strncmp(h, "127.", 4) || !strcmp(h, "localhost")) return "127.0.0.1";
  if (inet_pton(AF_INET6, h, &a6) == 1 && IN6_IS_ADDR_LOOPBACK(&a6)) return "::1";
  return NULL;
}

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
  (void)st;
  (void)ftw;
  if (flag == FTW_DP) rmdir(path);
  else unlink(path); /* not remove(), which tries unlink on a directory first */
  return 0;
}

/* $TMPDIR/meshrun-<uid> into out: one directory that every meshrun of this user on this
 * machine shares for its workers' error and stop files (names prefixed per node), made once,
 * private (0700) and checked to be ours before use; -1 when it cannot be had (then a node
 * makes a directory of its own, as before). A directory per node cost a mkdir and an rmdir in
 * $TMPDIR each, under $TMPDIR's lock: in a start of 2048 nodes on one machine, the exits spent
 * a twentieth of their time waiting on it. lstat first: a lookup takes no lock. */
static int shared_tmp_dir(const char *tmp, char *out, size_t len) {
  if (snprintf(out, len, "%s/meshrun-%u", tmp, (unsigned)getuid()) >= (int)len) return -1;
  struct stat st;
  if (lstat(out, &st) && (errno != ENOENT || (mkdir(out, 0700) && errno != EEXIST) || lstat(out, &st))) return -1;
  return S_ISDIR(st.st_mode) && st.st_uid == getuid() && !(st.st_mode & 077) ? 0 : -1;
}

static int setup_base_dir(agent_t *a, char *err, size_t errlen) {
  const launcher_opts_t *o = a->opts;
  if (o->log_dir[0]) {
    /* A folder of this run's own, <run_id>_<random> as torchrun names it: two runs with the
     * same --log_dir (and the default run id) never write into each other's attempt_0. */
    if (mkdir(o->log_dir, 0755) && errno != EEXIST) {
      return err_set(err, errlen, -errno, "--log_dir %.900s: %s", o->log_dir, strerror(errno));
    }
    snprintf(a->base_dir, sizeof a->base_dir, "%s/%s_XXXXXX", o->log_dir, o->rdzv_id);
    if (!mkdtemp(a->base_dir)) {
      return err_set(err, errlen, -errno, "--log_dir: creating %.900s: %s", a->base_dir, strerror(errno));
    }
    chmod(a->base_dir, 0755); /* mkdtemp's 0700 would hide the logs from the user's group */
    log_info("worker logs: %s", a->base_dir);
    return 0;
  }
  const char *tmp = getenv("TMPDIR");
  tmp = tmp && *tmp ? tmp : "/tmp";
  /* Redirected or teed streams without --log_dir live in a directory of the node's own. */
  int any = o->redirects || o->tee;
  for (int i = 0; i < CLI_MAX_LOCAL_RANKS; i++) any |= o->redirects_per_rank[i] > 0 || o->tee_per_rank[i] > 0;
  uint32_t tag = 0;
  if (!any && shared_tmp_dir(tmp, a->base_dir, sizeof a->base_dir) == 0 &&
      getrandom(&tag, sizeof tag, 0) == (ssize_t)sizeof tag) {
    snprintf(a->file_prefix, sizeof a->file_prefix, "%.120s-%d-%08x-", o->rdzv_id, (int)getpid(), tag);
    a->base_is_tmp = a->base_shared = 1;
    return 0;
  }
  snprintf(a->base_dir, sizeof a->base_dir, "%s/meshrun-%s-XXXXXX", tmp, o->rdzv_id);
  if (!mkdtemp(a->base_dir)) {
    return err_set(err, errlen, -errno, "creating a temporary directory %.900s: %s", a->base_dir, strerror(errno));
  }
  a->base_is_tmp = 1;
  /* Keep the logs, and say where. */
  if (any) {
    log_info("worker logs (no --log_dir given): %s", a->base_dir);
    a->base_is_tmp = 0;
  }
  return 0;
}
/* The job's secret. cli read the user's (token file or MESHRUN_RDZV_TOKEN). A single-node job
 * without one gets a random one: nobody outside this process tree needs it, and its workers
 * get it in their environment. A multi-node job without one runs an open store: said once. */
static int prepare_secret(agent_t *a, char *err, size_t errlen) {
  launcher_opts_t *o = a->opts;
  if (o->secret_source == CLI_SECRET_FILE && (o->token_file_mode & 077))
    log_warn("warning: --rdzv_conf token_file=%s is accessible by group or others (mode %04o); chmod 600 it",
             o->token_file, o->token_file_mode);
  if (o->secret[0]) return 0;
  if (o->nnodes_max > 1 && o->rdzv_backend == RDZV_BACKEND_ETCD) {
    log_warn("warning: no job secret: the stores the nodes serve their workers (MESHRUN_STORE) are open: any program "
             "that reaches their ports can read and change this job's keys; set --rdzv_conf=token_file=PATH or "
             STORE_ENV_SECRET);
    return 0;
  }
  if (o->nnodes_max > 1) {
    char ep[300];
    net_format_endpoint(ep, sizeof ep, o->rdzv_host, o->rdzv_port);
    log_warn("warning: the rendezvous store at %s is open: any program that reaches the port can read and change "
             "this job's keys; set --rdzv_conf=token_file=PATH or " STORE_ENV_SECRET,
             ep);
    return 0;
  }
  unsigned char raw[32];
  if (getrandom(raw, sizeof raw, 0) != (ssize_t)sizeof raw) { /* 32 bytes: never cut short */
    return err_set(err, errlen, -EIO, "generating the job secret: the system's random source failed");
  }
  static const char hex[] = "0123456789abcdef";
  for (size_t i = 0; i < sizeof raw; i++) {
    o->secret[2 * i] = hex[raw[i] >> 4];
    o->secret[2 * i + 1] = hex[raw[i] & 15];
  }
  o->secret[2 * sizeof raw] = '\0';
  o->secret_source = CLI_SECRET_GENERATED;
  return 0;
}

/* The address peers dial for MASTER_ADDR (and this node's store, with etcd), and that names
 * this node in messages: loopback jobs stay on loopback; otherwise --master_addr when given,
 * else this machine's address on the route to the rendezvous endpoint (the store, or etcd's
 * first member: peers reach it there, so they reach us on that network; the hostname may not
 * resolve for them, or be the same on every container or namespace), else its hostname. */
static void node_address(const launcher_opts_t *o, char *out, size_t len) {
  const char *lo = loopback_addr(o->rdzv_host);
  if (lo) snprintf(out, len, "%s", lo);
  else if (o->master_addr[0]) snprintf(out, len, "%s", o->master_addr);
  else if (net_local_addr_toward(o->rdzv_host, o->rdzv_port, out, len)) net_hostname(out, len);
}

/* What the store keeps free of the file limit for this agent: measured, 16 descriptors with one
 * worker, 24 with four, 32 with eight (pipes, listeners, libuv's, the store clients), a restart
 * adding up to 5 for a moment; twice that and more. */
#define FD_RESERVE_BASE 64
#define FD_RESERVE_PER_WORKER 8
/* Store connections of one node: its agent's (a command and a watch connection) and one per
 * worker (the trainer's), doubled, since a restart's new connections can arrive before the
 * old ones' close is seen and a program may open a second one; plus HOST_MARGIN per host. */
#define NODE_STORE_CONNS(nproc) (2 * ((size_t)(nproc) + 2))
#define HOST_MARGIN 64

/* The store this node serves: this job's, with its secret and deadlines, and room for the job:
 * one host may hold as many connections as the whole job makes (every node may run on one
 * host), so that a host holding the secret, or a client leaking connections, takes no more
 * than that, and the agent's own descriptors stay free. */
static store_server_opts_t server_opts(const launcher_opts_t *o) {
  return (store_server_opts_t){.run_id = o->rdzv_id, .secret = o->secret,
                               .handshake_ms = (int)(o->handshake_timeout_s * 1000),
                               .frame_ms = (int)(o->frame_timeout_s * 1000),
                               .fd_reserve = FD_RESERVE_BASE + FD_RESERVE_PER_WORKER * (size_t)o->nproc_per_node,
                               .max_conns_per_host =
                                   (size_t)o->nnodes_max * NODE_STORE_CONNS(o->nproc_per_node) + HOST_MARGIN};
}

/* Serves the store at the rendezvous endpoint, or leaves it to whoever does. A probe comes
 * first: when a store of this job already answers there (every node but the first), this node
 * joins it through the probe's connection (a->probe, taken over by rdzv) without trying to
 * bind; a failed bind walks every socket on the port, thousands with thousands of nodes. The
 * probe shakes hands as this job: a store that refuses our secret is another job's, and
 * rendezvous there can never succeed (*refused = 1, the reason in err). Anyone else answering,
 * or nobody in PROBE_MS, makes this node a client too (rdzv connects until join_timeout and
 * names what it finds). Refused: nobody listens, so this node binds. EADDRINUSE alone does not
 * mean another node hosts it: the port can be the source port of some outgoing connection for
 * a moment, with nobody listening, or another node bound it and is not listening yet. So the
 * probe and the bind are tried again, for up to HOST_RETRY_S; then this node is a client. An
 * address that is not this host's (EADDRNOTAVAIL) makes it a client at once. Returns 0 when
 * this node serves the store, else why not (err says it). */
#define HOST_RETRY_S 5.0
#define PROBE_MS 50
static int host_or_join(agent_t *a, int *refused, char *err, size_t errlen) {
  const launcher_opts_t *o = a->opts;
  store_server_opts_t so = server_opts(o);
  store_auth_t auth = {.run_id = o->rdzv_id, .secret = o->secret};
  uint64_t start = uv_hrtime();
  int64_t nap_ms = 5;
  *refused = 0;
  if (o->rdzv_port == 0) /* --standalone: a port of its own */
    return store_server_start(&a->srv, &a->loop, o->rdzv_host, 0, &so, &a->store_port, err, errlen);
  for (;;) {
    store_t *probe = NULL;
    int prc = store_connect_once(&probe, o->rdzv_host, o->rdzv_port, &auth, PROBE_MS, err, errlen);
    if (prc == 0) {
      a->probe = probe; /* a store of this job listens there: rdzv joins through this connection */
      return err_set(err, errlen, STORE_SERVER_EADDRINUSE, "a store of this job serves the endpoint");
    }
    store_close(probe);
    if (prc == STORE_EAUTH) {
      *refused = 1;
      return STORE_SERVER_EADDRINUSE;
    }
    if (prc != STORE_ECONNECT) return STORE_SERVER_EADDRINUSE; /* someone else answers, or nobody in time */
    int rc = store_server_start(&a->srv, &a->loop, o->rdzv_host, o->rdzv_port, &so, &a->store_port, err, errlen);
    if (rc != STORE_SERVER_EADDRINUSE) return rc; /* serving, or the address is not this host's */
    if ((double)(uv_hrtime() - start) / 1e9 >= HOST_RETRY_S) return rc;
    if (nap_ms == 5)
      log_debug("%s port %d is taken but nobody listens there: retrying the bind", o->rdzv_endpoint_from,
                o->rdzv_port);
    struct timespec ts = {.tv_sec = 0, .tv_nsec = nap_ms * 1000000};
    nanosleep(&ts, NULL);
    if (nap_ms < 100) nap_ms *= 2;
  }
}

/* The handles that live on the loop from the start: the join and linger timers, and the signals
 * forwarded to the workers. */
static void init_handles(agent_t *a) {
  uv_timer_init(&a->loop, &a->join_timer);
  a->join_timer.data = a;
  uv_timer_init(&a->loop, &a->linger_timer);
  a->linger_timer.data = a;
  for (int i = 0; i < NFORWARDED; i++) {
    uv_signal_init(&a->loop, &a->sigs[i]);
    a->sigs[i].data = a;
    uv_signal_start(&a->sigs[i], on_signal, FORWARDED[i]);
  }
}

/* Host the store when this node can bind the endpoint; otherwise be a client of whoever does.
 * A port taken by something else is found out on the first request (rdzv). With etcd, every
 * node serves a store of its own on a free port, for its workers' rounds when it is a round's
 * first node. This node's address goes into addr. Returns 0, or 1 after logging why not. */
static int start_store(agent_t *a, char *addr, size_t addrlen) {
  const launcher_opts_t *o = a->opts;
  char err[1024];
  int rc;
  snprintf(a->store_host, sizeof a->store_host, "%s", o->rdzv_host);
  int refused = 0, etcd = o->rdzv_backend == RDZV_BACKEND_ETCD;
  node_address(o, addr, addrlen);
  if (etcd) {
    store_server_opts_t so = server_opts(o);
    if ((rc = store_server_start(&a->srv, &a->loop, addr, 0, &so, &a->store_port, err, sizeof err))) {
      log_error("serving this node's store on %s: %s", addr, err);
      return 1;
    }
    snprintf(a->store_host, sizeof a->store_host, "%s", addr);
  } else {
    rc = host_or_join(a, &refused, err, sizeof err);
  }
  if (etcd) {
    log_debug("rendezvous in etcd at %s; this node's store on port %d", o->rdzv_endpoints, a->store_port);
  } else if (refused) {
    /* err names the endpoint and the job that owns it (store_connect's message). */
    log_error("error: not joining: %s; give both jobs the same secret to share the port, or use another "
              "endpoint than %s",
              err, o->rdzv_endpoint_from);
    return 1;
  }
  if (rc == 0) {
    log_debug("serving the rendezvous store on port %d", a->store_port);
  } else if (o->rdzv_port == 0) {
    log_error("--standalone: cannot start the store: %s", err);
    return 1;
  } else {
    log_debug("not hosting the store (%s): connecting as a client", err);
    a->srv = NULL;
    a->store_port = o->rdzv_port;
  }
  if (etcd) snprintf(a->store_ep, sizeof a->store_ep, "%.200s (etcd)", o->rdzv_endpoints);
  else net_format_endpoint(a->store_ep, sizeof a->store_ep, a->store_host, a->store_port);
  return 0;
}

/* The rendezvous, configured from the options and the store start_store settled on; it takes
 * over the probe's connection. */
static int start_rdzv(agent_t *a, const char *addr, char *err, size_t errlen) {
  const launcher_opts_t *o = a->opts;
  int etcd = o->rdzv_backend == RDZV_BACKEND_ETCD;
  a->drains = a->srv && !etcd;
  rdzv_config_t cfg = {.kv = etcd ? RDZV_KV_ETCD : RDZV_KV_C10D, .store_port = a->store_port,
                       .node_store_port = etcd ? a->store_port : 0, .nnodes_min = o->nnodes_min, .nnodes_max = o->nnodes_max,
                       .node_rank = o->node_rank, .nproc = o->nproc_per_node, .join_timeout_s = o->join_timeout_s,
                       .last_call_timeout_s = o->last_call_timeout_s, .close_timeout_s = o->close_timeout_s,
                       .heartbeat_interval_s = o->heartbeat_interval_s,
                       .heartbeat_timeout_s = o->heartbeat_timeout_s, .max_restarts = o->max_restarts,
                       .master_port = o->worker_master_port, .is_store_host = a->drains, .conn = a->probe,
                       .handshake_ms = (int)(o->handshake_timeout_s * 1000),
                       .progress_interval_s = o->progress_interval_s};
  a->probe = NULL; /* rdzv_create's now */
  _Static_assert(sizeof o->secret <= sizeof cfg.secret, "rdzv must hold any secret cli accepts");
  memcpy(cfg.secret, o->secret, sizeof o->secret);
  snprintf(cfg.store_host, sizeof cfg.store_host, "%s", a->store_host);
  snprintf(cfg.etcd_endpoints, sizeof cfg.etcd_endpoints, "%s", o->rdzv_endpoints);
  snprintf(cfg.run_id, sizeof cfg.run_id, "%s", o->rdzv_id);
  snprintf(cfg.endpoint_from, sizeof cfg.endpoint_from, "%s", o->rdzv_endpoint_from);
  snprintf(cfg.addr, sizeof cfg.addr, "%s", addr);
  return rdzv_create(&a->rz, &a->loop, &cfg, on_rdzv, a, err, errlen);
}

/* After the loop has run dry: the files of this run, rdzv, the workers, the loop and the agent.
 * Returns code, or does not return when a rendezvous thread outlives rdzv_destroy. */
static int finish(agent_t *a, int code) {
  store_close(a->probe);
  a->probe = NULL;
  if (a->base_shared && a->wk) workers_remove_files(a->wk);
  else if (a->base_is_tmp) nftw(a->base_dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
  /* rdzv's threads are interrupted and joined. One still inside a connect attempt after
   * RDZV_JOIN_WAIT_MS keeps rdzv, the loop and the agent (it may still touch them) until the
   * process exits, which ends it: neither is torn down under it. Nor is anything else: the
   * process ends with _exit, since exit's handlers would free what that thread may be using
   * (a store handshake crashed on a library's freed lock in 2 of 1024 nodes of a 1024-node
   * start, whose store evicted slow handshakes, when meshrun used OpenSSL). */
  if (rdzv_destroy(a->rz, RDZV_JOIN_WAIT_MS)) {
    log_debug("rendezvous thread still connecting at exit; left to the process exit");
    fflush(stdout);
    fflush(stderr);
    _exit(code);
  }
  workers_destroy(a->wk);
  if (uv_loop_close(&a->loop)) log_debug("event loop: handles still open at exit");
  else free(a);
  return code;
}

int agent_run(launcher_opts_t *o) {
  agent_t *a = calloc(1, sizeof *a);
  char err[1024];
  int rc;
  if (!a) {
    log_error("out of memory");
    return 1;
  }
  a->opts = o;
  if ((rc = uv_loop_init(&a->loop))) {
    log_error("event loop: %s", uv_strerror(rc));
    free(a);
    return 1;
  }
  init_handles(a);
  if (o->hang_timeout_s > 0 && !(a->hang = hang_create(&a->loop, o->hang_timeout_s, on_hang, a))) {
    log_error("out of memory");
    goto out;
  }
  /* Before any thread and any socket: its guard is a copy of this process (launcher/tree), and
   * meshrun's move into its cgroup then overlaps the rest of the start. */
  if (workers_create(&a->wk, &a->loop, o, on_worker_exit, on_workers_idle, a, err, sizeof err)) {
    log_error("%s", err);
    goto out;
  }
  /* The store holds a connection per worker and per peer node: the soft file limit (often
   * 1024) is too tight for big jobs and for weathering idle connections from strangers. */
  long nofile = store_server_raise_nofile();
  log_debug("open file limit: %ld", nofile);
  if (prepare_secret(a, err, sizeof err)) {
    log_error("%s", err);
    goto out;
  }
  char *addr = a->addr;
  if (start_store(a, addr, sizeof a->addr)) goto out;
  if (setup_base_dir(a, err, sizeof err)) {
    log_error("%s", err);
    goto out;
  }
  if (start_rdzv(a, addr, err, sizeof err)) {
    log_error("%s", err);
    goto out;
  }
  start_join(a);
  arm_join_timer(a);
  uv_run(&a->loop, UV_RUN_DEFAULT);
  return finish(a, a->exit_code);
out:
  agent_exit(a, 1);
  uv_run(&a->loop, UV_RUN_DEFAULT);
  return finish(a, 1);
}
