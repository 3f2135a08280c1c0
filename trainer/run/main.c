/* trainer: trains a Llama model from a JSON plan, or samples text from saved weights, or exports
 * them.
 *
 *   trainer [PLAN.json] [--set key.path=value ...]                  train (no PLAN: embedded default)
 *   trainer sample [PLAN.json] --weights FILE [--set key.path=value ...]   print generated text
 *   trainer export --format llama2c|hf [PLAN.json] --weights FILE --out PATH  convert weights
 * (FILE: ours, llama2.c, Hugging Face or a checkpoint; without PLAN the model is the file's)
 *
 * main() reads top to bottom like llm.c's train_gpt2.c: environment (RANK, WORLD_SIZE,
 * LOCAL_RANK, set by meshrun) -> plan -> device (trainer/run/device: backend, precision, comm
 * backend) -> mesh (WORLD_SIZE > 1: the plan's dp_replicate x dp_shard x tp, groups connected
 * through MESHRUN_STORE) -> data -> model (tensor-parallel when tp > 1) -> data-parallel strategy
 * (trainer/parallel/dp: it owns the optimizer) -> checkpoint (trainer/run/checkpoint: resume, writer) ->
 * initial weights (trainer/run/weights) -> loop { train_step (trainer/run/train); metrics; eval;
 * checkpoint; test hooks (trainer/run/hooks) } -> final weights -> a text sample (trainer/run/sample).
 * The other two programs are trainer/run/sample's and trainer/run/export's. Progress goes to stderr
 * through the log ([trainer r0/1]), the sample to stdout, records to log.metrics_file
 * (trainer/run/metrics). Only rank 0 prints progress and writes metrics and weights.
 *
 * Under a mesh: ranks of one dp slot (the tp ranks) read the same micro-batches, as dp rank
 * mesh "dp".rank of "dp".size; the logged loss is the mean over dp (equal to the one-process
 * loss of the same global batch); every rank takes part in saving (gathers across dp_shard and
 * tp); rank 0 writes. Host values (eval sums, the memory report, checkpoint coordination, and
 * under pipeline parallelism the loss and gradient-norm shares) go through the mesh's host comms,
 * cpu rings whatever the backend; otherwise a step's loss and norm shares stay on the device and
 * travel on the device comms (trainer/run/train.h), read back at the steps that log (read_due).
 *
 * Where the final weights go: <checkpoint.dir>/final.safetensors when checkpoint.dir is set,
 * else out/<plan file name without .json>/final.safetensors ("default" for the embedded plan),
 * with the resolved plan JSON in the safetensors metadata under "plan". A run that starts at
 * step 1 replaces no earlier run's outputs unless the plan says overwrite (check_outputs); a
 * resume, a restart and a later round continue them. Ctrl-C without checkpoint.on_signal ends the
 * run as by default after one line saying what was lost (on_sigint).
 *
 * Failures no restart can cure are code 2 (model.init unreadable as weights, a plan over the
 * machine's memory, no intact checkpoint under resume auto, no GPU for device cuda) or carry
 * restart false (a divergence replayed after a restart).
 * Exit codes: 0 done; 1 runtime failure (data, memory, NaN loss, I/O, a collective, a failed save
 * after the last step or of the final weights, a failed write of log.metrics_file); 2 usage or
 * plan error (including device "cuda" in a build without it, WORLD_SIZE > 1 without MESHRUN_STORE,
 * an unknown or unsuitable MESHRUN_COMM_BACKEND, a checkpoint.dir that cannot be written, weights
 * or a checkpoint holding a NaN or an infinity: a restart would read them again). A
 * runtime failure also goes to TORCHELASTIC_ERROR_FILE (torchrun's layout), with
 * "meshrun": {"restart": false} when it was a lack of space.
 * Startup: when OMP_WAIT_POLICY is unset the program sets it to passive and re-execs itself once
 * (see ensure_passive_omp); nothing else runs before the first step but loading the data.
 * Hidden flags and fault variables for tests: trainer/hooks. */
#include <cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/env.h"
#include "common/err.h"
#include "common/fs.h"
#include "common/log.h"
#include "common/store.h"
#include "trainer/backend/backend.h"
#include "trainer/run/checkpoint.h"
#include "trainer/formats/ckpt.h"
#include "trainer/comm/comm.h"
#include "trainer/formats/data.h"
#include "trainer/run/device.h"
#include "trainer/run/dirlock.h"
#include "trainer/parallel/dp.h"
#include "trainer/run/export.h"
#include "trainer/run/health_gemm.h"
#include "trainer/run/hooks.h"
#include "trainer/parallel/mesh.h"
#include "trainer/run/metrics.h"
#include "trainer/model/model.h"
#include "trainer/model/ring_attention.h"
#include "trainer/run/opprof.h"
#include "trainer/run/origin.h"
#include "trainer/plan/pipeline.h"
#include "trainer/plan/plan.h"
#include "trainer/run/sample.h"
#include "trainer/run/straggler.h"
#include "trainer/run/tensorboard.h"
#include "trainer/comm/trace.h"
#include "trainer/run/train.h"
#include "trainer/run/weights.h"

#define TRAINER_VERSION "0.1.0"
#define MAX_SETS 128

static const char *usage_text =
    "usage: trainer [PLAN.json] [--set key.path=value ...]\n"
    "       trainer sample [PLAN.json] --weights FILE [--set key.path=value ...]\n"
    "       trainer export --format llama2c|hf [PLAN.json] --weights FILE --out PATH [--set ...]\n"
    "       trainer [PLAN.json] [--set ...] --print-plan\n"
    "       trainer --help | --version    (trainer sample --help, trainer export --help: their own)\n"
    "\n"
    "Trains a Llama model as the JSON plan says (keys: docs/plan.md); without PLAN, the embedded\n"
    "default plan (configs/demo.json). --set overrides one key, e.g. --set train.steps=50\n"
    "--set model.dim=128; values parse as JSON when they can, else as strings. --print-plan prints\n"
    "the plan as resolved for WORLD_SIZE (defaults filled in, mesh sizes, global batch, absolute\n"
    "input paths) as indented JSON and exits: 0 when every input file is there, else 2, nothing\n"
    "trained.\n"
    "'sample' and 'export' take any weights: a training run's .safetensors, a llama2.c .bin, a\n"
    "Hugging Face folder (config.json + model.safetensors), or a checkpoint step folder (ck/step-200)\n"
    "or directory (ck: its newest intact checkpoint) of any plan and world, told apart by content.\n"
    "Without PLAN the model's shape is the file's (--set model.* is checked against it); with PLAN,\n"
    "the plan's model must be the file's (else exit 2). 'sample' prints sample.tokens tokens (sample.temperature,\n"
    "sample.top_k, sample.top_p, sample.prompt; seed) decoded with a KV cache over the model's\n"
    "max_seq_len (then a sliding window); with data.tokenizer (or an HF folder's tokenizer.json) the\n"
    "prompt is encoded and text streamed, else bytes or ids. 'export' writes a llama2.c file or an\n"
    "HF folder (with tokenizer.json + tokenizer_config.json when a tokenizer is known; llama2.c's\n"
    "tokenizer.bin converted);\n"
    "model.init reads all three formats too, checked against the plan's model. A NaN or an infinity\n"
    "in any weights or checkpoint read is refused, naming the tensor and element (exit 2).\n"
    "Checkpoints: checkpoint.dir, .interval (steps; also at the end), .keep, .async, .resume\n"
    "(none, auto = the latest intact one or a fresh start, or a step directory); a resume keeps the\n"
    "checkpoint's train.global_batch_size when the plan sets none. Ctrl-C saves a checkpoint when\n"
    "checkpoint.dir is set, else says what was lost.\n"
    "Outputs: a run that starts at step 1 refuses (exit 2) to replace an earlier run's final\n"
    "weights, metrics, trace or checkpoints unless --set overwrite=true; a resume continues them.\n"
    "Environment: RANK, WORLD_SIZE, LOCAL_RANK (set by meshrun; default 0, 1, 0), MESHRUN_STORE\n"
    "(host:port of meshrun's store; needed when WORLD_SIZE > 1), TORCHELASTIC_RESTART_COUNT, MESHRUN_ROUND,\n"
    "OMP_NUM_THREADS (cpu threads), MESHRUN_LOG_LEVEL (error, warn, info, debug), MESHRUN_COMM_BACKEND\n"
    "({comms}: the collectives of a multi-rank run; default by device:\n"
    "{comm_default}),\n"
    "MESHRUN_COMM_TIMEOUT=SECONDS (overrides the plan's parallel.comm_timeout_s, default 300: a\n"
    "collective or the comms' setup that gets no progress from a peer for that long fails, naming the\n"
    "collective and the peer), MESHRUN_OP_PROFILE=STEP (that step's time, kernel by kernel, printed\n"
    "after it), MESHRUN_COMM_FLIGHT_RECORDS=N (overrides parallel.comm_flight_records, default 2048:\n"
    "the last calls of the comm flight recorder, dumped with every thread's stack on a comm timeout\n"
    "and on SIGUSR1 into MESHRUN_DUMP_DIR, default the rank's log folder or /tmp/meshrun-dumps-UID).\n"
    "Exit status: 0 done, 1 runtime failure, 2 usage or plan error.\n";

