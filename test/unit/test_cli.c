// deps: launcher/cli.c launcher/cli_slurm.c launcher/cli_probe.c launcher/cli_help.c common/gpus_cuda.c common/net.c common/err.c common/fs.c common/log.c
/* test_cli: meshrun's command line (launcher/cli.c).
 *
 * Every value flag is parsed in four ways (underscore/dash spelling x "--flag=v"/"--flag v")
 * and the field it sets is checked; every error path is checked to return CLI_EUSAGE with a
 * one-line message that starts with the flag it blames and says what was expected. The
 * --nproc_per_node=auto counting is tested against a fake /dev with nvidiaN files (common/gpus.h,
 * the count the trainer makes too) and, for CPUs, in a child process whose affinity is narrowed
 * to one CPU. The job secret: token_file (read,
 * stripped, checked; it wins over MESHRUN_RDZV_TOKEN) and every way such a file is unusable.
 * The environment's share: PET_<FLAG> for every flag (the command line wins; a bad value names
 * the variable), Slurm's hostlist expansion, the options derived from Slurm's variables, and
 * which PROGRAMs run under Python. Those variables are cleared at start and each test sets and
 * clears its own, so the caller's environment (a Slurm job, a Kubeflow pod) changes nothing.
 * Nothing here touches the network. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/gpus.h"
#include "common/store.h"
#include "launcher/agent.h"
#include "launcher/cli.h"
#include "launcher/errfile.h"

#define MAX_ARGS 32

typedef struct {
  char *argv[MAX_ARGS + 1];
  int argc;
  char err[512];
  launcher_opts_t o;
} run_t;

/* Parses "meshrun" followed by the NULL-terminated list of arguments. argv stays alive in the
 * run_t, so prog_argv can be checked afterwards. */
static int run_list(run_t *r, const char *const *args) {
  memset(r, 0, sizeof *r);
  r->argv[r->argc++] = (char *)"meshrun";
  for (; *args; args++) {
    assert_true(r->argc < MAX_ARGS);
    r->argv[r->argc++] = (char *)*args;
  }
  r->argv[r->argc] = NULL;
  return cli_parse(&r->o, r->argc, r->argv, r->err, sizeof r->err);
}

#define RUN(r, ...) run_list((r), (const char *const[]){__VA_ARGS__, NULL})

static void expect_ok(const run_t *r, int rc) {
  if (rc != 0) print_error("unexpected failure rc=%d: %s\n", rc, r->err);
  assert_int_equal(rc, 0);
  assert_string_equal(r->err, "");
}

/* The error names `flag` first ("meshrun: --flag: ..."), says what was expected, one line. */
static void expect_usage(const run_t *r, int rc, const char *flag) {
  char prefix[96];
  snprintf(prefix, sizeof prefix, "meshrun: %s:", flag);
  if (rc != CLI_EUSAGE || strncmp(r->err, prefix, strlen(prefix)) != 0)
    print_error("args:%s%s%s%s%s -> rc=%d err=\"%s\", wanted \"%s ...\"\n",
                r->argc > 1 ? " " : "", r->argc > 1 ? r->argv[1] : "",
                r->argc > 2 ? " " : "", r->argc > 2 ? r->argv[2] : "",
                r->argc > 3 ? " ..." : "", rc, r->err, prefix);
  assert_int_equal(rc, CLI_EUSAGE);
  assert_memory_equal(r->err, prefix, strlen(prefix));
  assert_non_null(strstr(r->err, "expected"));
  assert_null(strchr(r->err, '\n'));
}

/* ---- defaults ---- */

static void test_defaults_struct(void **state) {
  launcher_opts_t o;
  memset(&o, 0x5a, sizeof o);
  cli_defaults(&o);
  assert_int_equal(o.nproc_per_node, 1);
  assert_int_equal(o.nnodes_min, 1);
  assert_int_equal(o.nnodes_max, 1);
  assert_int_equal(o.node_rank, -1);
  assert_int_equal(o.rdzv_backend, RDZV_BACKEND_C10D);
  assert_string_equal(o.rdzv_host, "");
  assert_int_equal(o.rdzv_port, 29400);
  assert_string_equal(o.rdzv_id, "none");
  assert_true(o.join_timeout_s == 600);
  assert_true(o.last_call_timeout_s == 30);
  assert_true(o.close_timeout_s == 60);
  assert_true(o.heartbeat_interval_s == 1);
  assert_true(o.heartbeat_timeout_s == 5);
  assert_int_equal(o.standalone, 0);
  assert_string_equal(o.master_addr, "");
  assert_int_equal(o.master_port, 0);
  assert_int_equal(o.max_restarts, 0);
  assert_true(o.monitor_interval_s == 0.1);
  assert_int_equal(o.redirects, 0);
  assert_int_equal(o.tee, 0);
  for (int i = 0; i < CLI_MAX_LOCAL_RANKS; i++) {
    assert_int_equal(o.redirects_per_rank[i], -1);
    assert_int_equal(o.tee_per_rank[i], -1);
    assert_int_equal(o.local_ranks_filter[i], 1);
  }
  assert_int_equal(o.local_ranks_filter_set, 0);
  assert_int_equal(o.merge_output, CLI_MERGE_AUTO);
  assert_string_equal(o.log_dir, "");
  assert_true(o.shutdown_timeout_s == 30);
  assert_string_equal(o.role, "default");
  assert_int_equal(o.no_python, 0);
  assert_int_equal(o.run_module, 0);
  assert_null(o.program);
  assert_null(o.prog_argv);
  assert_int_equal(o.prog_argc, 0);
}

/* "meshrun prog" alone: one worker, one node, c10d standalone on 127.0.0.1 with a free port. */
static void test_defaults_parsed(void **state) {
  run_t r;
  expect_ok(&r, RUN(&r, "prog"));
  assert_int_equal(r.o.nproc_per_node, 1);
  assert_int_equal(r.o.nnodes_min, 1);
  assert_int_equal(r.o.nnodes_max, 1);
  assert_int_equal(r.o.node_rank, -1);
  assert_int_equal(r.o.rdzv_backend, RDZV_BACKEND_C10D);
  assert_int_equal(r.o.standalone, 1);
  assert_string_equal(r.o.rdzv_host, "127.0.0.1");
  assert_int_equal(r.o.rdzv_port, 0);
  assert_string_equal(r.o.rdzv_id, "none");
  assert_string_equal(r.o.role, "default");
  assert_int_equal(r.o.max_restarts, 0);
  assert_string_equal(r.o.program, "prog");
  assert_int_equal(r.o.prog_argc, 1);
  assert_ptr_equal(r.o.prog_argv, &r.argv[1]);
  assert_null(r.o.prog_argv[1]);
}

/* ---- every value flag, four ways ---- */

typedef struct {
  const char *flag; /* canonical, underscores */
  const char *value;
  const char *extra[6]; /* other flags the case needs to be valid, before it */
  void (*check)(const launcher_opts_t *o);
} flag_case_t;

static void chk_nproc(const launcher_opts_t *o) { assert_int_equal(o->nproc_per_node, 4); }
static void chk_nnodes(const launcher_opts_t *o) {
  assert_int_equal(o->nnodes_min, 2);
  assert_int_equal(o->nnodes_max, 4);
  assert_int_equal(o->standalone, 0);
}
static void chk_nnodes_single(const launcher_opts_t *o) {
  assert_int_equal(o->nnodes_min, 3);
  assert_int_equal(o->nnodes_max, 3);
}
static void chk_node_rank(const launcher_opts_t *o) { assert_int_equal(o->node_rank, 1); }
static void chk_endpoint_v6(const launcher_opts_t *o) {
  assert_string_equal(o->rdzv_host, "::1");
  assert_int_equal(o->rdzv_port, 29401);
  assert_int_equal(o->standalone, 0);
}
static void chk_endpoint_v4(const launcher_opts_t *o) {
  assert_string_equal(o->rdzv_host, "10.1.2.3");
  assert_int_equal(o->rdzv_port, 1234);
}
static void chk_endpoint_name(const launcher_opts_t *o) {
  assert_string_equal(o->rdzv_host, "node0.example");
  assert_int_equal(o->rdzv_port, 29400);
}
static void chk_endpoint_bare_v6(const launcher_opts_t *o) {
  assert_string_equal(o->rdzv_host, "fe80::2");
  assert_int_equal(o->rdzv_port, 29400);
}
static void chk_rdzv_id(const launcher_opts_t *o) { assert_string_equal(o->rdzv_id, "job-42"); }
static void chk_backend_static(const launcher_opts_t *o) {
  assert_int_equal(o->rdzv_backend, RDZV_BACKEND_STATIC);
  assert_int_equal(o->node_rank, 0); /* one node: rank 0 implied */
  assert_string_equal(o->rdzv_host, "127.0.0.1");
  assert_int_equal(o->rdzv_port, 0);
  assert_int_equal(o->standalone, 0);
}
static void chk_backend_c10d(const launcher_opts_t *o) {
  assert_int_equal(o->rdzv_backend, RDZV_BACKEND_C10D);
  assert_string_equal(o->rdzv_host, "h");
}
/* etcd: the member list kept as given; the first member (etcd's port by default) is the one a
 * node finds its own address toward. */
