/* main: meshrun's entry point: flags, a check that PROGRAM can run, then the agent.
 *
 * Exit statuses: 0 success; 2 a usage error (one line naming the flag); 127 PROGRAM not found
 * or not executable (like a shell's "command not found"; checked before any rendezvous so a
 * typo fails at once on every node); otherwise what agent_run returns: the root-cause
 * worker's code (128+signal when it died by a signal; at once when the worker exited 2 or 78,
 * the codes that mean "permanent, do not restart"), 128+sig when meshrun itself got
 * INT/TERM/HUP, 69 when the rendezvous store was lost (its node died), 1 for other launcher
 * errors. `meshrun diagnose DIR` prints the hang diagnosis from the dumps in a log folder
 * (launcher/diagnose.h) instead: 0, or 2 when DIR holds none. */
#include <errno.h>
#include <limits.h>
#include <malloc.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "launcher/agent.h"
#include "launcher/cli.h"
#include "launcher/diagnose.h"
#include "launcher/workers.h"

/* meshrun diagnose DIR: the hang diagnosis from the dumps left under DIR. 0 with a diagnosis
 * on stdout; 2 with one line on stderr for a wrong call or a folder without dumps. */
static int diagnose_main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "meshrun diagnose: expected one argument, a folder (usage: meshrun diagnose DIR)\n");
    return 2;
  }
  diag_rank_t *r = NULL;
  int n = 0;
  char err[1024];
  if (diag_load_dir(argv[2], &r, &n, err, sizeof err)) {
    fprintf(stderr, "meshrun diagnose: %s\n", err);
    return 2;
  }
  if (n == 0) {
    fprintf(stderr, "meshrun diagnose: no flight recorder dumps (flight-rank*.jsonl) under %s\n", argv[2]);
    free(r);
    return 2;
  }
  enum { REPORT_MAX = 16384 };
  char *text = malloc(REPORT_MAX);
  if (text) diag_report(r, n, text, REPORT_MAX, NULL);
  fputs(text ? text : "hang: out of memory\n", stdout);
  free(text);
  free(r);
  return 0;
}

int main(int argc, char **argv) {
  /* One malloc arena: the rendezvous threads allocate little, and an arena of their own cost
   * each a 128 MiB reservation, its trimming and its first page faults at every start. */
  mallopt(M_ARENA_MAX, 1);
  log_init("[meshrun]");
  if (argc >= 2 && !strcmp(argv[1], "diagnose")) return diagnose_main(argc, argv);
  launcher_opts_t opts;
  char err[1024];
  cli_defaults(&opts);
  int rc = cli_parse(&opts, argc, argv, err, sizeof err);
  if (rc == CLI_HELP) {
    fputs(cli_usage(), stdout);
    return 0;
  }
  if (rc == CLI_VERSION) {
    printf("meshrun %s\n", MESHRUN_VERSION);
    return 0;
  }
  if (rc) {
    fprintf(stderr, "%s\n", err[0] ? err : "meshrun: bad arguments (see --help)");
    return 2;
  }
  if (!opts.run_module) {
    char path[PATH_MAX], why[128];
    if (workers_find_program(opts.program, path, sizeof path, why, sizeof why)) {
      fprintf(stderr, "meshrun: %s: %s\n", opts.program, why);
      return 127;
    }
  }
  /* A store peer that vanishes mid-write must be an error code, not a dead launcher. Workers
   * get default dispositions back before exec. */
  signal(SIGPIPE, SIG_IGN);
  return agent_run(&opts);
}