/* 'trainer sample --help' and 'trainer export --help': the command's own page. */
static const char *sample_usage_text =
    "usage: trainer sample [PLAN.json] --weights FILE [--set key.path=value ...]\n"
    "\n"
    "Prints text (or token ids) drawn from a model. One process; no training.\n"
    "  --weights FILE   a training run's .safetensors, a llama2.c .bin, a Hugging Face folder\n"
    "                   (config.json + model.safetensors), or a checkpoint step folder (ck/step-200)\n"
    "                   or directory (ck: its newest intact checkpoint), told apart by content\n"
    "  PLAN.json        optional, any training plan (its mesh is not used): its model must be\n"
    "                   the file's (else exit 2); without it the model's shape is the file's\n"
    "                   and --set model.* is checked against it\n"
    "  --set sample.tokens=N        tokens to draw (a KV cache over model.max_seq_len, then a\n"
    "                               sliding window)\n"
    "  --set sample.temperature=T   0 draws the most likely token\n"
    "  --set sample.top_k=K, sample.top_p=P, sample.prompt=TEXT, seed=S\n"
    "  --set data.tokenizer=FILE    a tokenizer.json or llama2.c tokenizer.bin: the prompt is\n"
    "                               encoded and text streamed (an HF folder's own tokenizer.json\n"
    "                               is used when there is one); without one, bytes or ids\n"
    "  --set device={devices}\n"
    "Exit status: 0 done, 1 runtime failure, 2 usage, plan or weights error.\n";

/* Prints a usage text with its {names} filled in from the registries (device.h). */
static void put_usage(const char *text) {
  static const struct {
    const char *name;
    const char *(*value)(void);
  } fills[] = {{"{devices}", device_usage_devices},
               {"{comms}", device_usage_comms},
               {"{comm_default}", device_usage_comm_default}};
  while (*text) {
    size_t i, n = strcspn(text, "{");
    fwrite(text, 1, n, stdout);
    text += n;
    for (i = 0; *text && i < sizeof fills / sizeof fills[0]; i++)
      if (!strncmp(text, fills[i].name, strlen(fills[i].name))) {
        fputs(fills[i].value(), stdout);
        text += strlen(fills[i].name);
        break;
      }
    if (*text == '{') fputc(*text++, stdout); /* not one of ours */
  }
}

static const char *export_usage_text =
    "usage: trainer export --format llama2c|hf [PLAN.json] --weights FILE --out PATH [--set ...]\n"
    "\n"
    "Converts weights, on the host; no device, no training.\n"
    "  --weights FILE   a training run's .safetensors, a llama2.c .bin, a Hugging Face folder, or a\n"
    "                   checkpoint step folder (ck/step-200) or directory (ck: its newest intact one)\n"
    "  --format llama2c a llama2.c checkpoint file (version 0) at PATH\n"
    "  --format hf      a Hugging Face folder at PATH: config.json, generation_config.json,\n"
    "                   model.safetensors, and tokenizer.json + tokenizer_config.json when a\n"
    "                   tokenizer is known (data.tokenizer; llama2.c's tokenizer.bin converted)\n"
    "  --out PATH       the file (llama2c) or folder (hf) to write\n"
    "  PLAN.json        optional, any training plan (its mesh is not used): its model must be\n"
    "                   the file's (else exit 2)\n"
    "  --set data.tokenizer=FILE   the tokenizer to write beside HF weights\n"
    "Exit status: 0 done, 1 runtime failure, 2 usage, plan or weights error.\n";

typedef struct {
  int help;              /* --help or -h anywhere: the command's usage on stdout, exit 0 */
  int sample_mode, export_mode;
  int print_plan;        /* --print-plan: the resolved plan on stdout, then exit */
  const char *format;    /* export */
  const char *out;       /* export */
  const char *plan_path; /* NULL: embedded default */
  const char *sets[MAX_SETS];
  int nsets;
  const char *weights;   /* sample and export */
  hooks_t hooks;         /* hidden flags: --stop-after, --dump-init, --dump-batches */
} args_t;

/* torchrun's variables, set by meshrun, read once. */
typedef struct {
  int rank, world, local_rank, local_world;
  int restart, round; /* TORCHELASTIC_RESTART_COUNT, MESHRUN_ROUND: for the resume line */
} env_t;

/* ------------------------------------------------------------------------------------------ */
/* small helpers */

/* TORCHELASTIC_ERROR_FILE (set by meshrun, as by torchrun): the cause of a fatal runtime error
 * in torchrun's layout {"message": {"message": ..., "extraInfo": {"timestamp": ...}}}, so that
 * meshrun's root-cause line carries it. restart 0 adds "meshrun": {"restart": false}: a retry
 * cannot help (a full disk), and meshrun ends the job instead of spending a restart. Best
 * effort: a file that cannot be written costs one warning. */
static void error_file_write(const char *msg, int restart) {
  const char *path = getenv("TORCHELASTIC_ERROR_FILE");
  if (!path || !*path) return;
  char ts[32];
  snprintf(ts, sizeof ts, "%lld", (long long)time(NULL));
  cJSON *root = cJSON_CreateObject();
  cJSON *m = cJSON_AddObjectToObject(root, "message");
  cJSON_AddStringToObject(m, "message", msg);
  cJSON_AddStringToObject(cJSON_AddObjectToObject(m, "extraInfo"), "timestamp", ts);
  if (!restart) cJSON_AddBoolToObject(cJSON_AddObjectToObject(root, "meshrun"), "restart", 0);
  char *txt = cJSON_PrintUnformatted(root);
  cJSON_Delete(root);
  FILE *f = txt ? fopen(path, "w") : NULL;
  int ok = f && fputs(txt, f) >= 0;
  int e = errno;
  if (f && fclose(f) != 0 && ok) ok = 0, e = errno;
  if (!ok) log_warn("cannot write TORCHELASTIC_ERROR_FILE %s: %s", path, txt ? strerror(e) : "out of memory");
  free(txt);
}

/* The end of a run that failed: the one-line message, and the error file, so that meshrun's
 * summary carries it; a usage or plan error (code 2) asks meshrun not to restart. Returns code. */
static int exit_error(int code, const char *msg, int restart) {
  fprintf(stderr, "trainer: %s\n", msg);
  error_file_write(msg, restart && code == 1);
  return code;
}

/* libgomp's threads spin for a while after each parallel region, and this build's OpenBLAS
 * runs its own pthreads: on a few cores the two pools spin against each other (sampling was
 * 16x slower on 2 cores). libgomp reads OMP_WAIT_POLICY when it loads, before main, so when
 * the variable is unset we set it to passive and exec ourselves once. A user's own setting wins. */
static void ensure_passive_omp(char **argv) {
  if (getenv("OMP_WAIT_POLICY")) return;
  setenv("OMP_WAIT_POLICY", "passive", 1);
  execv("/proc/self/exe", argv); /* returns only on failure: then run with spinning threads */
}