static void chk_backend_etcd(const launcher_opts_t *o) {
  assert_int_equal(o->rdzv_backend, RDZV_BACKEND_ETCD);
  assert_string_equal(o->rdzv_endpoints, "e1,[::1]:2380,e3:2381");
  assert_string_equal(o->rdzv_host, "e1");
  assert_int_equal(o->rdzv_port, CLI_ETCD_PORT);
  assert_int_equal(o->standalone, 0);
}
static void chk_conf(const launcher_opts_t *o) {
  assert_true(o->join_timeout_s == 12.5);
  assert_true(o->last_call_timeout_s == 0);
  assert_true(o->close_timeout_s == 7);
  assert_true(o->heartbeat_interval_s == 0.25);
  assert_true(o->heartbeat_timeout_s == 3);
}
static void chk_master_addr(const launcher_opts_t *o) {
  assert_string_equal(o->master_addr, "10.0.0.1");
  assert_string_equal(o->rdzv_host, "10.0.0.1"); /* static without endpoint: store on master */
  assert_int_equal(o->rdzv_port, 29500);
}
static void chk_master_addr_v6(const launcher_opts_t *o) {
  assert_string_equal(o->master_addr, "::1");
}
/* one node: the port is the workers' MASTER_PORT; the store takes a free one (port 0) */
static void chk_master_port(const launcher_opts_t *o) {
  assert_int_equal(o->master_port, 1234);
  assert_string_equal(o->rdzv_host, "h");
  assert_int_equal(o->rdzv_port, 0);
  assert_int_equal(o->worker_master_port, 1234);
}
static void chk_max_restarts(const launcher_opts_t *o) { assert_int_equal(o->max_restarts, 3); }
static void chk_monitor(const launcher_opts_t *o) { assert_true(o->monitor_interval_s == 0.5); }
static void chk_redirects_all(const launcher_opts_t *o) {
  assert_int_equal(o->redirects, 3);
  for (int i = 0; i < CLI_MAX_LOCAL_RANKS; i++) assert_int_equal(o->redirects_per_rank[i], -1);
}
static void chk_redirects_map(const launcher_opts_t *o) {
  assert_int_equal(o->redirects, 0);
  assert_int_equal(o->redirects_per_rank[0], 1);
  assert_int_equal(o->redirects_per_rank[1], 2);
  assert_int_equal(o->redirects_per_rank[2], -1);
}
static void chk_tee_all(const launcher_opts_t *o) {
  assert_int_equal(o->tee, 2);
  assert_int_equal(o->redirects, 0);
}
static void chk_tee_map(const launcher_opts_t *o) {
  assert_int_equal(o->tee, 0);
  assert_int_equal(o->tee_per_rank[0], -1);
  assert_int_equal(o->tee_per_rank[1], 3);
  assert_int_equal(o->tee_per_rank[2], 0);
}
static void chk_log_dir(const launcher_opts_t *o) { assert_string_equal(o->log_dir, "/tmp/logs x"); }
static void chk_filter(const launcher_opts_t *o) {
  assert_int_equal(o->local_ranks_filter_set, 1);
  assert_int_equal(o->local_ranks_filter[0], 1);
  assert_int_equal(o->local_ranks_filter[1], 0);
  assert_int_equal(o->local_ranks_filter[2], 1);
  assert_int_equal(o->local_ranks_filter[3], 0);
}
static void chk_filter_empty(const launcher_opts_t *o) {
  assert_int_equal(o->local_ranks_filter_set, 0);
  for (int i = 0; i < CLI_MAX_LOCAL_RANKS; i++) assert_int_equal(o->local_ranks_filter[i], 1);
}
static void chk_merge_off(const launcher_opts_t *o) { assert_int_equal(o->merge_output, CLI_MERGE_OFF); }
static void chk_merge_on(const launcher_opts_t *o) { assert_int_equal(o->merge_output, CLI_MERGE_ON); }
static void chk_merge_auto(const launcher_opts_t *o) { assert_int_equal(o->merge_output, CLI_MERGE_AUTO); }
static void chk_role(const launcher_opts_t *o) { assert_string_equal(o->role, "trainer"); }
static void chk_shutdown(const launcher_opts_t *o) { assert_true(o->shutdown_timeout_s == 2.5); }

static const flag_case_t flag_cases[] = {
    {"nproc_per_node", "4", {NULL}, chk_nproc},
    {"nnodes", "2:4", {"--rdzv_endpoint=h:1"}, chk_nnodes},
    {"nnodes", "3", {"--rdzv_endpoint=h"}, chk_nnodes_single},
    {"node_rank", "1", {"--nnodes=2", "--rdzv_endpoint=h"}, chk_node_rank},
    {"rdzv_endpoint", "[::1]:29401", {NULL}, chk_endpoint_v6},
    {"rdzv_endpoint", "10.1.2.3:1234", {NULL}, chk_endpoint_v4},
    {"rdzv_endpoint", "node0.example", {NULL}, chk_endpoint_name},
    {"rdzv_endpoint", "fe80::2", {NULL}, chk_endpoint_bare_v6},
    {"rdzv_id", "job-42", {NULL}, chk_rdzv_id},
    {"run_id", "job-42", {NULL}, chk_rdzv_id},
    {"rdzv_backend", "static", {NULL}, chk_backend_static},
    {"rdzv_backend", "c10d", {"--rdzv_endpoint=h"}, chk_backend_c10d},
    {"rdzv_backend", "etcd", {"--nnodes=2", "--rdzv_endpoint=e1,[::1]:2380,e3:2381"}, chk_backend_etcd},
    {"rdzv_backend", "etcd-v2", {"--rdzv_endpoint=e1,[::1]:2380,e3:2381"}, chk_backend_etcd},
    {"rdzv_conf",
     "join_timeout=12.5,last_call_timeout=0,close_timeout=7,heartbeat_interval=0.25,"
     "heartbeat_timeout=3",
     {NULL},
     chk_conf},
    {"master_addr", "10.0.0.1", {"--rdzv_backend=static", "--nnodes=2", "--node_rank=1"},
     chk_master_addr},
    {"master_addr", "[::1]", {NULL}, chk_master_addr_v6},
    {"master_addr", "::1", {NULL}, chk_master_addr_v6},
    {"master_port", "1234", {"--rdzv_backend", "static", "--master_addr", "h"}, chk_master_port},
    {"max_restarts", "3", {NULL}, chk_max_restarts},
    {"monitor_interval", "0.5", {NULL}, chk_monitor},
    {"redirects", "3", {NULL}, chk_redirects_all},
    {"redirects", "0:1,1:2", {"--nproc_per_node=3"}, chk_redirects_map},
    {"tee", "2", {NULL}, chk_tee_all},
    {"tee", "1:3,2:0", {"--nproc_per_node=3"}, chk_tee_map},
    {"log_dir", "/tmp/logs x", {NULL}, chk_log_dir},
    {"local_ranks_filter", "0,2", {"--nproc_per_node=4"}, chk_filter},
    {"local_ranks_filter", "", {NULL}, chk_filter_empty},
    {"merge_output", "off", {NULL}, chk_merge_off},
    {"merge_output", "on", {NULL}, chk_merge_on},
    {"merge_output", "auto", {"--merge_output=off"}, chk_merge_auto},
    {"role", "trainer", {NULL}, chk_role},
    {"shutdown_timeout", "2.5", {NULL}, chk_shutdown},
};

static void test_value_flags_four_ways(void **state) {
  for (size_t c = 0; c < sizeof flag_cases / sizeof flag_cases[0]; c++) {
    const flag_case_t *fc = &flag_cases[c];
    for (int dash = 0; dash < 2; dash++) {
      for (int joined = 0; joined < 2; joined++) {
        char name[64], joined_arg[512];
        snprintf(name, sizeof name, "--%s", fc->flag);
        if (dash)
          for (char *p = name + 2; *p; p++)
            if (*p == '_') *p = '-';
        snprintf(joined_arg, sizeof joined_arg, "%s=%s", name, fc->value);

        const char *args[MAX_ARGS];
        int n = 0;
        for (int k = 0; k < 6 && fc->extra[k]; k++) args[n++] = fc->extra[k];
        if (joined) {
          args[n++] = joined_arg;
        } else {
          args[n++] = name;
          args[n++] = fc->value;
        }
        args[n++] = "prog";
        args[n++] = "a1";
        args[n] = NULL;

        run_t r;
        int rc = run_list(&r, args);
        if (rc != 0)
          print_error("case %s=\"%s\" (%s, %s): %s\n", fc->flag, fc->value,
                      dash ? "dashes" : "underscores", joined ? "--f=v" : "--f v", r.err);
        expect_ok(&r, rc);
        fc->check(&r.o);
        assert_string_equal(r.o.program, "prog");
        assert_int_equal(r.o.prog_argc, 2);
        assert_string_equal(r.o.prog_argv[1], "a1");
      }
    }
  }
}

static void test_boolean_flags(void **state) {
  run_t r;
  expect_ok(&r, RUN(&r, "--standalone", "prog"));
  assert_int_equal(r.o.standalone, 1);
  assert_string_equal(r.o.rdzv_host, "127.0.0.1");
  assert_int_equal(r.o.rdzv_port, 0);
  expect_ok(&r, RUN(&r, "--standalone", "--nnodes=1", "--rdzv_backend=c10d", "prog"));
  assert_int_equal(r.o.standalone, 1);

  expect_ok(&r, RUN(&r, "--no_python", "prog"));
  assert_int_equal(r.o.no_python, 1);
  expect_ok(&r, RUN(&r, "--no-python", "prog"));
  assert_int_equal(r.o.no_python, 1);

  expect_ok(&r, RUN(&r, "--module", "pkg.mod", "x"));
  assert_int_equal(r.o.run_module, 1);
  assert_string_equal(r.o.prog_argv[0], "pkg.mod");
  assert_string_equal(r.o.program, CLI_PYTHON); /* what is exec'd: python3 -u -m pkg.mod x */
  expect_ok(&r, RUN(&r, "-m", "pkg.mod"));
  assert_int_equal(r.o.run_module, 1);
  assert_int_equal(r.o.prog_argc, 1);
}

static void test_short_forms(void **state) {
  run_t r;
  const char *forms[][2] = {{"-r", "3"}, {"-r3", NULL}, {"-r=3", NULL}};
  for (size_t i = 0; i < 3; i++) {
    int rc = forms[i][1] ? RUN(&r, forms[i][0], forms[i][1], "prog") : RUN(&r, forms[i][0], "prog");
    expect_ok(&r, rc);
    assert_int_equal(r.o.redirects, 3);
  }
  expect_ok(&r, RUN(&r, "--nproc_per_node=2", "-t", "0:1,1:2", "prog"));
  assert_int_equal(r.o.tee_per_rank[0], 1);
  assert_int_equal(r.o.tee_per_rank[1], 2);
  expect_ok(&r, RUN(&r, "-t1", "prog"));
  assert_int_equal(r.o.tee, 1);
}

static void test_help_version(void **state) {
  run_t r;
  assert_int_equal(RUN(&r, "--help"), CLI_HELP);
  assert_int_equal(RUN(&r, "-h"), CLI_HELP);
  assert_int_equal(RUN(&r, "--nproc_per_node=2", "--help", "prog"), CLI_HELP);
  assert_int_equal(RUN(&r, "--version"), CLI_VERSION);
  /* After PROGRAM, --help belongs to PROGRAM. */
  expect_ok(&r, RUN(&r, "prog", "--help"));
  assert_string_equal(r.o.prog_argv[1], "--help");
}

static void test_repeated_flags(void **state) {
  run_t r;
  expect_ok(&r, RUN(&r, "--nproc_per_node=2", "--nproc-per-node", "3", "prog"));
  assert_int_equal(r.o.nproc_per_node, 3);
  /* --rdzv_conf keys accumulate across repeats. */
  expect_ok(&r, RUN(&r, "--rdzv_conf=join_timeout=9", "--rdzv_conf", "close_timeout=8", "prog"));
  assert_true(r.o.join_timeout_s == 9);
  assert_true(r.o.close_timeout_s == 8);
  /* A per-rank list replaced by a plain value clears the per-rank entries. */
  expect_ok(&r, RUN(&r, "--nproc_per_node=2", "--redirects=1:3", "--redirects=2", "prog"));
  assert_int_equal(r.o.redirects, 2);
  assert_int_equal(r.o.redirects_per_rank[1], -1);
  /* Key spelling with dashes is accepted too; empty items are skipped. */
  expect_ok(&r, RUN(&r, "--rdzv_conf=heartbeat-interval=2,,heartbeat_timeout=10,", "prog"));
  assert_true(r.o.heartbeat_interval_s == 2);
  assert_true(r.o.heartbeat_timeout_s == 10);
}

/* ---- program and its arguments ---- */

static void test_program_split(void **state) {
  run_t r;
  expect_ok(&r, RUN(&r, "--nnodes=1", "prog", "--nnodes=5", "-x", "--", "y"));
  assert_int_equal(r.o.nnodes_max, 1);
  assert_string_equal(r.o.program, "prog");
  assert_int_equal(r.o.prog_argc, 5);
  assert_ptr_equal(r.o.prog_argv, &r.argv[2]);
  assert_string_equal(r.o.prog_argv[0], "prog");
  assert_string_equal(r.o.prog_argv[1], "--nnodes=5");
  assert_string_equal(r.o.prog_argv[2], "-x");
  assert_string_equal(r.o.prog_argv[3], "--");
  assert_string_equal(r.o.prog_argv[4], "y");
  assert_null(r.o.prog_argv[5]);

  /* A value is taken as is, even when it looks like a flag. */
  expect_ok(&r, RUN(&r, "--log_dir", "--odd", "prog"));
  assert_string_equal(r.o.log_dir, "--odd");
  assert_string_equal(r.o.program, "prog");

  /* "-" alone is a program name, not a flag. */
  expect_ok(&r, RUN(&r, "-"));
  assert_string_equal(r.o.program, "-");
}

static void test_double_dash(void **state) {
  run_t r;
  expect_ok(&r, RUN(&r, "--nproc_per_node", "2", "--", "prog", "a"));
  assert_int_equal(r.o.nproc_per_node, 2);
  assert_string_equal(r.o.program, "prog");
  assert_int_equal(r.o.prog_argc, 2);

  /* After "--", even a flag-shaped word is the program. */
  expect_ok(&r, RUN(&r, "--", "--standalone", "x"));
  assert_string_equal(r.o.program, "--standalone");
  assert_int_equal(r.o.standalone, 1); /* implied (single node), not parsed */
  assert_int_equal(r.o.prog_argc, 2);

  expect_ok(&r, RUN(&r, "--", "--"));
  assert_string_equal(r.o.program, "--");
}

static void test_missing_program(void **state) {
  const char *const *lists[] = {
      (const char *const[]){NULL},
      (const char *const[]){"--nnodes=1", NULL},
      (const char *const[]){"--nproc_per_node", "2", "--", NULL},
      (const char *const[]){"--standalone", NULL},
  };
  for (size_t i = 0; i < sizeof lists / sizeof lists[0]; i++) {
    run_t r;
    int rc = run_list(&r, lists[i]);
    assert_int_equal(rc, CLI_EUSAGE);
    assert_non_null(strstr(r.err, "missing PROGRAM"));
    assert_non_null(strstr(r.err, "expected"));
  }
}

/* ---- errors ---- */

typedef struct {
  const char *blamed; /* the flag the message must start with */
  const char *args[8];
} error_case_t;

static const error_case_t error_cases[] = {
    {"--nproc_per_node", {"--nproc_per_node=0", "p"}},
    {"--nproc_per_node", {"--nproc_per_node=abc", "p"}},
    {"--nproc_per_node", {"--nproc_per_node=257", "p"}},
    {"--nproc_per_node", {"--nproc_per_node=2x", "p"}},
    {"--nproc_per_node", {"--nproc_per_node= 2", "p"}},
    {"--nproc_per_node", {"--nproc-per-node"}},
    {"--nproc_per_node", {"--nproc_per_node="}},
    {"--nnodes", {"--nnodes=2:1", "p"}},
    {"--nnodes", {"--nnodes=0", "p"}},
    {"--nnodes", {"--nnodes=0:2", "p"}},
    {"--nnodes", {"--nnodes=a:b", "p"}},
    {"--nnodes", {"--nnodes=1:", "p"}},
    {"--nnodes", {"--nnodes=:2", "p"}},
    {"--nnodes", {"--nnodes=1:2:3", "p"}},
    {"--nnodes", {"--nnodes=-1", "p"}},
    {"--nnodes", {"--nnodes"}},
    {"--node_rank", {"--node_rank=-1", "p"}},
    {"--node_rank", {"--node-rank=x", "p"}},
    {"--node_rank", {"--nnodes=2", "--rdzv_endpoint=h", "--node_rank=2", "p"}},
    {"--node_rank", {"--node_rank=1", "p"}},
    {"--rdzv_endpoint", {"--rdzv_endpoint=host:0", "p"}},
    {"--rdzv_endpoint", {"--rdzv_endpoint=host:70000", "p"}},
    {"--rdzv_endpoint", {"--rdzv_endpoint=host:", "p"}},
    {"--rdzv_endpoint", {"--rdzv_endpoint=host:port", "p"}},
    {"--rdzv_endpoint", {"--rdzv_endpoint=[::1", "p"}},
    {"--rdzv_endpoint", {"--rdzv_endpoint=[::1]x", "p"}},
    {"--rdzv_endpoint", {"--rdzv_endpoint=:29400", "p"}},
    {"--rdzv_endpoint", {"--rdzv_endpoint=", "p"}},
    {"--rdzv_endpoint", {"--rdzv-endpoint"}},
    {"--rdzv_endpoint", {"--nnodes=2", "p"}},
    {"--rdzv_endpoint", {"--nnodes=1:2", "--rdzv_backend=c10d", "p"}},
    {"--rdzv_id", {"--rdzv_id=", "p"}},
    {"--rdzv_id", {"--rdzv_id=a b", "p"}},
    {"--run_id", {"--run_id=", "p"}},
    {"--rdzv_id", {"--rdzv_id=../x", "p"}},
    {"--rdzv_id", {"--rdzv_id=a/b", "p"}},
    {"--rdzv_id", {"--rdzv_id=.hidden", "p"}},
    {"--rdzv_id", {"--rdzv_id=..", "p"}},
    {"--rdzv_id", {"--rdzv_id=a:b", "p"}},
    {"--rdzv_id", {"--rdzv_id=xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx", "p"}}, /* 65 */
    {"--rdzv_backend", {"--rdzv_backend=zookeeper", "p"}},
    {"--rdzv_endpoint", {"--rdzv_backend=etcd", "p"}},
    {"--rdzv_endpoint", {"--rdzv_backend=etcd", "--nnodes=2", "p"}},
    {"--rdzv_endpoint", {"--rdzv_endpoint=a:1,b:2", "--nnodes=2", "p"}},
    {"--rdzv_endpoint", {"--rdzv_backend=etcd", "--rdzv_endpoint=a:1,:2", "p"}},
    {"--rdzv_endpoint", {"--rdzv_backend=etcd", "--rdzv_endpoint=a:1,b:99999", "p"}},
    {"--rdzv_endpoint", {"--rdzv_backend=etcd", "--rdzv_endpoint=a,b,c,d,e,f,g,h,i,j,k,l,m,n,o,p,q", "p"}},
    {"--standalone", {"--standalone", "--rdzv_backend=etcd", "p"}},
    {"--rdzv_backend", {"--rdzv_backend=", "p"}},
    {"--rdzv_conf", {"--rdzv_conf=timeout=1", "p"}},
    {"--rdzv_conf", {"--rdzv_conf=join_timeout", "p"}},
    {"--rdzv_conf", {"--rdzv_conf=join_timeout=-1", "p"}},
    {"--rdzv_conf", {"--rdzv_conf=join_timeout=0", "p"}},
    {"--rdzv_conf", {"--rdzv_conf=join_timeout=abc", "p"}},
    {"--rdzv_conf", {"--rdzv_conf=join_timeout=", "p"}},
    {"--rdzv_conf", {"--rdzv_conf=join_timeout=inf", "p"}},
    {"--rdzv_conf", {"--rdzv_conf=close_timeout=nan", "p"}},
    {"--rdzv_conf", {"--rdzv_conf=last_call_timeout=-0.5", "p"}},
    {"--rdzv_conf", {"--rdzv_conf=heartbeat_interval=0", "p"}},
    {"--rdzv_conf", {"--rdzv_conf=heartbeat_timeout=1", "p"}},
    {"--rdzv_conf", {"--rdzv_conf=heartbeat_interval=5,heartbeat_timeout=5", "p"}},
    {"--standalone", {"--standalone=1", "p"}},
    {"--standalone", {"--standalone", "--rdzv_endpoint=h:1", "p"}},
    {"--standalone", {"--rdzv_endpoint=h:1", "--standalone", "p"}},
    {"--standalone", {"--standalone", "--rdzv_backend=static", "p"}},
    {"--standalone", {"--standalone", "--nnodes=2", "p"}},
    {"--master_addr", {"--master_addr=host:123", "p"}},
    {"--master_addr", {"--master_addr=", "p"}},
    {"--master_addr", {"--master_addr=[::1", "p"}},
    {"--master_addr", {"--master_addr=[host]", "p"}},
    {"--master_addr", {"--master_addr=a b", "p"}},
    {"--master_addr", {"--rdzv_backend=static", "--nnodes=2", "--node_rank=0", "p"}},
    {"--master_port", {"--master_port=0", "p"}},
    {"--master_port", {"--master_port=65536", "p"}},
    {"--master_port", {"--master-port=x", "p"}},
    {"--max_restarts", {"--max_restarts=-1", "p"}},
    {"--max_restarts", {"--max-restarts=x", "p"}},
    {"--monitor_interval", {"--monitor_interval=0", "p"}},
    {"--monitor_interval", {"--monitor_interval=-1", "p"}},
    {"--monitor_interval", {"--monitor_interval=0x10", "p"}},
    {"--shutdown_timeout", {"--shutdown_timeout=-1", "p"}},
    {"--shutdown_timeout", {"--shutdown-timeout=soon", "p"}},
    {"--redirects", {"--redirects=4", "p"}},
    {"--redirects", {"--redirects=0:4", "p"}},
    {"--redirects", {"--redirects=a:1", "p"}},
    {"--redirects", {"--redirects=0:1,", "p"}},
    {"--redirects", {"--redirects=0:1,1", "p"}},
    {"--redirects", {"--redirects=256:1", "p"}},
    {"--redirects", {"--nproc_per_node=2", "--redirects=2:1", "p"}},
    {"--redirects", {"-r", "x", "p"}},
    {"--redirects", {"-r"}},
    {"--tee", {"--tee=9", "p"}},
    {"--tee", {"-t=", "p"}},
    {"--tee", {"--tee=1:1", "p"}},
    {"--log_dir", {"--log_dir=", "p"}},
    {"--local_ranks_filter", {"--local_ranks_filter=0,,1", "p"}},
    {"--local_ranks_filter", {"--local_ranks_filter=x", "p"}},
    {"--local_ranks_filter", {"--local_ranks_filter=-1", "p"}},
    {"--local_ranks_filter", {"--nproc_per_node=2", "--local-ranks-filter=3", "p"}},
    {"--merge_output", {"--merge_output=yes", "p"}},
    {"--merge_output", {"--merge-output=", "p"}},
    {"--role", {"--role=", "p"}},
    {"--role", {"--role=a b", "p"}},
    {"--module", {"--no_python", "--module", "p"}},
    {"--module", {"-m=1", "p"}},
    {"--no_python", {"--no_python=yes", "p"}},
    {"--nnodes", {"--rdzv_backend=static", "--nnodes=1:2", "--node_rank=0", "p"}},
    {"--node_rank", {"--rdzv_backend=static", "--nnodes=2", "--master_addr=h", "p"}},
    {"--help", {"--help=1", "p"}},
    {"--bogus", {"--bogus", "p"}},
    {"--bogus", {"--bogus=1", "p"}},
    {"--nproc_per_nod", {"--nproc_per_nod=2", "p"}},
    {"---", {"---", "p"}},
    {"-x", {"-x", "p"}},
};