/* When one rank fails, meshrun stops the others with SIGTERM (as torchrun does). The others are
 * then usually about to fail themselves, at their next collective with the dead peer, and to
 * say which collective and which peer: a rank whose communicator already broke, or that is
 * exiting on an error, ignores SIGTERM so that the message is not cut short; a healthy rank
 * gets TERM_DEFER_MS to find out (a second SIGTERM from a timer), then ends as by default.
 * meshrun's SIGKILL after --shutdown_timeout bounds all of it. */
#define TERM_DEFER_MS 100
static volatile sig_atomic_t failing, term_deferred;
static timer_t term_timer;
static int have_term_timer;
/* Preemption (checkpoint.on_signal): SIGTERM, SIGINT or SIGUSR1 only record the signal; the loop
 * finishes the step, the ranks agree on it (preempt_agreed), save a checkpoint and exit 128 +
 * the signal, as the signal would have ended the process. Not when meshrun stops the workers
 * because a worker or a node is gone (its reason in MESHRUN_STOP_FILE: "failure", "dead_node",
 * "exit"): peers may then be stuck in a collective with the dead one, so the rank ends as
 * without on_signal; "signal" (meshrun forwards a preemption), "scale_up" (everyone is alive)
 * or no file (a signal from outside meshrun) save. A second SIGINT ends the process at once (a
 * user's Ctrl-C twice); meshrun's SIGKILL after its grace bounds the rest. */
static volatile sig_atomic_t preempt_sig, preempt_on;
static char stop_file[1024]; /* MESHRUN_STOP_FILE, copied before the handler can run */

/* Whether meshrun's stop reason lets this rank save (async-signal-safe: open, read, close). */
static int stop_allows_save(void) {
  if (!stop_file[0]) return 1;
  int fd = open(stop_file, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 1; /* no reason written: the signal did not come from a stop of meshrun's */
  char r[16] = "";
  ssize_t n = read(fd, r, sizeof r - 1);
  close(fd);
  if (n <= 0) return 1;
  return !strncmp(r, "signal", 6) || !strncmp(r, "scale_up", 8);
}

static void on_sigterm(int sig) {
  if (sig == SIGUSR1) comm_dump_request(); /* a dump on SIGUSR1, with or without the save */
  if (failing || comm_failed_any()) return;
  if (preempt_on && (preempt_sig || stop_allows_save())) {
    if (!preempt_sig) {
      preempt_sig = sig;
      return;
    }
    if (sig != SIGINT) return;
    signal(sig, SIG_DFL);
    raise(sig);
    return;
  }
  if (!term_deferred && have_term_timer) {
    term_deferred = 1;
    struct itimerspec its = {.it_value = {.tv_nsec = TERM_DEFER_MS * 1000000L}};
    if (timer_settime(term_timer, 0, &its, NULL) == 0) return;
  }
  signal(sig, SIG_DFL);
  raise(sig);
}
static void install_sigterm(void) {
  struct sigevent ev = {.sigev_notify = SIGEV_SIGNAL, .sigev_signo = SIGTERM};
  have_term_timer = timer_create(CLOCK_MONOTONIC, &ev, &term_timer) == 0;
  struct sigaction sa = {.sa_handler = on_sigterm, .sa_flags = SA_RESTART};
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, NULL);
}

/* Ctrl-C without checkpoint.on_signal: the process ends at once, as by default, and rank 0 first
 * says on stderr what the interruption cost: "trainer: interrupted in step 7 of 300; nothing
 * saved: set checkpoint.dir ...". The loop keeps these current; the message is assembled in the
 * handler from async-signal-safe pieces. */
static volatile sig_atomic_t run_phase;  /* 0 before the first step, 1 in the loop, 2 after it, 3 weights saved */
static volatile sig_atomic_t run_step;   /* the step in progress (1-based) */
static volatile sig_atomic_t run_ckpt;   /* the step of the last checkpoint saved, 0 when none */
static int run_steps, run_has_ckpt_dir, run_rank0;

static void say(char *buf, size_t *n, size_t cap, const char *s) {
  while (*s && *n + 1 < cap) buf[(*n)++] = *s++;
}
static void say_int(char *buf, size_t *n, size_t cap, long v) {
  char d[24];
  int k = 0;
  do d[k++] = (char)('0' + v % 10); while ((v /= 10) > 0 && k < 23);
  while (k > 0 && *n + 1 < cap) buf[(*n)++] = d[--k];
}

static void on_sigint(int sig) {
  if (run_rank0 && !failing) {
    char m[320];
    size_t n = 0;
    say(m, &n, sizeof m, "trainer: interrupted ");
    if (run_phase == 0) {
      say(m, &n, sizeof m, "before the first step");
    } else if (run_phase == 3) {
      say(m, &n, sizeof m, "after the final weights were saved");
    } else {
      if (run_phase == 1) {
        say(m, &n, sizeof m, "in step ");
        say_int(m, &n, sizeof m, run_step);
        say(m, &n, sizeof m, " of ");
        say_int(m, &n, sizeof m, run_steps);
      } else {
        say(m, &n, sizeof m, "after the last step, before the final weights were saved");
      }
      if (!run_has_ckpt_dir) {
        say(m, &n, sizeof m, "; nothing saved: set checkpoint.dir to save a checkpoint on Ctrl-C");
      } else if (run_ckpt > 0) {
        say(m, &n, sizeof m, "; the last checkpoint is step ");
        say_int(m, &n, sizeof m, run_ckpt);
        say(m, &n, sizeof m, " (checkpoint.on_signal is off)");
      } else {
        say(m, &n, sizeof m, "; no checkpoint saved yet (checkpoint.on_signal is off)");
      }
    }
    m[n++] = '\n';
    ssize_t w = write(STDERR_FILENO, m, n);
    (void)w;
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

/* The Ctrl-C message's facts that do not change (checkpoint.on_signal replaces the handler). */
static void install_sigint(const plan_t *p, int rank) {
  run_steps = p->train.steps;
  run_has_ckpt_dir = p->checkpoint.dir[0] != 0;
  run_rank0 = rank == 0;
  struct sigaction sa = {.sa_handler = on_sigint, .sa_flags = SA_RESTART};
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, NULL);
}

/* checkpoint.on_signal: SIGINT and SIGUSR1 join SIGTERM. */
static void install_preempt(void) {
  struct sigaction sa = {.sa_handler = on_sigterm, .sa_flags = SA_RESTART};
  sigemptyset(&sa.sa_mask);
  const char *sf = getenv("MESHRUN_STOP_FILE");
  snprintf(stop_file, sizeof stop_file, "%s", sf && strlen(sf) < sizeof stop_file ? sf : "");
  preempt_on = 1;
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGUSR1, &sa, NULL);
}

/* After a step: the signal any rank received, agreed by all (the largest signal number over the
 * world, one all-reduce per step while checkpoint.on_signal is on), 0 when none. -1 when the
 * agreement itself failed (a peer is gone: the run fails as it would at any collective). */
static int preempt_agreed(const mesh_t *mesh, char *err, size_t errlen) {
  float sig = (float)preempt_sig;
  comm_t *wc = mesh ? mesh_host_comm(mesh, "world") : NULL;
  if (wc && comm_all_reduce(wc, &sig, 1, DT_F32, COMM_MAX)) {
    return err_set(err, errlen, -1, "agreeing on a preemption signal: %s", comm_errmsg(wc));
  }
  return (int)sig;
}