static void test_errors_name_the_flag(void **state) {
  for (size_t i = 0; i < sizeof error_cases / sizeof error_cases[0]; i++) {
    run_t r;
    int rc = run_list(&r, error_cases[i].args);
    expect_usage(&r, rc, error_cases[i].blamed);
  }
}

/* The message quotes the bad value and states the accepted form, as the issue asks. */
static void test_error_text(void **state) {
  run_t r;
  int rc = RUN(&r, "--nnodes=2:1", "p");
  assert_int_equal(rc, CLI_EUSAGE);
  assert_string_equal(r.err, "meshrun: --nnodes: \"2:1\" is not valid; expected N or MIN:MAX with "
                             "1 <= MIN <= MAX");
  /* Dash spelling still blames the canonical flag. */
  rc = RUN(&r, "--max-restarts", "many", "p");
  assert_int_equal(rc, CLI_EUSAGE);
  assert_non_null(strstr(r.err, "\"many\""));
  /* The endpoint error carries net's reason (it names the port). */
  rc = RUN(&r, "--rdzv_endpoint=h:99999", "p");
  assert_int_equal(rc, CLI_EUSAGE);
  assert_non_null(strstr(r.err, "99999"));
}

static void test_error_buffer_small_or_null(void **state) {
  char *argv[] = {(char *)"meshrun", (char *)"--nnodes=2:1", (char *)"p", NULL};
  launcher_opts_t o;
  char tiny[12];
  memset(tiny, 'X', sizeof tiny);
  assert_int_equal(cli_parse(&o, 3, argv, tiny, sizeof tiny), CLI_EUSAGE);
  assert_true(strlen(tiny) < sizeof tiny);
  assert_int_equal(cli_parse(&o, 3, argv, NULL, 0), CLI_EUSAGE);
}

/* ---- static and standalone resolution ---- */

static void test_static_resolution(void **state) {
  run_t r;
  expect_ok(&r, RUN(&r, "--rdzv_backend=static", "--nnodes=2", "--node_rank=1",
                    "--rdzv_endpoint=10.0.0.9:777", "--master_addr=10.0.0.1", "p"));
  assert_string_equal(r.o.rdzv_host, "10.0.0.9"); /* an endpoint wins over master_addr */
  assert_int_equal(r.o.rdzv_port, 777);
  assert_string_equal(r.o.master_addr, "10.0.0.1");
  assert_string_equal(r.o.rdzv_endpoint_from, "--rdzv_endpoint");

  /* one node: --master_port is the workers' MASTER_PORT (torchrun's), the store on a free port */
  expect_ok(&r, RUN(&r, "--rdzv_backend=static", "--master_port=4321", "p"));
  assert_string_equal(r.o.rdzv_host, "127.0.0.1");
  assert_int_equal(r.o.rdzv_port, 0);
  assert_int_equal(r.o.worker_master_port, 4321);
  assert_int_equal(r.o.node_rank, 0);
  expect_ok(&r, RUN(&r, "--nproc_per_node=2", "--master_port=4322", "p")); /* c10d, standalone */
  assert_int_equal(r.o.standalone, 1);
  assert_int_equal(r.o.rdzv_port, 0);
  assert_int_equal(r.o.worker_master_port, 4322);
  expect_ok(&r, RUN(&r, "p"));
  assert_int_equal(r.o.worker_master_port, 0); /* unset: a free port each round */

  /* several nodes with static: --master_port stays the store's; the workers' port is free */
  expect_ok(&r, RUN(&r, "--rdzv_backend=static", "--nnodes=2", "--node_rank=0", "--master_addr=10.0.0.1",
                    "--master_port=4323", "p"));
  assert_int_equal(r.o.rdzv_port, 4323);
  assert_int_equal(r.o.worker_master_port, 0);
  /* messages about the store's endpoint name the flags the user gave */
  assert_string_equal(r.o.rdzv_endpoint_from, "--master_addr/--master_port");
  expect_ok(&r, RUN(&r, "--rdzv_backend=static", "--nnodes=2", "--node_rank=0", "--master_addr=10.0.0.1", "p"));
  assert_int_equal(r.o.rdzv_port, 29500);
  assert_string_equal(r.o.rdzv_endpoint_from, "--master_addr (port 29500, --master_port's default)");
  setenv("PET_MASTER_ADDR", "10.0.0.2", 1);
  expect_ok(&r, RUN(&r, "--rdzv_backend=static", "--nnodes=2", "--node_rank=0", "--master_port=4324", "p"));
  unsetenv("PET_MASTER_ADDR");
  assert_string_equal(r.o.rdzv_endpoint_from, "PET_MASTER_ADDR (--master_addr)/--master_port");
  setenv("PET_RDZV_ENDPOINT", "h:1", 1);
  expect_ok(&r, RUN(&r, "--nnodes=2", "p"));
  unsetenv("PET_RDZV_ENDPOINT");
  assert_string_equal(r.o.rdzv_endpoint_from, "PET_RDZV_ENDPOINT (--rdzv_endpoint)");
  expect_ok(&r, RUN(&r, "p"));
  assert_string_equal(r.o.rdzv_endpoint_from, "--standalone");

  /* c10d with an explicit node rank keeps it (orders nodes). */
  expect_ok(&r, RUN(&r, "--nnodes=1:3", "--node_rank=2", "--rdzv_endpoint=h", "p"));
  assert_int_equal(r.o.node_rank, 2);
  assert_int_equal(r.o.standalone, 0);
}

/* ---- --nproc_per_node=auto ---- */

static void touch(const char *dir, const char *name) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  int fd = open(path, O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
  assert_true(fd >= 0);
  close(fd);
}

static void rm(const char *dir, const char *name) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  assert_int_equal(remove(path), 0);
}

static void test_count_gpus_fake_dev(void **state) {
  char dir[] = "/tmp/meshrun_test_cli_XXXXXX";
  assert_non_null(mkdtemp(dir));
  assert_int_equal(gpus_count(dir, NULL), 0);
  static const char *files[] = {"nvidia0", "nvidia1", "nvidia2", "nvidia3",
                                "nvidiactl", "nvidia-uvm", "nvidia-modeset", "nvidia"};
  for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) touch(dir, files[i]);
  char caps[600];
  snprintf(caps, sizeof caps, "%s/nvidia-caps", dir);
  assert_int_equal(mkdir(caps, 0700), 0);

  assert_int_equal(gpus_count(dir, NULL), 4);
  assert_int_equal(gpus_count(dir, ""), 0);
  assert_int_equal(gpus_count(dir, "1,3"), 2);
  assert_int_equal(gpus_count(dir, " 2 , 3 "), 2);
  assert_int_equal(gpus_count(dir, "0,7,1"), 1); /* CUDA stops at the first invalid */
  assert_int_equal(gpus_count(dir, "0,0"), 1);
  assert_int_equal(gpus_count(dir, "-1"), 0);
  assert_int_equal(gpus_count(dir, "none"), 0);
  assert_int_equal(gpus_count(dir, "GPU-8a2f,MIG-11"), 2);
  assert_int_equal(gpus_count(dir, "GPU-a,GPU-b,GPU-c,GPU-d,GPU-e"), 4);
  assert_int_equal(gpus_count(dir, "3,2,1,0"), 4);

  for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) rm(dir, files[i]);
  assert_int_equal(rmdir(caps), 0);
  assert_int_equal(rmdir(dir), 0);
  assert_int_equal(gpus_count(dir, NULL), 0); /* no such directory */
}