static int parse_args(args_t *a, int argc, char **argv, char *err, size_t errlen) {
  memset(a, 0, sizeof *a);
  int i = 1;
  if (i < argc && !strcmp(argv[i], "sample")) {
    a->sample_mode = 1;
    i++;
  } else if (i < argc && !strcmp(argv[i], "export")) {
    a->export_mode = 1;
    i++;
  }
  const char *stop = NULL;
  for (; i < argc; i++) {
    const char *s = argv[i];
    const char **target = NULL;
    if (!strcmp(s, "--help") || !strcmp(s, "-h")) {
      a->help = 1;
      return 0;
    }
    if (!strcmp(s, "--set") || !strcmp(s, "-s")) {
      if (a->nsets == MAX_SETS) {
        return err_set(err, errlen, -1, "too many --set options (at most %d)", MAX_SETS);
      }
      target = &a->sets[a->nsets++];
    } else if (!strncmp(s, "--set=", 6)) {
      if (a->nsets == MAX_SETS) {
        return err_set(err, errlen, -1, "too many --set options (at most %d)", MAX_SETS);
      }
      a->sets[a->nsets++] = s + 6;
      continue;
    } else if (!strcmp(s, "--weights")) {
      target = &a->weights;
    } else if (!strcmp(s, "--format") && a->export_mode) {
      target = &a->format;
    } else if (!strcmp(s, "--out") && a->export_mode) {
      target = &a->out;
    } else if (!strcmp(s, "--print-plan") && !a->sample_mode && !a->export_mode) {
      a->print_plan = 1;
      continue;
    } else if (!strcmp(s, "--stop-after")) {
      target = &stop;
    } else if (!strcmp(s, "--dump-init")) {
      target = &a->hooks.dump_init;
    } else if (!strcmp(s, "--dump-batches")) {
      target = &a->hooks.dump_batches;
    } else if (s[0] == '-' && s[1]) {
      return err_set(err, errlen, -1, "unknown option %s (see trainer --help)", s);
    } else if (!a->plan_path) {
      a->plan_path = s;
      continue;
    } else {
      return err_set(err, errlen, -1, "unexpected argument %s: one plan file at most (see trainer --help)", s);
    }
    if (i + 1 >= argc) {
      return err_set(err, errlen, -1, "%s needs a value", s);
    }
    *target = argv[++i];
  }
  if (stop && (a->hooks.stop_after = atoi(stop)) <= 0) {
    return err_set(err, errlen, -1, "--stop-after needs a step number > 0, got %s", stop);
  }
  if ((a->sample_mode || a->export_mode) && !a->weights) {
    return err_set(err, errlen, -1, "trainer %s needs --weights FILE", a->sample_mode ? "sample" : "export");
  }
  if (a->export_mode && (!a->format || !a->out)) {
    return err_set(err, errlen, -1, "trainer export needs --format llama2c|hf and --out PATH");
  }
  if (!a->sample_mode && !a->export_mode && a->weights) {
    return err_set(err, errlen, -1,
                   "--weights is for 'trainer sample'; to start training from weights, set model.init");
  }
  return 0;
}

static int env_read(env_t *e, char *err, size_t errlen) {
  const struct { const char *name; int lo, dflt; int *out; } vars[] = {
      {"RANK", 0, 0, &e->rank}, {"WORLD_SIZE", 1, 1, &e->world}, {"LOCAL_RANK", 0, 0, &e->local_rank},
      {"LOCAL_WORLD_SIZE", 1, 1, &e->local_world}, {"TORCHELASTIC_RESTART_COUNT", 0, 0, &e->restart}};
  for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++)
    if (env_int(vars[i].name, vars[i].lo, INT_MAX, vars[i].dflt, vars[i].out)) {
      return err_set(err, errlen, -1, "bad environment %s=%s: expected an integer >= %d", vars[i].name,
                     env_text(vars[i].name), vars[i].lo);
    }
  if (env_int("MESHRUN_ROUND", 0, INT_MAX, e->restart, &e->round)) {
    return err_set(err, errlen, -1, "bad environment MESHRUN_ROUND=%s: expected an integer >= 0",
                   env_text("MESHRUN_ROUND"));
  }
  if (e->rank >= e->world) {
    return err_set(err, errlen, -1, "bad environment RANK=%s WORLD_SIZE=%s LOCAL_RANK=%s", env_text("RANK"),
                   env_text("WORLD_SIZE"), env_text("LOCAL_RANK"));
  }
  return 0;
}

/* The plan of this run: file (or the embedded default), --set, resolved for the world. A
 * training run first looks at the checkpoint its resume would load (checkpoint_peek): *resuming
 * says one is there, and a plan without train.global_batch_size takes the checkpoint's, so that
 * a resume under another world continues the same data order. The run checks its checkpoint
 * directory now, not at the first save (which, with checkpoint.interval 0, comes after the last
 * step). Errors are the documented one-liners "plan error: <key.path>: ...". */
static int plan_setup(plan_t *p, const args_t *a, int rank, int world, int *resuming, char *err, size_t errlen) {
  *resuming = 0;
  plan_set_devices(device_names()); /* the device key takes the registered backends' names */
  if (plan_load(p, a->plan_path, a->sets, a->nsets, err, errlen) != 0) return -1;
  char from[PLAN_PATH_MAX + 64];
  int carried = 0;
  if (!a->sample_mode && !a->export_mode) *resuming = checkpoint_peek(p, from, sizeof from, &carried);
  /* sample and export run in one process whatever mesh the plan trains on: the plan resolves for
   * the smallest world its mesh takes (its fixed entries), so a training plan of 8 ranks serves */
  if (a->sample_mode || a->export_mode) world = plan_mesh_min_world(p);
  if (plan_resolve(p, world, err, errlen) != 0) {
    size_t n = strlen(err);
    if (carried && !strncmp(err, "plan error: train.global_batch_size:", 36))
      snprintf(err + n, errlen - n, " (train.global_batch_size is the checkpoint %s's, kept on resume so that the "
               "data order continues: choose a micro-batch size that divides it, or checkpoint.resume=none)", from);
    return -1;
  }
  if (carried)
    log_rank0("train.global_batch_size=%d as %s trained (unset in the plan; a resume keeps it, so the data order "
              "continues): micro-batch %d x dp %d x %d accumulation steps", p->train.global_batch_size, from,
              p->train.micro_batch_size, p->mesh.dp_replicate * p->mesh.dp_shard, p->train.grad_accum_steps);
  /* printed before the inputs are checked, so a plan can be read whatever is missing; by rank 0
   * alone under meshrun (every rank resolves the same plan) */
  if (a->print_plan && rank == 0) {
    char *json = plan_format(p, 1);
    if (!json) {
      return err_set(err, errlen, -1, "out of memory");
    }
    fputs(json, stdout);
    fputc('\n', stdout);
    fflush(stdout);
    free(json);
  }
  if (!a->sample_mode && !a->export_mode && plan_check_paths(p, err, errlen) != 0) return -1;
  return 0;
}

/* Every file a training run writes, checked before the device starts (a read-only folder found
 * after the last step would lose the weights): rank 0's final weights folder and metrics file,
 * the trace file, the TensorBoard folder. checkpoint.dir was checked with the inputs (plan_check_paths). A run that
 * starts afresh (fresh: not a resume, a restart or a later round of a meshrun job, which
 * continue the outputs of the run they belong to) replaces no earlier run's results unless
 * the plan says overwrite: existing final weights, metrics, trace or event files, or checkpoints in
 * checkpoint.dir with checkpoint.resume none (this run's saves would prune them), are refused. */
static int check_outputs(const plan_t *p, int rank, int fresh, char *err, size_t errlen) {
  if (rank != 0) return 0;
  char path[PLAN_PATH_MAX + 32], dir[PLAN_PATH_MAX + 32];
  weights_final_path(p, path, sizeof path);
  fs_dirname(path, dir, sizeof dir); /* fits: no longer than path */
  const char *wkey = p->checkpoint.dir[0] ? "checkpoint.dir" : "final weights";
  if (!p->checkpoint.dir[0] &&
      plan_check_output_dir(wkey, dir, " (the final weights go to out/<plan name>/ of the working directory "
                            "unless checkpoint.dir is set)", err, errlen))
    return -1;
  if (p->log.metrics_file[0] && plan_check_output_file("log.metrics_file", p->log.metrics_file, err, errlen))
    return -1;
  if (p->log.trace_file[0] && plan_check_output_file("log.trace_file", p->log.trace_file, err, errlen)) return -1;
  if (p->log.tensorboard_dir[0] &&
      plan_check_output_dir("log.tensorboard_dir", p->log.tensorboard_dir, "", err, errlen))
    return -1;
  if (!fresh || p->overwrite) return 0;
  if (plan_check_not_there(wkey, path, "an earlier run's final weights", err, errlen) ||
      (p->log.metrics_file[0] &&
       plan_check_not_there("log.metrics_file", p->log.metrics_file, "an earlier run's metrics", err, errlen)) ||
      (p->log.trace_file[0] &&
       plan_check_not_there("log.trace_file", p->log.trace_file, "an earlier run's trace", err, errlen)) ||
      (p->log.tensorboard_dir[0] && tensorboard_check_fresh(p->log.tensorboard_dir, err, errlen)))
    return -1;
  ckpt_state_t st;
  char from[PLAN_PATH_MAX + 64] = "";
  if (p->checkpoint.dir[0] && !strcmp(p->checkpoint.resume, "none") &&
      ckpt_peek(p->checkpoint.dir, "auto", &st, from, sizeof from) != CKPT_ENOENT) {
    char newest[PLAN_PATH_MAX + 80] = "";
    if (from[0]) snprintf(newest, sizeof newest, " (the newest %s)", from);
    return err_set(err, errlen, -1,
                   "plan error: checkpoint.resume: none, and checkpoint.dir %s holds an earlier run's "
                   "checkpoints%s, which this run's saves would replace: checkpoint.resume=auto continues that run, "
                   "--set overwrite=true starts over there",
                   p->checkpoint.dir, newest);
  }
  return 0;
}

/* model.init, read before the device starts: a file that is not weights, is cut short or holds
 * another model is the plan's error (exit 2: a restart would read the same file). Its headers
 * only; weights_init reads the values later. */
static int check_init_weights(const plan_t *p, char *err, size_t errlen) {
  if (!p->model.init[0]) return 0;
  weights_file_t *f = NULL;
  plan_model_t cfg;
  int rc = weights_open(&f, p->model.init, err, errlen);
  if (rc == 0) rc = weights_resolve_model(f, &p->model, 1, NULL, 0, &cfg, err, errlen);
  weights_close(f);
  return rc;
}

/* Builds the mesh of a multi-process run and connects its groups through meshrun's store, with
 * comm backend comm_backend on device be's memory. */
static int mesh_setup(mesh_t **out, const plan_t *p, int rank, int world, const char *comm_backend, backend_t *be,
                      char *err, size_t errlen) {
  const char *ep = getenv("MESHRUN_STORE");
  if (!ep || !*ep) {
    return err_set(err, errlen, 2,
                   "WORLD_SIZE=%d: the mesh's groups connect through meshrun's store, and MESHRUN_STORE is "
                   "not set: run under meshrun, or set MESHRUN_STORE=host:port",
                   world);
  }
  int dims[MESH_NDIMS];
  dims[MESH_PP] = p->mesh.pp, dims[MESH_DP_REPLICATE] = p->mesh.dp_replicate, dims[MESH_DP_SHARD] = p->mesh.dp_shard;
  dims[MESH_CP] = p->mesh.cp, dims[MESH_TP] = p->mesh.tp;
  if (mesh_create_dims(out, dims, rank, world, err, errlen)) return 2;
  /* The flight recorder before the first communicator; SIGUSR1 dumps it (checkpoint.on_signal,
   * installed later, takes SIGUSR1 over for preemption and asks for the dump itself). A run
   * without the signal's dumps still trains. */
  if (comm_flight_setup(comm_flight_records(p->parallel.comm_flight_records), err, errlen)) return 1;
  char why[256];
  if (comm_dump_on_signal(why, sizeof why)) log_warn("%s; SIGUSR1 will not dump", why);
  store_t *st = NULL;
  if (store_connect_env(&st, 60000, err, errlen)) return 1;
  int rc = mesh_connect(*out, comm_backend, be, st, -1, NULL, comm_timeout_ms(p->parallel.comm_timeout_s), err, errlen);
  store_close(st);
  return rc ? 1 : 0;
}

/* The pipeline's runner (mesh.pp > 1): the schedule of this rank, whose slots size the model's
 * activations. The model, strategy and channels are filled in once they exist. */
static int pipeline_setup(pp_runner_t *r, const plan_t *p, const mesh_t *mesh, char *err, size_t errlen) {
  pp_runner_config_t cfg = {.schedule = (pp_schedule_t)p->parallel.pp_schedule, .p = mesh->dims[MESH_PP],
                            .v = p->parallel.pp_stages_per_rank, .m = p->parallel.pp_microbatches,
                            .rank = mesh->coord[MESH_PP], .send_act = mesh->pp.send_act, .recv_act = mesh->pp.recv_act,
                            .send_grad = mesh->pp.send_grad, .recv_grad = mesh->pp.recv_grad};
  return pp_runner_init(r, &cfg, err, errlen);
}

/* This rank's model: its pipeline stages (pp: the runner's slots), its tp slice under a mesh
 * (tpo, which must live as long as the model), no flat buffers when the strategy shards them,
 * the plan's mixed precision (FSDP and HSDP gather the bf16 compute copies themselves). */
static int model_setup(model_t **m, model_tp_t *tpo, model_cp_t *cpo, const plan_t *p, backend_t *be,
                       const mesh_t *mesh, const pp_runner_t *ppr, char *err, size_t errlen) {
  const int B = p->train.micro_batch_size, T = plan_local_seq_len(p), tp = mesh ? mesh->dims[MESH_TP] : 1;
  model_opts_t opts = {.max_b = B, .max_t = T, .decay_norms = p->train.decay_norms,
                       .decay_embeddings = p->train.decay_embeddings, .checkpoint_every = plan_checkpoint_every(p),
                       .param_dtype = p->parallel.param_dtype,
                       .reduce_dtype = p->parallel.reduce_dtype,
                       .strategy_casts = dp_is_sharded(mesh)};
  if (!mesh) return model_create_opts(m, &p->model, be, &opts, err, errlen);
  *tpo = (model_tp_t){.comm = tp > 1 ? mesh_comm(mesh, "tp") : NULL,
                      .sequence_parallel = p->parallel.sequence_parallel,
                      .loss_parallel = p->parallel.loss_parallel,
                      .plan = p->parallel.tp_plan,
                      .n_plan = p->parallel.n_tp_plan};
  opts.tp = tp > 1 ? tpo : NULL;
  *cpo = (model_cp_t){.send = mesh->cp.send, .recv = mesh->cp.recv, .group = mesh_comm(mesh, "cp"),
                      .size = mesh->dims[MESH_CP], .rank = mesh->coord[MESH_CP],
                      .rotate = p->parallel.cp_rotate == PLAN_CP_ALLGATHER ? RING_ROTATE_ALLGATHER : RING_ROTATE_RING,
                      .overlap = p->parallel.overlap};
  opts.cp = cpo->size > 1 ? cpo : NULL;
  opts.no_flat_buffers = dp_owns_buffers(mesh, p);
  int first[PP_MAX_CHUNKS], layers[PP_MAX_CHUNKS];
  if (ppr) { /* chunk c is stage pp_stage_of(q, c, pp); a pipeline micro-batch is accum * B / m sequences */
    const int v = ppr->cfg.v, q = ppr->cfg.rank, mb = p->train.grad_accum_steps * B / ppr->cfg.m;
    for (int c = 0; c < v; c++) {
      const int stage = pp_stage_of(q, c, ppr->cfg.p);
      first[c] = plan_pp_stage_first(p, stage);
      layers[c] = plan_pp_stage_first(p, stage + 1) - first[c];
    }
    opts.n_chunks = v;
    opts.chunk_first = first;
    opts.chunk_layers = layers;
    opts.chunk_slots = ppr->slots;
    opts.max_b = mb > B ? mb : B;
  }
  return model_create_opts(m, &p->model, be, &opts, err, errlen);
}

/* The final weights (every rank helps assemble them; rank 0 writes). Rank 0's outcome is shared
 * before anything else collective (the sample's forwards): 0 saved, 1 failed, 2 failed for lack
 * of space (st_write's errno comes as text; *no_restart set). */