/* The affinity mask is what counts: a child pinned to one CPU sees 1. */
static void test_count_cpus_follows_affinity(void **state) {
  int n = cli_count_cpus();
  assert_true(n >= 1);
  long conf = sysconf(_SC_NPROCESSORS_CONF);
  if (conf > 0) assert_true(n <= conf);

  cpu_set_t cur;
  assert_int_equal(sched_getaffinity(0, sizeof cur, &cur), 0);
  int first = -1;
  for (int c = 0; c < CPU_SETSIZE && first < 0; c++)
    if (CPU_ISSET(c, &cur)) first = c;
  assert_true(first >= 0);

  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(first, &one);
    if (sched_setaffinity(0, sizeof one, &one) != 0) _exit(100);
    _exit(cli_count_cpus());
  }
  int st;
  assert_int_equal(waitpid(pid, &st, 0), pid);
  assert_true(WIFEXITED(st));
  assert_int_equal(WEXITSTATUS(st), 1);
}

static void test_nproc_auto(void **state) {
  char *saved = getenv("CUDA_VISIBLE_DEVICES");
  saved = saved ? strdup(saved) : NULL;
  run_t r;

  /* Whatever this machine has, auto is at least one worker. */
  expect_ok(&r, RUN(&r, "--nproc_per_node=auto", "p"));
  assert_true(r.o.nproc_per_node >= 1);
  int gpus = gpus_count("/dev", saved);
  int cpus = cli_count_cpus();
  if (cpus > CLI_MAX_LOCAL_RANKS) cpus = CLI_MAX_LOCAL_RANKS;
  assert_int_equal(r.o.nproc_per_node, gpus > 0 ? gpus : cpus);

  /* All GPUs hidden: auto falls back to CPUs, gpu is an error naming the flag. */
  assert_int_equal(setenv("CUDA_VISIBLE_DEVICES", "", 1), 0);
  expect_ok(&r, RUN(&r, "--nproc-per-node", "auto", "p"));
  assert_int_equal(r.o.nproc_per_node, cpus);
  expect_usage(&r, RUN(&r, "--nproc_per_node=gpu", "p"), "--nproc_per_node");

  expect_ok(&r, RUN(&r, "--nproc_per_node=cpu", "p"));
  assert_int_equal(r.o.nproc_per_node, cpus);

  if (saved) {
    assert_int_equal(setenv("CUDA_VISIBLE_DEVICES", saved, 1), 0);
    free(saved);
  } else {
    assert_int_equal(unsetenv("CUDA_VISIBLE_DEVICES"), 0);
  }
  if (gpus > 0) {
    expect_ok(&r, RUN(&r, "--nproc_per_node=gpu", "p"));
    assert_int_equal(r.o.nproc_per_node, gpus);
  }
}

/* ---- the job secret: token_file, MESHRUN_RDZV_TOKEN ---- */

/* A file in a fresh mkdtemp directory; the path goes in out (at most 128 bytes). */
static void make_token_file(char *out, const char *name, const void *text, size_t len, mode_t mode) {
  static char dir[64];
  if (!dir[0]) {
    snprintf(dir, sizeof dir, "/tmp/test_cli-XXXXXX");
    assert_non_null(mkdtemp(dir));
  }
  snprintf(out, 128, "%s/%s", dir, name);
  unlink(out);
  int fd = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  assert_true(fd >= 0);
  assert_int_equal(write(fd, text, len), (ssize_t)len);
  assert_int_equal(fchmod(fd, mode), 0);
  close(fd);
}

static void test_secret_token_file(void **state) {
  run_t r;
  char path[128], conf[200];
  make_token_file(path, "tok", "0123456789abcdef-xyz \n\n", 23, 0600);
  snprintf(conf, sizeof conf, "--rdzv_conf=join_timeout=3,token_file=%s", path);
  expect_ok(&r, RUN(&r, conf, "p"));
  assert_string_equal(r.o.secret, "0123456789abcdef-xyz"); /* trailing whitespace cut */
  assert_int_equal(r.o.secret_source, CLI_SECRET_FILE);
  assert_int_equal(r.o.token_file_mode, 0600);
  assert_true(r.o.join_timeout_s == 3);
  /* token_file wins over the environment; the mode is kept for the agent's warning. */
  make_token_file(path, "tok644", "fedcba9876543210", 16, 0644);
  snprintf(conf, sizeof conf, "--rdzv-conf=token-file=%s", path);
  setenv(STORE_ENV_SECRET, "from-the-environment-0123", 1);
  expect_ok(&r, RUN(&r, conf, "p"));
  unsetenv(STORE_ENV_SECRET);
  assert_string_equal(r.o.secret, "fedcba9876543210");
  assert_int_equal(r.o.secret_source, CLI_SECRET_FILE);
  assert_int_equal(r.o.token_file_mode, 0644);
}

static void test_secret_env(void **state) {
  run_t r;
  expect_ok(&r, RUN(&r, "p"));
  assert_string_equal(r.o.secret, "");
  assert_int_equal(r.o.secret_source, CLI_SECRET_NONE);
  setenv(STORE_ENV_SECRET, "", 1); /* empty = unset */
  expect_ok(&r, RUN(&r, "p"));
  assert_int_equal(r.o.secret_source, CLI_SECRET_NONE);
  setenv(STORE_ENV_SECRET, "0123456789abcdef\n", 1);
  expect_ok(&r, RUN(&r, "--nnodes=2", "--rdzv_endpoint=h", "p"));
  assert_string_equal(r.o.secret, "0123456789abcdef");
  assert_int_equal(r.o.secret_source, CLI_SECRET_ENV);
  setenv(STORE_ENV_SECRET, "too-short", 1);
  int rc = RUN(&r, "p");
  expect_usage(&r, rc, STORE_ENV_SECRET);
  assert_non_null(strstr(r.err, "9 bytes"));
  unsetenv(STORE_ENV_SECRET);
}

/* Every way a token file can be unusable is one line naming --rdzv_conf and the path. */
static void test_secret_token_file_errors(void **state) {
  run_t r;
  char path[128], conf[200];
  char big[CLI_SECRET_MAX + 2], huge[4 * CLI_SECRET_MAX];
  memset(big, 'k', sizeof big);
  memset(huge, 'k', sizeof huge);
  struct {
    const char *name;
    const char *text;
    size_t len;
    const char *why;
  } cases[] = {
      {"empty", "", 0, "0 bytes (empty)"},
      {"blank", " \n\t\n", 4, "0 bytes (empty)"},
      {"short", "0123456789abcde\n", 16, "15 bytes"},
      {"nul", "0123456789\0abcdefgh", 19, "NUL"},
      {"big", big, sizeof big, "514 bytes"},
      {"huge", huge, sizeof huge, "over 512 bytes"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    make_token_file(path, cases[i].name, cases[i].text, cases[i].len, 0600);
    snprintf(conf, sizeof conf, "--rdzv_conf=token_file=%s", path);
    int rc = RUN(&r, conf, "p");
    expect_usage(&r, rc, "--rdzv_conf");
    if (!strstr(r.err, cases[i].why) || !strstr(r.err, path))
      print_error("%s: err \"%s\" lacks \"%s\" or the path\n", cases[i].name, r.err, cases[i].why);
    assert_non_null(strstr(r.err, cases[i].why));
    assert_non_null(strstr(r.err, path));
  }
  /* Missing, a directory, unreadable (root reads anything: skipped then). */
  snprintf(conf, sizeof conf, "--rdzv_conf=token_file=/nonexistent/token");
  int rc = RUN(&r, conf, "p");
  expect_usage(&r, rc, "--rdzv_conf");
  assert_non_null(strstr(r.err, "No such file"));
  rc = RUN(&r, "--rdzv_conf=token_file=/tmp", "p");
  expect_usage(&r, rc, "--rdzv_conf");
  assert_non_null(strstr(r.err, "not a regular file"));
  rc = RUN(&r, "--rdzv_conf=token_file=", "p");
  expect_usage(&r, rc, "--rdzv_conf");
  if (geteuid() != 0) {
    make_token_file(path, "noread", "0123456789abcdef", 16, 0000);
    snprintf(conf, sizeof conf, "--rdzv_conf=token_file=%s", path);
    rc = RUN(&r, conf, "p");
    expect_usage(&r, rc, "--rdzv_conf");
    assert_non_null(strstr(r.err, "Permission denied"));
  }
}

static void test_handshake_timeout(void **state) {
  run_t r;
  expect_ok(&r, RUN(&r, "p"));
  assert_true(r.o.handshake_timeout_s == 0);
  expect_ok(&r, RUN(&r, "--rdzv_conf=handshake_timeout=0.5", "p"));
  assert_true(r.o.handshake_timeout_s == 0.5);
  int rc = RUN(&r, "--rdzv_conf=handshake_timeout=0", "p");
  expect_usage(&r, rc, "--rdzv_conf");
  /* progress lines: every 5 s by default, 0 turns them off */
  expect_ok(&r, RUN(&r, "p"));
  assert_true(r.o.progress_interval_s == 5);
  expect_ok(&r, RUN(&r, "--rdzv_conf=progress_interval=0", "p"));
  assert_true(r.o.progress_interval_s == 0);
  expect_ok(&r, RUN(&r, "--rdzv_conf=progress_interval=0.25", "p"));
  assert_true(r.o.progress_interval_s == 0.25);
  rc = RUN(&r, "--rdzv_conf=progress_interval=-1", "p");
  expect_usage(&r, rc, "--rdzv_conf");
}

/* ---- the environment: PET_<FLAG>, Slurm, Python ---- */

extern char **environ;

/* Unsets every variable cli reads besides the secret: PET_*, SLURM_*, MESHRUN_SLURM_PORT,
 * PYTHON_EXEC. Names are collected first: unsetenv changes environ under the loop. */
static void clear_cli_env(void) {
  char names[256][128];
  int n = 0;
  for (char **e = environ; *e && n < 256; e++) {
    size_t len = strcspn(*e, "=");
    if (len >= sizeof names[0]) continue;
    if (strncmp(*e, "PET_", 4) && strncmp(*e, "SLURM_", 6) && strncmp(*e, "MESHRUN_SLURM_PORT=", 19) &&
        strncmp(*e, "PYTHON_EXEC=", 12))
      continue;
    memcpy(names[n], *e, len);
    names[n++][len] = '\0';
  }
  for (int i = 0; i < n; i++) unsetenv(names[i]);
}

/* Every flag torchrun reads from PET_<FLAG> (and meshrun's own --shutdown_timeout) reaches its
 * field when the command line does not give it. */
/* --health_check (a switch, also PET_HEALTH_CHECK) and --health_min_fraction in (0, 1]. */
static void test_health_flags(void **state) {
  run_t r;
  expect_ok(&r, RUN(&r, "prog"));
  assert_int_equal(r.o.health_check, 0);
  assert_true(r.o.health_min_fraction == 0.5);
  expect_ok(&r, RUN(&r, "--health-check", "--health_min_fraction=0.25", "prog"));
  assert_int_equal(r.o.health_check, 1);
  assert_true(r.o.health_min_fraction == 0.25);
  expect_ok(&r, RUN(&r, "--health_min_fraction", "1", "prog"));
  assert_true(r.o.health_min_fraction == 1);
  const char *bad[] = {"0", "1.5", "-0.1", "half", ""};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    char arg[64];
    snprintf(arg, sizeof arg, "--health_min_fraction=%s", bad[i]);
    expect_usage(&r, RUN(&r, arg, "prog"), "--health_min_fraction");
  }
  setenv("PET_HEALTH_CHECK", "1", 1);
  setenv("PET_HEALTH_MIN_FRACTION", "0.7", 1);
  expect_ok(&r, RUN(&r, "prog"));
  clear_cli_env();
  assert_int_equal(r.o.health_check, 1);
  assert_true(r.o.health_min_fraction == 0.7);
}