static int final_weights(model_t *m, dp_t *dp, const mesh_t *mesh, const plan_t *p, int rank, const char *plan_json,
                         int *no_restart, char *err, size_t errlen) {
  char path[PLAN_PATH_MAX + 32];
  weights_final_path(p, path, sizeof path);
  float wrc = weights_save(m, dp, mesh, rank, path, plan_json, p->train.steps, err, errlen) == 0 ? 0.0f
              : ckpt_msg_is_nospace(err)                                                         ? 2.0f
                                                                                                 : 1.0f;
  const float mine = wrc;
  if (mesh && comm_all_reduce(mesh_host_comm(mesh, "world"), &wrc, 1, DT_F32, COMM_MAX)) {
    return err_set(err, errlen, -1, "saving the final weights: %s", comm_errmsg(mesh_host_comm(mesh, "world")));
  }
  if (wrc != 0.0f) {
    if (mine == 0.0f) err_set(err, errlen, 0, "the final weights %s were not saved (rank 0 says why)", path);
    *no_restart = wrc == 2.0f;
    return -1;
  }
  log_rank0("saved %s", path);
  run_phase = 3;
  return 0;
}

/* The sample after training. Under a mesh every rank runs the sample's forwards (they are
 * collective under FSDP and TP) and draws the same tokens from the same seed; rank 0 prints. */
static int final_sample(model_t *m, backend_t *be, dp_t *dp, const mesh_t *mesh, const plan_t *p, int is_text,
                        int rank, char *err, size_t errlen) {
  const int tp = mesh ? mesh->dims[MESH_TP] : 1;
  if (p->sample.sample_tokens <= 0 || !(rank == 0 || dp_is_sharded(mesh) || tp > 1)) return 0;
  if (mesh && (mesh->dims[MESH_PP] > 1 || mesh->dims[MESH_CP] > 1)) { /* the sampler runs the whole model */
    char path[PLAN_PATH_MAX + 32];
    weights_final_path(p, path, sizeof path);
    log_rank0("sample: not under %s parallelism; run `trainer sample %s` for one",
              mesh->dims[MESH_PP] > 1 ? "pipeline" : "context", path);
    return 0;
  }
  log_rank0("sample (%d tokens, temperature %.2f):", p->sample.sample_tokens, p->sample.temperature);
  FILE *out = rank == 0 ? stdout : fopen("/dev/null", "w");
  int rc = out ? sample_generate(m, be, p, is_text, out, err, errlen) : 0;
  if (out && out != stdout) fclose(out);
  if (dp_status(dp)) err_set(err, errlen, 0, "sample: %s", dp_errmsg(dp));
  return rc || dp_status(dp) ? -1 : 0;
}

/* The pipeline's record of a step: this rank's compute and span, micro-batches in flight at the
 * peak, and the activation arena its slots occupy (collective over the pp group). */
static int pipeline_record(metrics_t *mt, model_t *m, int step, const pp_step_stats_t *st, char *err, size_t errlen) {
  model_memory_t mm;
  model_memory(m, &mm);
  return metrics_pipeline(mt, step, st->busy_ns * 1e-6, st->span_ns * 1e-6, st->peak_inflight, mm.act_bytes, err,
                          errlen);
}

static int eval_due(const plan_t *p, int step) {
  return p->eval.interval > 0 && p->eval.batches > 0 && (step % p->eval.interval == 0 || step == p->train.steps);
}

/* ------------------------------------------------------------------------------------------ */
/* One run of the trainer: what main acquires, each field released by run_end through one path
 * whatever step failed, and the outcome so far. code is the exit status of a failure (2 usage or
 * plan, 1 runtime); plan_failed marks a plan's one-liner, which no restart would cure. */
typedef struct {
  args_t a;
  env_t env;
  char err[4096];
  int code, plan_failed, no_restart, stopped, start_step, resumed, preempt_exit;
  plan_t *p;
  backend_t *be;
  const char *comm_backend;
  mesh_t *mesh;
  data_t data;
  model_t *m;
  model_tp_t tpo; /* lives as long as the model, which may keep a pointer to it */
  model_cp_t cpo; /* the same */
  pp_runner_t ppr;
  pp_runner_t *pp; /* &ppr under pipeline parallelism */
  char *plan_json;
  dp_t *dp;
  checkpoint_t ck;
  train_t tr;
  metrics_t mt;
  straggler_t sg;
} run_t;

/* What a step of main returns: go on to the next, stop with a failure (r->code says which), or
 * stop with nothing left to do (--print-plan, export, sample). */
enum { RUN_FAIL = -1, RUN_ON = 0, RUN_DONE = 1 };

/* The plan, and what can be refused before a device starts: the command's inputs and outputs,
 * the checkpoint folder's lock and MESHRUN_OP_PROFILE (*prof_step). Export ends here. */
static int run_plan(run_t *r, int *prof_step) {
  char *err = r->err;
  const size_t errlen = sizeof r->err;
  args_t *a = &r->a;
  const env_t *env = &r->env;
  if (!(r->p = calloc(1, sizeof *r->p))) {
    snprintf(err, errlen, "out of memory");
    return RUN_FAIL;
  }
  plan_t *p = r->p;
  r->code = 2;
  int resuming = 0;
  if (plan_setup(p, a, env->rank, env->world, &resuming, err, errlen)) {
    r->plan_failed = 1; /* the message is already the documented one-liner */
    return RUN_FAIL;
  }
  if (a->print_plan) return RUN_DONE; /* plan_setup printed it and found every input */
  if (env->world > 1 && (a->sample_mode || a->export_mode || hooks_one_process(&a->hooks))) {
    snprintf(err, errlen, "'trainer sample', 'trainer export', --dump-init and --dump-batches run in one process "
             "(WORLD_SIZE=%d)", env->world);
    return RUN_FAIL;
  }
  if (a->export_mode) { /* any weights to llama2.c or Hugging Face: no device, no model */
    if ((r->code = export_run(p, a->weights, a->plan_path != NULL, a->sets, a->nsets, a->format, a->out, err,
                              errlen)))
      return RUN_FAIL;
    return RUN_DONE;
  }

  const int fresh = !resuming && env->restart == 0 && env->round == 0;
  if (!a->sample_mode && check_outputs(p, env->rank, fresh, err, errlen)) {
    r->plan_failed = 1; /* code 2: the plan's outputs, a one-liner, never retried */
    return RUN_FAIL;
  }
  if (!a->sample_mode && p->checkpoint.dir[0] && env->rank == 0 &&
      (r->code = dirlock_take(p->checkpoint.dir, err, errlen))) { /* one run at a time (dirlock.h) */
    r->plan_failed = r->code == 2;
    return RUN_FAIL;
  }
  r->code = 2;
  if (!a->sample_mode && (r->code = check_init_weights(p, err, errlen))) {
    r->plan_failed = r->code == 2;
    return RUN_FAIL;
  }
  r->code = 2;
  if (!a->sample_mode) install_sigint(p, env->rank);
  /* MESHRUN_OP_PROFILE=STEP: the kernel times of one step, printed after it (opprof.h); a bad
   * value is refused before the device starts (code is 2 here) */
  *prof_step = opprof_step_from_env(err, errlen);
  if (*prof_step < 0) return RUN_FAIL;
  return RUN_ON;
}

/* The device: the backend, its precision options, and the comm backend of a multi-rank run.
 * Sample ends here. */
static int run_device(run_t *r, int prof_step) {
  char *err = r->err;
  const size_t errlen = sizeof r->err;
  const args_t *a = &r->a;
  const env_t *env = &r->env;
  plan_t *p = r->p;
  if ((r->code = device_open(p, env->local_rank, env->local_world, env->world, &r->be, &r->comm_backend, err,
                             errlen)))
    return RUN_FAIL;
  /* every step's kernels and host syncs are counted (the metrics record them); one is timed
   * kernel by kernel where MESHRUN_OP_PROFILE asks */
  if (!a->sample_mode) opprof_install(r->be, prof_step, stderr);
  if (!a->sample_mode && r->be->mem == BACKEND_MEM_HOST &&
      plan_check_memory(p, device_host_memory(), env->local_world, err, errlen)) {
    r->code = 2, r->plan_failed = 1; /* more than the machine has: no restart makes it fit */
    return RUN_FAIL;
  }
  if (a->sample_mode) { /* weights in, text out (one process) */
    if ((r->code = sample_run(p, r->be, a->weights, a->plan_path != NULL, a->sets, a->nsets, err, errlen)))
      return RUN_FAIL;
    return RUN_DONE;
  }
  return RUN_ON;
}

/* The trace (log.trace_file) observes the collectives: open before the mesh, the groups every
 * later collective runs on. code is 2 from here until the mesh: device_open left it 0, and a
 * failure must not exit 0. */
static int run_mesh(run_t *r) {
  char *err = r->err;
  const size_t errlen = sizeof r->err;
  const env_t *env = &r->env;
  plan_t *p = r->p;
  r->code = 2;
  if (trace_open(p->log.trace_file, env->rank, p->log.trace_steps, err, errlen)) return RUN_FAIL;
  if (env->world > 1 &&
      (r->code = mesh_setup(&r->mesh, p, env->rank, env->world, r->comm_backend, r->be, err, errlen)))
    return RUN_FAIL;
  if (trace_attach(err, errlen)) { /* rank 0 created the file before the mesh connected */
    r->code = 2;
    return RUN_FAIL;
  }
  r->code = 1;
  return RUN_ON;
}

/* Data before the model: a wrong file fails before a large allocation. A file that is not what
 * the plan says is the plan's error (exit 2, not retried); only memory is not. Then the model
 * and the data-parallel strategy (it owns the optimizer over this rank's range). */
static int run_model(run_t *r) {
  char *err = r->err;
  const size_t errlen = sizeof r->err;
  plan_t *p = r->p;
  int drc = data_load(&r->data, p, p->eval.interval > 0 && p->eval.batches > 0, err, errlen);
  if (drc) {
    if (drc != DATA_ENOMEM) r->code = 2, r->plan_failed = 1;
    return RUN_FAIL;
  }
  if (r->mesh && r->mesh->dims[MESH_PP] > 1) {
    if (pipeline_setup(&r->ppr, p, r->mesh, err, errlen)) return RUN_FAIL;
    r->pp = &r->ppr;
  }
  int mrc = model_setup(&r->m, &r->tpo, &r->cpo, p, r->be, r->mesh, r->pp, err, errlen);
  if (mrc) {
    if (mrc == MODEL_EPLAN) r->code = 2, r->plan_failed = 1;
    return RUN_FAIL;
  }
  r->plan_json = plan_to_json(p);
  if (dp_create(&r->dp, r->m, r->be, r->mesh, p, err, errlen)) return RUN_FAIL;
  if (r->pp) {
    r->ppr.cfg.model = r->m;
    r->ppr.cfg.dp = r->dp;
  }
  return RUN_ON;
}

/* Whether step `step` (1-based) reads the values of the steps before it back from the device
 * (train.h): the steps whose values something needs at once, the console line, an evaluation, a
 * checkpoint (never from a diverged state), the last step and a --stop-after. */
static int read_due(void *arg, int step) {
  const run_t *r = arg;
  const plan_t *p = r->p;
  return metrics_line_due(p, step) || eval_due(p, step) || checkpoint_due(&r->ck, step) || step == p->train.steps ||
         step == r->a.hooks.stop_after;
}

/* The records of the steps train_step or train_read just read (also those before a diverged
 * one), with the spread of the ranks' compute times: gathered over the job at a read that every
 * rank reaches (ok), this rank's alone after a failure (a rank that failed otherwise is not at
 * the same read, and the gather would strand the others). 0, or -1 with the message in r->err
 * when the gather failed (never when not ok). */
static int record_read(run_t *r, int ok) {
  const int n = r->tr.n_read;
  const int rc = straggler_gather(&r->sg, n, !ok, r->err, sizeof r->err);
  if (ok) metrics_skip_traffic(&r->mt); /* the gather's traffic is not a step's */
  metrics_step_values(&r->mt, n, r->tr.read_loss, r->tr.read_gnorm, r->tr.read_skip, rc ? NULL : r->sg.stat);
  return rc;
}

/* The checkpoint: resume (collective over the job), then a writer when checkpoint.dir is set;
 * the initial weights unless resumed (random, our safetensors, llama2.c or Hugging Face); then
 * the loop's state and the metrics. */
static int run_start(run_t *r) {
  char *err = r->err;
  const size_t errlen = sizeof r->err;
  args_t *a = &r->a;
  const env_t *env = &r->env;
  plan_t *p = r->p;
  hooks_init(&a->hooks, env->rank);
  if ((r->code = checkpoint_open(&r->ck, p, r->dp, r->mesh, &a->hooks, env->rank, env->world, env->restart,
                                 env->round, r->plan_json, (uint64_t)r->data.train_src.n + r->data.val_src.n,
                                 &r->start_step, &r->resumed, err, errlen)))
    return RUN_FAIL;
  if (p->checkpoint.on_signal) install_preempt();
  if (!r->resumed && (r->code = weights_init(r->m, r->dp, p, err, errlen))) return RUN_FAIL;
  r->code = 1;
  if (hooks_initial_weights(&a->hooks, r->m, r->dp, r->mesh, r->plan_json, err, errlen)) return RUN_FAIL;

  /* batches are read per dp rank (the cp ranks of one share theirs); losses average over dp x cp */
  comm_t *dpc = r->mesh ? mesh_host_comm(r->mesh, "dp") : NULL;
  r->tr = (train_t){.p = p, .m = r->m, .dp = r->dp, .be = r->be, .data = &r->data,
                    .dpc = r->mesh ? mesh_host_comm(r->mesh, "dp_cp") : NULL, .mesh = r->mesh, .hooks = &a->hooks,
                    .dp_rank = dpc ? comm_rank(dpc) : 0, .dp_size = dpc ? comm_size(dpc) : 1,
                    .cp_size = r->mesh ? r->mesh->dims[MESH_CP] : 1, .cp_rank = r->mesh ? r->mesh->coord[MESH_CP] : 0,
                    .pp = r->pp, .ppc = r->pp ? mesh_host_comm(r->mesh, "pp") : NULL,
                    .read_due = read_due, .read_arg = r};
  if (train_init(&r->tr, err, errlen)) return RUN_FAIL;
  if (train_graphs_open(&r->tr, r->mesh ? r->comm_backend : NULL, err, errlen)) {
    r->code = 2, r->plan_failed = 1;
    return RUN_FAIL;
  }
  if (straggler_open(&r->sg, r->mesh, env->rank, p->log.straggler_pct, err, errlen) ||
      metrics_open(&r->mt, p, r->m, r->dp, r->mesh, &r->data, r->be, env->rank, env->world, r->start_step,
                   r->resumed, r->plan_json, err, errlen) ||
      hooks_start(&a->hooks, err, errlen))
    return RUN_FAIL;
  if (r->tr.skip_win) checkpoint_skip_window(&r->ck, r->be, r->tr.skip_win);
  return RUN_ON;
}

/* meshrun's hang watch (--hang_timeout) reads the last step each rank finished from the file it
 * names in MESHRUN_PROGRESS_FILE: the step as text at offset 0, rewritten after every step (one
 * pwrite, no fsync), the start step when the loop begins. A file, not a pipe: nothing to inherit
 * through a wrapper script, a write never blocks on a reader, and the file stays in the log
 * folder beside the dumps. Best effort: a file that cannot be written costs one warning. */
static void progress_write(int step) {
  static int fd = -2;
  if (fd == -2) {
    const char *path = getenv("MESHRUN_PROGRESS_FILE");
    fd = path && *path ? open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644) : -1;
    if (path && *path && fd < 0) log_warn("MESHRUN_PROGRESS_FILE %s: %s; meshrun's hang watch will not see this "
                                          "rank's steps", path, strerror(errno));
  }
  if (fd < 0) return;
  char b[24];
  int n = snprintf(b, sizeof b, "%-20d\n", step); /* fixed width: a shorter number leaves no digits behind */
  if (pwrite(fd, b, (size_t)n, 0) < 0) fd = -1;
}