static void test_pet_every_flag(void **state) {
  run_t r;
  struct {
    const char *var, *value;
  } vars[] = {
      {"PET_NPROC_PER_NODE", "3"},   {"PET_NNODES", "2:4"},
      {"PET_NODE_RANK", "1"},        {"PET_RDZV_BACKEND", "c10d"},
      {"PET_RDZV_ENDPOINT", "master-0:23456"}, {"PET_RDZV_ID", "kf-job"},
      {"PET_RDZV_CONF", "join_timeout=7"},     {"PET_MASTER_ADDR", "10.1.2.3"},
      {"PET_MASTER_PORT", "4567"},   {"PET_MAX_RESTARTS", "5"},
      {"PET_MONITOR_INTERVAL", "0.5"}, {"PET_REDIRECTS", "1"},
      {"PET_TEE", "2"},              {"PET_LOG_DIR", "/tmp/pet-logs"},
      {"PET_LOCAL_RANKS_FILTER", "0,2"}, {"PET_ROLE", "trainer"},
      {"PET_SHUTDOWN_TIMEOUT", "4"},
  };
  size_t nvars = sizeof vars / sizeof vars[0];
  for (size_t i = 0; i < nvars; i++) setenv(vars[i].var, vars[i].value, 1);
  expect_ok(&r, RUN(&r, "prog"));
  clear_cli_env();
  assert_int_equal(r.o.nproc_per_node, 3);
  assert_int_equal(r.o.nnodes_min, 2);
  assert_int_equal(r.o.nnodes_max, 4);
  assert_int_equal(r.o.node_rank, 1);
  assert_int_equal(r.o.rdzv_backend, RDZV_BACKEND_C10D);
  assert_int_equal(r.o.standalone, 0);
  assert_string_equal(r.o.rdzv_host, "master-0");
  assert_int_equal(r.o.rdzv_port, 23456);
  assert_string_equal(r.o.rdzv_id, "kf-job");
  assert_true(r.o.join_timeout_s == 7);
  assert_string_equal(r.o.master_addr, "10.1.2.3");
  assert_int_equal(r.o.master_port, 4567);
  assert_int_equal(r.o.max_restarts, 5);
  assert_true(r.o.monitor_interval_s == 0.5);
  assert_int_equal(r.o.redirects, 1);
  assert_int_equal(r.o.tee, 2);
  assert_string_equal(r.o.log_dir, "/tmp/pet-logs");
  assert_int_equal(r.o.local_ranks_filter_set, 1);
  assert_int_equal(r.o.local_ranks_filter[0], 1);
  assert_int_equal(r.o.local_ranks_filter[1], 0);
  assert_int_equal(r.o.local_ranks_filter[2], 1);
  assert_string_equal(r.o.role, "trainer");
  assert_true(r.o.shutdown_timeout_s == 4);

  /* The switches, as torchrun reads them: int(value) != 0; true/false too. */
  setenv("PET_STANDALONE", "1", 1);
  expect_ok(&r, RUN(&r, "prog"));
  assert_int_equal(r.o.standalone, 1);
  setenv("PET_STANDALONE", "0", 1);
  setenv("PET_NNODES", "2", 1);
  setenv("PET_RDZV_ENDPOINT", "h:1", 1);
  expect_ok(&r, RUN(&r, "prog")); /* 0: off, so the endpoint is no conflict */
  assert_int_equal(r.o.standalone, 0);
  clear_cli_env();
  const char *on[] = {"1", "2", "-1", "true", "TRUE", "True"}, *off[] = {"0", "00", "false", "False"};
  for (size_t i = 0; i < sizeof on / sizeof on[0]; i++) {
    setenv("PET_NO_PYTHON", on[i], 1);
    expect_ok(&r, RUN(&r, "prog"));
    assert_int_equal(r.o.no_python, 1);
  }
  for (size_t i = 0; i < sizeof off / sizeof off[0]; i++) {
    setenv("PET_NO_PYTHON", off[i], 1);
    expect_ok(&r, RUN(&r, "prog"));
    assert_int_equal(r.o.no_python, 0);
  }
  clear_cli_env();
  setenv("PET_MODULE", "1", 1);
  expect_ok(&r, RUN(&r, "pkg.mod"));
  assert_int_equal(r.o.run_module, 1);
  clear_cli_env();

  /* Empty is unset; --run_id is another name of --rdzv_id, so PET_RUN_ID means nothing. */
  setenv("PET_NNODES", "", 1);
  setenv("PET_RUN_ID", "ignored", 1);
  expect_ok(&r, RUN(&r, "prog"));
  assert_int_equal(r.o.nnodes_max, 1);
  assert_string_equal(r.o.rdzv_id, "none");
  clear_cli_env();
}

/* A flag on the command line wins whole: its PET_ variable is not read at all (a bad value in
 * it is no error), also through another spelling or name of the flag, and --rdzv_conf is not
 * merged with PET_RDZV_CONF (torchrun's argparse default is replaced, not combined). */
static void test_pet_command_line_wins(void **state) {
  run_t r;
  setenv("PET_NPROC_PER_NODE", "3", 1);
  expect_ok(&r, RUN(&r, "--nproc_per_node=2", "prog"));
  assert_int_equal(r.o.nproc_per_node, 2);
  expect_ok(&r, RUN(&r, "--nproc-per-node", "4", "prog"));
  assert_int_equal(r.o.nproc_per_node, 4);
  expect_ok(&r, RUN(&r, "prog"));
  assert_int_equal(r.o.nproc_per_node, 3);

  setenv("PET_NNODES", "abc", 1);
  expect_ok(&r, RUN(&r, "--nnodes=1", "prog"));
  assert_int_equal(r.o.nnodes_max, 1);
  unsetenv("PET_NNODES");

  setenv("PET_RDZV_ID", "from-env", 1);
  expect_ok(&r, RUN(&r, "--run_id=from-argv", "prog"));
  assert_string_equal(r.o.rdzv_id, "from-argv");

  setenv("PET_RDZV_CONF", "join_timeout=7", 1);
  expect_ok(&r, RUN(&r, "--rdzv_conf=close_timeout=9", "prog"));
  assert_true(r.o.join_timeout_s == 600);
  assert_true(r.o.close_timeout_s == 9);

  setenv("PET_REDIRECTS", "3", 1);
  expect_ok(&r, RUN(&r, "-r", "1", "prog"));
  assert_int_equal(r.o.redirects, 1);

  /* PET_STANDALONE=1 and --standalone on the command line: the same thing. */
  setenv("PET_STANDALONE", "1", 1);
  expect_ok(&r, RUN(&r, "--standalone", "prog"));
  assert_int_equal(r.o.standalone, 1);
  clear_cli_env();
}

/* A bad value from the environment: one line naming the variable, the flag, the value and the
 * form expected; --help still wins over it. */