/* Step s (0-based, logged as s + 1): train, record, evaluate, checkpoint, and the stops (the
 * hooks' and a preemption's). */
static int run_step_once(run_t *r, int s) {
  char *err = r->err;
  const size_t errlen = sizeof r->err;
  const plan_t *p = r->p;
  train_result_t res;
  run_step = s + 1;
  hooks_stall(&r->a.hooks, s + 1);
  hooks_skip(&r->a.hooks, s + 1, r->mesh);
  hooks_spike(&r->a.hooks, s + 1);
  if (train_step(&r->tr, s, &res, err, errlen)) {
    record_read(r, 0);
    origin_name(&r->tr, &r->sg, r->env.rank, s, err, errlen);
    /* Training is deterministic: a restart replays from the newest checkpoint bit for bit. An
     * attempt that is itself a failure restart and saved nothing since it began was that
     * replay, so every further restart would diverge at the same step. */
    if (r->tr.diverged && r->env.restart > 0 && run_ckpt == r->start_step) {
      size_t n = strlen(err);
      snprintf(err + n, errlen - n, " (again after restart %d from step %d: the run replays bit for bit, so "
               "no restart is tried)", r->env.restart, r->start_step);
      r->no_restart = 1;
    }
    return RUN_FAIL;
  }
  r->mt.step_graph = res.graph;
  metrics_step_done(&r->mt, s + 1, res.lr, res.dt, res.comm_wait);
  straggler_step(&r->sg, (res.dt - res.comm_wait) * 1e3);
  if (res.read && record_read(r, 1)) return RUN_FAIL;
  progress_write(s + 1);
  if (r->pp && pipeline_record(&r->mt, r->m, s + 1, &res.pp, err, errlen)) return RUN_FAIL;
  if (eval_due(p, s + 1)) {
    double el = 0;
    if (train_eval(&r->tr, &el, err, errlen)) return RUN_FAIL;
    metrics_eval(&r->mt, s + 1, el);
  }
  if (checkpoint_after_step(&r->ck, r->dp, s + 1, err, errlen)) return RUN_FAIL;
  if (r->ck.saved > 0 && !r->ck.pending) run_ckpt = r->ck.saved; /* committed, not still in flight */
  metrics_skip_traffic(&r->mt); /* a checkpoint's traffic is not a step's */
  r->stopped = hooks_stop(&r->a.hooks, s + 1, p->train.steps); /* as if killed here */
  int sig = p->checkpoint.on_signal && s + 1 < p->train.steps ? preempt_agreed(r->mesh, err, errlen) : 0;
  if (sig < 0) return RUN_FAIL;
  if (sig > 0) { /* preempted: this step's checkpoint, then the signal's exit status */
    int rc = train_read(&r->tr, err, errlen); /* first the values: a diverged state is not saved */
    if (rc) origin_name(&r->tr, &r->sg, r->env.rank, s, err, errlen);
    if (record_read(r, rc == 0) || rc) return RUN_FAIL;
    if (checkpoint_now(&r->ck, r->dp, s + 1, err, errlen)) {
      char why[sizeof r->err];
      snprintf(why, sizeof why, "%s", err);
      snprintf(err, errlen, "%s after step %d: the checkpoint failed: %.3900s", strsignal(sig), s + 1, why);
      return RUN_FAIL;
    }
    log_rank0("%s after step %d: checkpoint saved; exiting %d (128 + the signal); checkpoint.resume=auto continues",
              strsignal(sig), s + 1, 128 + sig);
    metrics_skip_traffic(&r->mt);
    r->preempt_exit = 128 + sig;
    r->stopped = 1;
  }
  return RUN_ON;
}

/* The loop, until the last step or a stop, and the checkpoints still in flight after it. */
static int run_train(run_t *r) {
  run_ckpt = r->start_step;
  run_phase = 1;
  progress_write(r->start_step);
  for (int s = r->start_step; s < r->p->train.steps && !r->stopped; s++)
    if (run_step_once(r, s)) return RUN_FAIL;
  if (checkpoint_finish(&r->ck, r->err, sizeof r->err)) return RUN_FAIL;
  run_phase = 2;
  return RUN_ON;
}

/* The final weights, then a sample; what failed without stopping the run decides the status. */
static int run_finish(run_t *r) {
  char *err = r->err;
  const size_t errlen = sizeof r->err;
  if (!r->stopped) {
    metrics_done(&r->mt);
    if (final_weights(r->m, r->dp, r->mesh, r->p, r->env.rank, r->plan_json, &r->no_restart, err, errlen) ||
        final_sample(r->m, r->be, r->dp, r->mesh, r->p, r->data.is_text, r->env.rank, err, errlen) ||
        checkpoint_final_status(&r->ck, err, errlen))
      return RUN_FAIL;
  }
  if (metrics_close(&r->mt, r->stopped ? NULL : &r->no_restart, err, errlen)) return RUN_FAIL;
  return RUN_ON;
}

/* The failure's report (a plan's one-liner, or the error file and meshrun's restart hint), then
 * everything acquired, released whatever step stopped; the exit status. */
static int run_end(run_t *r) {
  failing = r->code != 0;
  if (r->code && r->plan_failed) {
    fprintf(stderr, "%s\n", r->err);
    error_file_write(r->err, 0); /* a restart reads the same plan: meshrun is told not to try */
  } else if (r->code) {
    exit_error(r->code, r->err, !(r->no_restart || r->ck.no_restart));
  }
  checkpoint_free(&r->ck); /* a save still in flight (only after a failure) is waited for */
  dirlock_release();
  hooks_close(&r->a.hooks);
  metrics_free(&r->mt);
  straggler_free(&r->sg);
  dp_destroy(r->dp);
  train_free(&r->tr);
  data_free(&r->data);
  free(r->plan_json);
  pp_runner_free(&r->ppr);
  model_destroy(r->m);
  opprof_uninstall(r->be);
  backend_destroy(r->be);
  mesh_destroy(r->mesh);
  trace_close();
  free(r->p);
  return r->code ? r->code : r->preempt_exit;
}

/* ------------------------------------------------------------------------------------------ */

int main(int argc, char **argv) {
  if (argc > 1 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) {
    put_usage(usage_text);
    return 0;
  }
  if (argc > 1 && !strcmp(argv[1], "--version")) {
    printf("trainer (meshrun) %s, backends: %s\n", TRAINER_VERSION, device_backends());
    return 0;
  }
  ensure_passive_omp(argv);
  /* meshrun's --health_check runs this internal mode (not in --help) before a round. */
  if (argc == 2 && !strcmp(argv[1], "--health-gemm")) return health_gemm_main();
  install_sigterm();
  run_t r = {.code = 1};
  if (parse_args(&r.a, argc, argv, r.err, sizeof r.err) != 0 ||
      (!r.a.help && env_read(&r.env, r.err, sizeof r.err) != 0)) {
    fprintf(stderr, "trainer: %s\n", r.err);
    return 2;
  }
  if (r.a.help) {
    put_usage(r.a.sample_mode ? sample_usage_text : r.a.export_mode ? export_usage_text : usage_text);
    return 0;
  }
  char prefix[64];
  snprintf(prefix, sizeof prefix, "[trainer r%d/%d]", r.env.rank, r.env.world);
  log_init(prefix);
  log_set_rank(r.env.rank, r.env.world);

  /* The steps in order; the first that fails or finishes the command ends the run. */
  int prof_step = 0;
  int st = run_plan(&r, &prof_step);
  if (st == RUN_ON) st = run_device(&r, prof_step);
  if (st == RUN_ON) st = run_mesh(&r);
  if (st == RUN_ON) st = run_model(&r);
  if (st == RUN_ON) st = run_start(&r);
  if (st == RUN_ON) st = run_train(&r);
  if (st == RUN_ON) st = run_finish(&r);
  if (st != RUN_FAIL) r.code = 0;
  return run_end(&r);
}