static void test_pet_bad_values(void **state) {
  run_t r;
  setenv("PET_NNODES", "abc", 1);
  int rc = RUN(&r, "prog");
  assert_int_equal(rc, CLI_EUSAGE);
  assert_string_equal(r.err, "meshrun: PET_NNODES (--nnodes): \"abc\" is not valid; expected N or MIN:MAX "
                             "with 1 <= MIN <= MAX");
  assert_int_equal(RUN(&r, "--help"), CLI_HELP);
  clear_cli_env();

  struct {
    const char *var, *value;
  } bad[] = {
      {"PET_NPROC_PER_NODE", "zero"}, {"PET_NODE_RANK", "-1"},        {"PET_RDZV_BACKEND", "etcd3"},
      {"PET_RDZV_ENDPOINT", "h:99999"}, {"PET_RDZV_CONF", "bogus"},    {"PET_MASTER_PORT", "0"},
      {"PET_MAX_RESTARTS", "x"},      {"PET_MONITOR_INTERVAL", "0"},  {"PET_TEE", "7"},
      {"PET_ROLE", "a b"},            {"PET_SHUTDOWN_TIMEOUT", "-1"}, {"PET_STANDALONE", "yes"},
      {"PET_NO_PYTHON", "on"},        {"PET_MODULE", "1.0"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    char blamed[96];
    snprintf(blamed, sizeof blamed, "%s (--", bad[i].var);
    setenv(bad[i].var, bad[i].value, 1);
    rc = RUN(&r, "prog");
    unsetenv(bad[i].var);
    char prefix[128];
    snprintf(prefix, sizeof prefix, "meshrun: %s", blamed);
    if (rc != CLI_EUSAGE || strncmp(r.err, prefix, strlen(prefix)) || !strstr(r.err, bad[i].value))
      print_error("%s=%s -> rc=%d err=\"%s\"\n", bad[i].var, bad[i].value, rc, r.err);
    assert_int_equal(rc, CLI_EUSAGE);
    assert_memory_equal(r.err, prefix, strlen(prefix));
    assert_non_null(strstr(r.err, bad[i].value));
    assert_non_null(strstr(r.err, "expected"));
    assert_null(strchr(r.err, '\n'));
  }
}

/* One case of cli_hostlist_expand: the hosts it must give, space-separated. */
static void expect_hosts(const char *list, const char *want, int count) {
  char out[512], err[256];
  int n = cli_hostlist_expand(list, out, sizeof out, err, sizeof err);
  if (n != count || strcmp(out, want))
    print_error("\"%s\" -> %d \"%s\" (err \"%s\"), wanted %d \"%s\"\n", list, n, out, err, count, want);
  assert_int_equal(n, count);
  assert_string_equal(out, want);
  assert_string_equal(err, "");
}

static void test_hostlist_expand(void **state) {
  expect_hosts("gpu-[01-03,07],cpu5", "gpu-01 gpu-02 gpu-03 gpu-07 cpu5", 5);
  expect_hosts("node1", "node1", 1);
  expect_hosts("n[8-11]", "n8 n9 n10 n11", 4);
  expect_hosts("n[08-11]", "n08 n09 n10 n11", 4);
  expect_hosts("n[098-101]", "n098 n099 n100 n101", 4);
  /* Each range keeps its own first number's width. */
  expect_hosts("node[001-002,5,07]", "node001 node002 node5 node07", 4);
  /* Several groups: every combination, the leftmost slowest; text after a group too. */
  expect_hosts("rack[1-2]-node[01-02]", "rack1-node01 rack1-node02 rack2-node01 rack2-node02", 4);
  expect_hosts("a[1,3]b[2-3]c", "a1b2c a1b3c a3b2c a3b3c", 4);
  /* Commas inside brackets are not separators; blanks are, as in Slurm's lists. */
  expect_hosts("a[1,3],b[2-3]c", "a1 a3 b2c b3c", 4);
  expect_hosts(" h1 h2, h3 ,h4\t", "h1 h2 h3 h4", 4);
  expect_hosts("[1-2]", "1 2", 2);
  expect_hosts("n[5-5]", "n5", 1);
  expect_hosts("localhost", "localhost", 1);
  expect_hosts("10.0.0.[1-2]", "10.0.0.1 10.0.0.2", 2);

  struct {
    const char *list, *why;
  } bad[] = {
      {"gpu-[01", "'[' at byte 4 is not closed"},
      {"gpu-01]", "']' without '[' at byte 6"},
      {"a[]", "\"[]\""},
      {"a[x]", "\"[x]\""},
      {"a[3-1]", "LO <= HI"},
      {"a[1-]", "\"[1-]\""},
      {"a[-1]", "\"[-1]\""},
      {"a[1,]", "\"[1,]\""},
      {"a[1 2]", "\"[1 2]\""},
      {"a[1[2]]", "not closed"},
      {"a[1-2:2]", "\"[1-2:2]\""},
      {"a[1234567890]", "\"[1234567890]\""},
      {"a,,b", "empty host name at byte 2"},
      {",a", "empty host name at byte 0"},
      {"a,", "empty host name at byte 2"},
      {"", "no host"},
      {"  ", "no host"},
      {"a\001b", "0x01"},
      {"n[0-9999999]", "more than 1000000 hosts"},
      {"a[1-1000]b[1-1001]", "more than 1000000 hosts"},
      {"a[1]b[1]c[1]d[1]e[1]f[1]g[1]h[1]i[1]", "more than 8 bracket groups"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    char out[64] = "untouched", err[256];
    int n = cli_hostlist_expand(bad[i].list, out, sizeof out, err, sizeof err);
    if (n != CLI_EUSAGE || !strstr(err, bad[i].why))
      print_error("\"%s\" -> %d err \"%s\", wanted an error with \"%s\"\n", bad[i].list, n, err, bad[i].why);
    assert_int_equal(n, CLI_EUSAGE);
    assert_non_null(strstr(err, bad[i].why));
    assert_string_equal(out, ""); /* nothing visited before the whole list was checked */
  }
  /* A name over 255 bytes, and an output buffer too small. */
  char longname[300], out[16], err[256];
  memset(longname, 'x', sizeof longname - 1);
  longname[sizeof longname - 1] = '\0';
  assert_int_equal(cli_hostlist_expand(longname, NULL, 0, err, sizeof err), CLI_EUSAGE);
  assert_non_null(strstr(err, "longer than 255 bytes"));
  assert_int_equal(cli_hostlist_expand("n[1-100]", out, sizeof out, err, sizeof err), CLI_EUSAGE);
  assert_non_null(strstr(err, "100 hosts do not fit in 16 bytes"));
}

/* A Slurm node of a 4-node job: rank 2, two tasks per node. */
static void set_slurm(void) {
  setenv("SLURM_JOB_ID", "4242", 1);
  setenv("SLURM_NNODES", "4", 1);
  setenv("SLURM_NODEID", "2", 1);
  setenv("SLURM_JOB_NODELIST", "gpu-[01-03,07]", 1);
  setenv("SLURM_NTASKS_PER_NODE", "2", 1);
}

static void test_slurm_options(void **state) {
  run_t r;
  set_slurm();
  expect_ok(&r, RUN(&r, "bin/trainer", "plan.json"));
  assert_int_equal(r.o.from_slurm, 1);
  assert_int_equal(r.o.nnodes_min, 4);
  assert_int_equal(r.o.nnodes_max, 4);
  assert_int_equal(r.o.node_rank, 2);
  assert_int_equal(r.o.rdzv_backend, RDZV_BACKEND_C10D);
  assert_int_equal(r.o.standalone, 0);
  assert_string_equal(r.o.rdzv_host, "gpu-01");
  assert_int_equal(r.o.rdzv_port, CLI_SLURM_PORT_BASE + 4242 % CLI_SLURM_PORT_SPAN);
  assert_int_equal(r.o.rdzv_port, 24242);
  assert_string_equal(r.o.rdzv_id, "4242");
  assert_int_equal(r.o.nproc_per_node, 2);

  /* Workers: the GPUs when tasks per node is absent or 1 (meshrun's own task); the default
   * when neither says; an explicit --nproc_per_node (or PET_) wins. */
  setenv("SLURM_GPUS_ON_NODE", "8", 1);
  setenv("SLURM_NTASKS_PER_NODE", "1", 1);
  expect_ok(&r, RUN(&r, "prog"));
  assert_int_equal(r.o.nproc_per_node, 8);
  unsetenv("SLURM_NTASKS_PER_NODE");
  expect_ok(&r, RUN(&r, "prog"));
  assert_int_equal(r.o.nproc_per_node, 8);
  setenv("SLURM_GPUS_ON_NODE", "0", 1);
  expect_ok(&r, RUN(&r, "prog"));
  assert_int_equal(r.o.nproc_per_node, 1);
  setenv("SLURM_NTASKS_PER_NODE", "2", 1);
  expect_ok(&r, RUN(&r, "--nproc_per_node=3", "prog"));
  assert_int_equal(r.o.nproc_per_node, 3);
  assert_int_equal(r.o.from_slurm, 1);
  setenv("PET_NPROC_PER_NODE", "5", 1);
  expect_ok(&r, RUN(&r, "prog"));
  assert_int_equal(r.o.nproc_per_node, 5);
  unsetenv("PET_NPROC_PER_NODE");

  /* The port: MESHRUN_SLURM_PORT, and --master_port over both; --rdzv_id kept. */
  setenv("MESHRUN_SLURM_PORT", "31337", 1);
  expect_ok(&r, RUN(&r, "--rdzv_id=mine", "prog"));
  assert_int_equal(r.o.rdzv_port, 31337);
  assert_string_equal(r.o.rdzv_id, "mine");
  expect_ok(&r, RUN(&r, "--master_port=1234", "prog"));
  assert_int_equal(r.o.rdzv_port, 1234);
  unsetenv("MESHRUN_SLURM_PORT");
  /* Every job id's port is the same on every node and stays in 20000..31999. */
  const char *ids[] = {"0", "1", "11999", "12000", "123456789", "4294967295"};
  for (size_t i = 0; i < sizeof ids / sizeof ids[0]; i++) {
    setenv("SLURM_JOB_ID", ids[i], 1);
    expect_ok(&r, RUN(&r, "prog"));
    long id = strtol(ids[i], NULL, 10);
    assert_int_equal(r.o.rdzv_port, 20000 + id % 12000);
    assert_in_range(r.o.rdzv_port, 20000, 31999);
    assert_string_equal(r.o.rdzv_id, ids[i]);
  }
  setenv("SLURM_JOB_ID", "4242", 1);

  /* srun's step list wins over the job's: SLURM_NODEID counts within the step. */
  setenv("SLURM_STEP_NODELIST", "gpu-[07-10]", 1);
  expect_ok(&r, RUN(&r, "prog"));
  assert_string_equal(r.o.rdzv_host, "gpu-07");
  unsetenv("SLURM_STEP_NODELIST");
  clear_cli_env();
}

/* Any rendezvous choice of the user's, from argv or PET_, leaves Slurm's variables alone; an
 * empty SLURM_JOB_ID is no Slurm. */
static void test_slurm_not_used(void **state) {
  run_t r;
  set_slurm();
  const char *const cases[][4] = {
      {"--standalone", "prog"},
      {"--nnodes=1", "prog"},
      {"--node_rank=0", "prog"},
      {"--rdzv_endpoint=h:5", "prog"},
      {"--rdzv_backend=static", "prog"},
      {"--master_addr=h", "prog"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    int rc = run_list(&r, cases[i]);
    expect_ok(&r, rc);
    assert_int_equal(r.o.from_slurm, 0);
    assert_string_not_equal(r.o.rdzv_id, "4242");
  }
  setenv("PET_RDZV_ENDPOINT", "kf-master:29400", 1);
  expect_ok(&r, RUN(&r, "prog"));
  assert_int_equal(r.o.from_slurm, 0);
  assert_string_equal(r.o.rdzv_host, "kf-master");
  unsetenv("PET_RDZV_ENDPOINT");
  setenv("SLURM_JOB_ID", "", 1);
  expect_ok(&r, RUN(&r, "prog"));
  assert_int_equal(r.o.from_slurm, 0);
  assert_int_equal(r.o.standalone, 1);
  clear_cli_env();
}

/* What cannot work under Slurm is one line naming the variable. */
static void test_slurm_errors(void **state) {
  run_t r;
  struct {
    const char *var, *value; /* NULL value: unset */
    const char *blamed, *why;
  } cases[] = {
      {"SLURM_NODEID", NULL, "SLURM_NODEID", "not set"},
      {"SLURM_NNODES", NULL, "SLURM_NNODES", "not set"},
      {"SLURM_JOB_NODELIST", NULL, "SLURM_JOB_NODELIST", "not set"},
      {"SLURM_NODEID", "4", "SLURM_NODEID=\"4\"", "0..3"},
      {"SLURM_NNODES", "abc", "SLURM_NNODES=\"abc\"", "integer"},
      {"SLURM_JOB_ID", "12.3", "SLURM_JOB_ID=\"12.3\"", "numeric job id"},
      {"SLURM_JOB_NODELIST", "gpu-[01", "SLURM_JOB_NODELIST=\"gpu-[01\"", "is not closed"},
      {"SLURM_NTASKS_PER_NODE", "0", "SLURM_NTASKS_PER_NODE=\"0\"", "1..256"},
      {"SLURM_GPUS_ON_NODE", "x", "SLURM_GPUS_ON_NODE=\"x\"", "integer"},
      {"MESHRUN_SLURM_PORT", "70000", "MESHRUN_SLURM_PORT=\"70000\"", "1..65535"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    set_slurm();
    if (!strcmp(cases[i].var, "SLURM_GPUS_ON_NODE")) unsetenv("SLURM_NTASKS_PER_NODE");
    if (cases[i].value) setenv(cases[i].var, cases[i].value, 1);
    else unsetenv(cases[i].var);
    int rc = RUN(&r, "prog");
    expect_usage(&r, rc, cases[i].blamed);
    if (!strstr(r.err, cases[i].why)) print_error("err \"%s\" lacks \"%s\"\n", r.err, cases[i].why);
    assert_non_null(strstr(r.err, cases[i].why));
    clear_cli_env();
  }
}

/* torchrun runs PROGRAM under Python; meshrun does for *.py (and -m) unless --no_python, with
 * $PYTHON_EXEC or python3; everything else is exec'd as is. */
static void test_python_programs(void **state) {
  run_t r;
  expect_ok(&r, RUN(&r, "train.py", "--lr", "3"));
  assert_string_equal(r.o.python, CLI_PYTHON);
  assert_string_equal(r.o.program, CLI_PYTHON);
  assert_string_equal(r.o.prog_argv[0], "train.py");
  assert_int_equal(r.o.prog_argc, 3);
  expect_ok(&r, RUN(&r, "--nproc_per_node=2", "dir/sub/train.py"));
  assert_string_equal(r.o.program, CLI_PYTHON);

  expect_ok(&r, RUN(&r, "--no_python", "train.py"));
  assert_null(r.o.python);
  assert_string_equal(r.o.program, "train.py");
  setenv("PET_NO_PYTHON", "1", 1);
  expect_ok(&r, RUN(&r, "train.py"));
  assert_null(r.o.python);
  unsetenv("PET_NO_PYTHON");

  const char *as_is[] = {"bin/trainer", "train.pyc", "train.PY", ".py", "python3", "py"};
  for (size_t i = 0; i < sizeof as_is / sizeof as_is[0]; i++) {
    expect_ok(&r, RUN(&r, as_is[i]));
    assert_null(r.o.python);
    assert_string_equal(r.o.program, as_is[i]);
  }

  setenv("PYTHON_EXEC", "/opt/venv/bin/python", 1);
  expect_ok(&r, RUN(&r, "train.py"));
  assert_string_equal(r.o.program, "/opt/venv/bin/python");
  expect_ok(&r, RUN(&r, "-m", "pkg.train"));
  assert_string_equal(r.o.python, "/opt/venv/bin/python");
  assert_string_equal(r.o.prog_argv[0], "pkg.train");
  setenv("PYTHON_EXEC", "", 1); /* empty = unset */
  expect_ok(&r, RUN(&r, "train.py"));
  assert_string_equal(r.o.program, CLI_PYTHON);
  unsetenv("PYTHON_EXEC");
}

/* ---- --help text ---- */

static void test_usage_text(void **state) {
  const char *u = cli_usage();
  static const char *must[] = {
      "--nproc_per_node", "--nnodes", "--node_rank", "--rdzv_backend", "--rdzv_endpoint",
      "--rdzv_id", "--run_id", "--rdzv_conf", "join_timeout", "last_call_timeout",
      "close_timeout", "heartbeat_interval", "heartbeat_timeout", "--standalone",
      "--master_addr", "--master_port", "--max_restarts", "--monitor_interval",
      "--shutdown_timeout", "-r, --redirects", "-t, --tee", "--log_dir", "--local_ranks_filter",
      "--merge_output", "[ranks 0-3,6]", "MESHRUN_MERGE_WINDOW_MS", "--role", "--no_python", "-m, --module", "-h, --help", "--version", "auto",
      "default 600", "default 30", "default 60", "default 1", "default 5", "default 0.1",
      "default 29400", "default 29500", "default none", "default default", "default c10d",
      "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
      "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
      "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE",
      "OMP_NUM_THREADS", "MESHRUN_STORE", "MESHRUN_ROUND", "ROLE_NAME", MESHRUN_VERSION,
      "token_file", "handshake_timeout", "progress_interval", CLI_RUN_ID_CHARS, STORE_ENV_SECRET, "token_file wins",
      "Exit status:", "EX_CONFIG", "EX_UNAVAILABLE", "\"restart\": false", "\"restart\": true",
      "PET_<FLAG>", "PET_STANDALONE=1", "PYTHON_EXEC", "*.py", "SLURM_JOB_ID", "SLURM_NNODES",
      "SLURM_NODEID", "SLURM_JOB_NODELIST", "SLURM_NTASKS_PER_NODE", "SLURM_GPUS_ON_NODE",
      "MESHRUN_SLURM_PORT", "port 20000 + SLURM_JOB_ID % 12000", "srun", "MESHRUN_CGROUP=0", "MESHRUN_TREE",
      "kill -9 of meshrun", "ModuleNotFoundError",
  };
  for (size_t i = 0; i < sizeof must / sizeof must[0]; i++) {
    if (!strstr(u, must[i])) print_error("--help lacks \"%s\"\n", must[i]);
    assert_non_null(strstr(u, must[i]));
  }
  /* The exit statuses it lists are the ones the launcher uses. */
  char codes[3][64];
  snprintf(codes[0], sizeof codes[0], "exited %d (a usage or plan error)", ERRFILE_EXIT_USAGE);
  snprintf(codes[1], sizeof codes[1], "%d (EX_CONFIG)", ERRFILE_EXIT_CONFIG);
  snprintf(codes[2], sizeof codes[2], "\n  %d  ", AGENT_EXIT_STORE_LOST);
  for (int i = 0; i < 3; i++) {
    if (!strstr(u, codes[i])) print_error("--help lacks \"%s\"\n", codes[i]);
    assert_non_null(strstr(u, codes[i]));
  }
  /* Fits a terminal: no line over 100 columns. */
  for (const char *line = u; *line;) {
    const char *nl = strchr(line, '\n');
    size_t len = nl ? (size_t)(nl - line) : strlen(line);
    assert_true(len <= 100);
    line += len + (nl ? 1 : 0);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_defaults_struct),
      cmocka_unit_test(test_defaults_parsed),
      cmocka_unit_test(test_value_flags_four_ways),
      cmocka_unit_test(test_boolean_flags),
      cmocka_unit_test(test_short_forms),
      cmocka_unit_test(test_help_version),
      cmocka_unit_test(test_repeated_flags),
      cmocka_unit_test(test_program_split),
      cmocka_unit_test(test_double_dash),
      cmocka_unit_test(test_missing_program),
      cmocka_unit_test(test_errors_name_the_flag),
      cmocka_unit_test(test_error_text),
      cmocka_unit_test(test_error_buffer_small_or_null),
      cmocka_unit_test(test_static_resolution),
      cmocka_unit_test(test_count_gpus_fake_dev),
      cmocka_unit_test(test_count_cpus_follows_affinity),
      cmocka_unit_test(test_nproc_auto),
      cmocka_unit_test(test_secret_token_file),
      cmocka_unit_test(test_secret_env),
      cmocka_unit_test(test_secret_token_file_errors),
      cmocka_unit_test(test_handshake_timeout),
      cmocka_unit_test(test_pet_every_flag),
      cmocka_unit_test(test_health_flags),
      cmocka_unit_test(test_pet_command_line_wins),
      cmocka_unit_test(test_pet_bad_values),
      cmocka_unit_test(test_hostlist_expand),
      cmocka_unit_test(test_slurm_options),
      cmocka_unit_test(test_slurm_not_used),
      cmocka_unit_test(test_slurm_errors),
      cmocka_unit_test(test_python_programs),
      cmocka_unit_test(test_usage_text),
  };
  /* cli reads these: a value from the caller (a Slurm job, a Kubeflow pod) would change every parse */
  unsetenv(STORE_ENV_SECRET);
  clear_cli_env();
  return cmocka_run_group_tests(tests, NULL, NULL);
}
