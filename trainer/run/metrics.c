/* metrics: console lines, JSONL records, traffic and memory reports (see metrics.h). */
#include "trainer/run/metrics.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "common/err.h"
#include "common/log.h"
#include "trainer/run/opprof.h"
#include "trainer/comm/comm.h"
#include "trainer/run/weights.h"

double metrics_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* 45678.9 -> "45,679" */
static void fmt_thousands(char *buf, size_t len, double x) {
  char digits[32];
  snprintf(digits, sizeof digits, "%.0f", x < 0 ? 0 : x);
  size_t n = strlen(digits), o = 0;
  for (size_t i = 0; i < n && o + 2 < len; i++) {
    if (i > 0 && (n - i) % 3 == 0) buf[o++] = ',';
    buf[o++] = digits[i];
  }
  buf[o] = 0;
}

static void fmt_duration(char *buf, size_t len, double s) {
  long t = (long)(s + 0.5);
  if (t >= 3600) snprintf(buf, len, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
  else snprintf(buf, len, "%ld:%02ld", t / 60, t % 60);
}

/* step: the record's step; 0 the first record; -1 the close. */
static void metrics_failed(metrics_t *mt, int e, int step) {
  mt->err = e ? e : EIO;
  if (step > 0) snprintf(mt->what, sizeof mt->what, "the record of step %d", step);
  else snprintf(mt->what, sizeof mt->what, "%s", step == 0 ? "the first record" : "the close");
  log_warn("log.metrics_file %s: %s failed: %s; no more records are written, and the run will exit 1 when it ends",
           mt->path, mt->what, strerror(mt->err));
}

static void metrics_printf(metrics_t *mt, int step, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void metrics_printf(metrics_t *mt, int step, const char *fmt, ...) {
  if (!mt->f || mt->err) return;
  va_list ap;
  va_start(ap, fmt);
  errno = 0;
  int n = vfprintf(mt->f, fmt, ap);
  va_end(ap);
  int e = errno;
  if (n >= 0 && fflush(mt->f) != 0) n = -1, e = errno;
  if (n < 0 || ferror(mt->f)) metrics_failed(mt, e, step);
}

/* Per-rank bytes of state (the strategy's, the model's bf16 compute copy counted with the
 * parameters, and the model's activation arena as allocated), and their maximum over the job. */
typedef struct {
  dp_memory_t mine, max;
  model_memory_t act, act_max;
} memory_report_t;

static int memory_report(dp_t *dp, model_t *m, comm_t *world, memory_report_t *r) {
  dp_memory(dp, &r->mine);
  model_memory(m, &r->act);
  r->mine.param_bytes += r->act.compute_bytes;
  r->max = r->mine;
  r->act_max = r->act;
  if (!world || comm_size(world) == 1) return 0;
  /* KiB in fp32 (the cpu comm's dtype): exact up to 16 GiB per rank. */
  float v[5] = {(float)(r->mine.param_bytes / 1024.0), (float)(r->mine.grad_bytes / 1024.0),
                (float)(r->mine.optim_bytes / 1024.0), (float)(r->mine.work_bytes / 1024.0),
                (float)(r->act.act_bytes / 1024.0)};
  if (comm_all_reduce(world, v, 5, DT_F32, COMM_MAX)) return -1;
  r->max.param_bytes = (size_t)((double)v[0] * 1024.0);
  r->max.grad_bytes = (size_t)((double)v[1] * 1024.0);
  r->max.optim_bytes = (size_t)((double)v[2] * 1024.0);
  r->max.work_bytes = (size_t)((double)v[3] * 1024.0);
  r->act_max.act_bytes = (size_t)((double)v[4] * 1024.0);
  return 0;
}

/* ",\"comm\":{...}" with the bytes this rank sent since the last call, or "" without a mesh.
 * The groups' totals include main's loss and norm reductions: a group's host comm is counted
 * with its device comm when they differ, so every comm backend reports the same totals. */
static void traffic_step(metrics_t *mt, char *out, size_t len) {
  out[0] = 0;
  const mesh_t *mesh = mt->mesh;
  if (!mesh) return;
  metrics_traffic_t now, *last = &mt->traffic;
  dp_traffic(mt->dp, &now.dp);
  int o = snprintf(out, len, ",\"comm\":{\"all_reduce\":%llu,\"all_gather\":%llu,\"reduce_scatter\":%llu,"
                   "\"broadcast\":%llu",
                   (unsigned long long)(now.dp.all_reduce - last->dp.all_reduce),
                   (unsigned long long)(now.dp.all_gather - last->dp.all_gather),
                   (unsigned long long)(now.dp.reduce_scatter - last->dp.reduce_scatter),
                   (unsigned long long)(now.dp.broadcast - last->dp.broadcast));
  for (int g = 0; g < MESH_NGROUPS; g++) {
    if (g >= MESH_GROUP_CP && mesh->dims[MESH_CP] == 1) continue; /* no context parallelism: no cp groups */
    comm_stats_t st;
    mesh_group_stats(mesh, g, &st);
    now.group[g] = st.bytes_sent;
    if (o > 0 && (size_t)o < len)
      o += snprintf(out + o, len - (size_t)o, ",\"%s\":%llu", mesh->groups[g].name,
                    (unsigned long long)(now.group[g] - last->group[g]));
  }
  if (o > 0 && (size_t)o < len) snprintf(out + o, len - (size_t)o, "}");
  *last = now;
}

void metrics_skip_traffic(metrics_t *mt) {
  char comm_json[512];
  traffic_step(mt, comm_json, sizeof comm_json);
}

double metrics_flops_per_token(const plan_t *p) {
  const plan_model_t *c = &p->model;
  const double d = c->dim, head = (double)c->dim / c->n_heads, kv = head * c->n_kv_heads;
  const double hidden = c->hidden_dim > 0 ? c->hidden_dim : plan_llama_hidden_dim(c->dim, c->multiple_of,
                                                                                   c->ffn_dim_multiplier);
  /* wq, wo (d x d), wk, wv (d x kv), w1, w3, w2 (d x hidden) per layer; the output (vocab x d) */
  const double n = c->n_layers * (2 * d * d + 2 * d * kv + 3 * d * hidden) + (double)c->vocab_size * d;
  return 6 * n + 12.0 * c->n_layers * d * p->train.seq_len;
}

size_t metrics_peak_rss(void) {
  struct rusage ru;
  return getrusage(RUSAGE_SELF, &ru) == 0 ? (size_t)ru.ru_maxrss * 1024 : 0; /* Linux: KiB */
}

int metrics_open(metrics_t *mt, const plan_t *p, model_t *m, dp_t *dp, const mesh_t *mesh, const data_t *data,
                 const backend_t *be, int rank, int world, int start_step, int resumed, const char *plan_json,
                 char *err, size_t errlen) {
  memset(mt, 0, sizeof *mt);
  mt->p = p;
  mt->dp = dp;
  mt->mesh = mesh;
  mt->be = (backend_t *)be;
  mt->path = p->log.metrics_file;
  mt->steps = p->train.steps;
  mt->start_step = start_step;
  const int T = p->train.seq_len, B = p->train.micro_batch_size, accum = p->train.grad_accum_steps;
  const int tp = mesh ? mesh->dims[MESH_TP] : 1;
  mt->tokens_per_step = (long long)p->train.global_batch_size * T;
  mt->flops_per_token = metrics_flops_per_token(p);
  mt->world = world;
  mt->rank = rank;
  mt->peak_flops = p->log.peak_tflops > 0 ? p->log.peak_tflops * 1e12
                   : mt->be->peak_flops     ? mt->be->peak_flops(mt->be, model_param_dtype(m))
                                            : 0;

  /* --- memory per rank (this rank's, and the largest of any rank) */
  memory_report_t mem;
  comm_t *wc = mesh ? mesh_host_comm(mesh, "world") : NULL;
  if (memory_report(dp, m, wc, &mem)) {
    return err_set(err, errlen, -1, "%s", comm_errmsg(wc));
  }
  size_t np = model_num_params(m);
  const int pp = mesh ? mesh->dims[MESH_PP] : 1;
  if (pp > 1) { /* the stages' counts add up, in 12-bit digits (sums of up to 4096 stay exact in fp32) */
    comm_t *ppc = mesh_host_comm(mesh, "pp");
    float digit[4];
    for (int i = 0; i < 4; i++) digit[i] = (float)((np >> (12 * i)) & 0xfff);
    if (comm_all_reduce(ppc, digit, 4, DT_F32, COMM_SUM)) {
      return err_set(err, errlen, -1, "%s", comm_errmsg(ppc));
    }
    np = 0;
    for (int i = 0; i < 4; i++) np += (size_t)digit[i] << (12 * i);
  }
  char pp_dim[32] = "", cp_dim[32] = "";
  if (pp > 1) snprintf(pp_dim, sizeof pp_dim, "pp %d x ", pp);
  if (mesh && mesh->dims[MESH_CP] > 1) snprintf(cp_dim, sizeof cp_dim, "cp %d x ", mesh->dims[MESH_CP]);
  if (mesh)
    log_rank0("mesh %sdp_replicate %d x dp_shard %d x %stp %d: %s; per rank: parameters %.2f MiB, gradients %.2f MiB, "
              "optimizer state %.2f MiB, working buffers %.2f MiB, activations %.2f MiB (max over ranks: %.2f / "
              "%.2f / %.2f / %.2f / %.2f MiB)",
              pp_dim, mesh->dims[MESH_DP_REPLICATE], mesh->dims[MESH_DP_SHARD], cp_dim, tp, dp->name,
              mem.mine.param_bytes / 1048576.0, mem.mine.grad_bytes / 1048576.0, mem.mine.optim_bytes / 1048576.0,
              mem.mine.work_bytes / 1048576.0, mem.act.act_bytes / 1048576.0, mem.max.param_bytes / 1048576.0,
              mem.max.grad_bytes / 1048576.0, mem.max.optim_bytes / 1048576.0, mem.max.work_bytes / 1048576.0,
              mem.act_max.act_bytes / 1048576.0);

  /* --- the metrics file (rank 0) */
  if (rank == 0 && p->log.metrics_file[0]) {
    if (weights_make_parent_dirs(p->log.metrics_file, err, errlen)) return -1;
    /* A resumed run appends: the steps before the checkpoint stay; steps logged after it by the
     * run that stopped are logged again (readers take the last record of a step). */
    if (!(mt->f = fopen(p->log.metrics_file, resumed ? "a+" : "w"))) {
      return err_set(err, errlen, -1, "cannot open log.metrics_file %s: %s", p->log.metrics_file, strerror(errno));
    }
    /* A killed writer's torn last line stays a line of its own (reads and writes of an update
     * stream are separated by a seek). */
    int torn = resumed && fseek(mt->f, -1, SEEK_END) == 0 && fgetc(mt->f) != '\n';
    fseek(mt->f, 0, SEEK_END);
    metrics_printf(mt, 0,
                   "%s{\"plan\":%s,\"num_params\":%zu,\"world_size\":%d,\"tokens_per_step\":%lld,\"data_tokens\":%zu,\"val_tokens\":%zu,"
                   "\"strategy\":\"%s\",\"mesh\":[%d,%d,%d],\"param_bytes\":%zu,\"grad_bytes\":%zu,\"optim_bytes\":%zu,"
                   "\"work_bytes\":%zu,\"param_bytes_max\":%zu,\"grad_bytes_max\":%zu,\"optim_bytes_max\":%zu,"
                   "\"work_bytes_max\":%zu,\"act_bytes\":%zu,\"act_block_bytes\":%zu,\"act_bytes_max\":%zu,"
                   "\"param_dtype\":\"%s\",\"reduce_dtype\":\"%s\",\"start_step\":%d}\n",
                   torn ? "\n" : "", plan_json ? plan_json : "{}", np, world, mt->tokens_per_step, data->n_train, data->n_val,
                   dp->name, mesh ? mesh->dims[MESH_DP_REPLICATE] : 1, mesh ? mesh->dims[MESH_DP_SHARD] : 1, tp,
                   mem.mine.param_bytes, mem.mine.grad_bytes, mem.mine.optim_bytes, mem.mine.work_bytes,
                   mem.max.param_bytes, mem.max.grad_bytes, mem.max.optim_bytes, mem.max.work_bytes,
                   mem.act.act_bytes, mem.act.act_block_bytes, mem.act_max.act_bytes,
                   dtype_name(model_param_dtype(m)), dtype_name(p->parallel.reduce_dtype),
                   start_step);
  }
  if (rank == 0 && p->log.tensorboard_dir[0] &&
      tensorboard_open(&mt->tb, p->log.tensorboard_dir, start_step + 1, err, errlen))
    return -1;

  const int dp_size = mesh ? comm_size(mesh_host_comm(mesh, "dp")) : 1;
  const int encoded = data->format == PLAN_DATA_TEXT && !data->is_text; /* text through data.tokenizer */
  log_rank0("%s: %.2fM parameters%s, %d layers, dim %d, %s data %s%s%s (%zu train / %zu val tokens), "
            "%d steps of %lld tokens (%d x %d x %d accum x %d dp), %s backend",
            p->source, (double)np / 1e6, tp > 1 ? " per tp rank" : "", p->model.n_layers, p->model.dim,
            data_format_name(data->format), data->format == PLAN_DATA_SYNTHETIC ? "" : p->data.train,
            encoded ? " encoded by " : "", encoded ? p->data.tokenizer : "", data->n_train, data->n_val, mt->steps,
            mt->tokens_per_step, B, T, accum, dp_size, be->name);

  metrics_skip_traffic(mt); /* start counting here */
  mt->t_loop = metrics_now();
  return 0;
}

int metrics_line_due(const plan_t *p, int step) {
  const int interval = p->log.interval;
  return interval > 0 && (step % interval == 0 || step == 1 || step == p->train.steps);
}

void metrics_step_done(metrics_t *mt, int step, double lr, double dt, double comm_wait) {
  mt->t_in_steps += dt;
  if (mt->npend == mt->cap) {
    int cap = mt->cap ? 2 * mt->cap : 16;
    metrics_pending_t *v = realloc(mt->pend, (size_t)cap * sizeof *v);
    if (!v) {
      log_warn("out of memory for the record of step %d: it is not written", step);
      metrics_skip_traffic(mt);
      return;
    }
    mt->pend = v;
    mt->cap = cap;
  }
  metrics_pending_t *q = &mt->pend[mt->npend++];
  *q = (metrics_pending_t){.step = step, .lr = lr, .dt = dt, .comm_wait = comm_wait};
  /* peak memory: the device allocator's where there is one, else resident memory */
  q->rss = mt->be && mt->be->mem_peak ? mt->be->mem_peak(mt->be) : metrics_peak_rss();
  traffic_step(mt, q->comm, sizeof q->comm);
  /* what the step asked of the device, where the backend is counted (opprof) */
  opcount_t c;
  opprof_counts(NULL, &c);
  q->kernels = c.kernels;
  q->host_syncs = c.host_syncs;
  q->graph = mt->step_graph;
}

/* A skipped step's line (train.skip_*): why, in the words of the key that skipped it. */
static void skip_line(const metrics_t *mt, int step, double loss, double gnorm, const skip_verdict_t *v) {
  const plan_train_t *t = &mt->p->train;
  switch (v->why) {
  case SKIP_LOSS_NONFINITE: log_rank0("step %d skipped: loss %g (train.skip_nonfinite)", step, loss); break;
  case SKIP_NORM_NONFINITE: log_rank0("step %d skipped: gradient norm %g (train.skip_nonfinite)", step, gnorm); break;
  case SKIP_LOSS_Z:
  case SKIP_NORM_Z: {
    const int is_loss = v->why == SKIP_LOSS_Z;
    log_rank0("step %d skipped: %s %.4g, z-score %.1f over train.%s %g (window mean %.4g, std %.3g)", step,
              is_loss ? "loss" : "gradient norm", is_loss ? loss : gnorm, v->z, is_loss ? "skip_loss_z" : "skip_grad_z",
              is_loss ? t->skip_loss_z : t->skip_grad_z, v->mean, v->std);
    break;
  }
  default: break;
  }
}

/* Step q's record and, when due, its console line; sk: its skip verdict (NULL: the keys are off);
 * sp: the spread of the ranks' compute time. */
static void step_record(metrics_t *mt, const metrics_pending_t *q, double loss, double gnorm,
                        const skip_verdict_t *sk, const straggler_stat_t *sp) {
  const int step = q->step;
  const double dt = q->dt, comm_wait = q->comm_wait, lr = q->lr;
  const double tps = (double)mt->tokens_per_step / dt;
  const double flops = tps * mt->flops_per_token / mt->world; /* per rank */
  const double mfu = mt->peak_flops > 0 ? flops / mt->peak_flops : 0;
  char mfu_json[32] = "null";
  if (mt->peak_flops > 0) snprintf(mfu_json, sizeof mfu_json, "%.6f", mfu);
  char counts[192] = "";
  static const char *const graph[] = {"", ",\"graph\":\"recorded\"", ",\"graph\":\"replayed\""};
  int at = 0;
  if (sk) {
    at = snprintf(counts, sizeof counts, ",\"skipped\":%d,\"skipped_total\":%d", sk->why ? 1 : 0, sk->total);
    mt->skipped_total = sk->total;
    if (sk->why) skip_line(mt, step, loss, gnorm, sk);
  }
  if (q->kernels)
    snprintf(counts + at, sizeof counts - (size_t)at, ",\"kernels\":%llu,\"host_syncs\":%llu%s",
             (unsigned long long)q->kernels, (unsigned long long)q->host_syncs,
             graph[q->graph > 0 && q->graph < 3 ? q->graph : 0]);
  char loss_s[32] = "null", gnorm_s[32] = "null"; /* JSON has no nan: a skipped step's may be one */
  if (isfinite(loss)) snprintf(loss_s, sizeof loss_s, "%.9g", loss);
  if (isfinite(gnorm)) snprintf(gnorm_s, sizeof gnorm_s, "%.9g", gnorm);
  metrics_printf(mt, step,
                 "{\"step\":%d,\"loss\":%s,\"lr\":%.9g,\"grad_norm\":%s,\"tokens_per_s\":%.1f,"
                 "\"flops_per_s\":%.6g,\"mfu\":%s,\"peak_mem_bytes\":%zu,"
                 "\"step_ms\":%.3f,\"compute_ms\":%.3f,\"comm_wait_ms\":%.3f,\"compute_ms_min\":%.3f,"
                 "\"compute_ms_median\":%.3f,\"compute_ms_max\":%.3f,\"slowest_rank\":%d,\"straggler_spread_pct\":%.3f%s%s}\n",
                 step, loss_s, lr, gnorm_s, tps, flops, mfu_json, q->rss, dt * 1e3, (dt - comm_wait) * 1e3,
                 comm_wait * 1e3, sp->min_ms, sp->median_ms, sp->max_ms, sp->slowest, sp->over_pct, counts, q->comm);
  if (metrics_line_due(mt->p, step)) {
    char tps_s[32], eta[32];
    fmt_thousands(tps_s, sizeof tps_s, tps);
    double per_step = (metrics_now() - mt->t_loop) / (step - mt->start_step);
    fmt_duration(eta, sizeof eta, per_step * (mt->steps - step));
    char share[32] = ""; /* the exposed communication's share of the step, where there is a mesh */
    if (mt->mesh) snprintf(share, sizeof share, " | comm %.0f%%", dt > 0 ? 100.0 * comm_wait / dt : 0.0);
    /* tokens/s are the job's, FLOP/s (and MFU) each rank's: with several ranks the labels say so */
    const int many = mt->world > 1;
    char fl[64]; /* FLOP/s per rank, and MFU where the peak is known */
    int k = snprintf(fl, sizeof fl, "%.3g %sFLOP/s%s", flops >= 1e12 ? flops / 1e12 : flops / 1e9,
                     flops >= 1e12 ? "T" : "G", many ? "/rank" : "");
    if (mt->peak_flops > 0) snprintf(fl + k, sizeof fl - (size_t)k, " | MFU %.1f%%", 100 * mfu);
    char slow[STRAGGLER_HOST_MAX + 64] = ""; /* the slowest rank, when over log.straggler_pct */
    if (sp->over)
      snprintf(slow, sizeof slow, " | straggler rank %d (%s) +%.0f%% over the median", sp->slowest, sp->host,
               sp->over_pct);
    log_rank0("step %d/%d | loss %.4f | lr %.2e | grad norm %.4f | %s tok/s%s | %s | mem %.0f MiB | %.1f ms%s%s | ETA %s",
              step, mt->steps, loss, lr, gnorm, tps_s, many ? " (job)" : "", fl, q->rss / 1048576.0, dt * 1e3,
              share, slow, eta);
  }
  tensorboard_t *tb = mt->tb; /* NULL: no events (every call does nothing) */
  tensorboard_add(tb, "train/loss", loss);
  tensorboard_add(tb, "train/lr", lr);
  tensorboard_add(tb, "train/grad_norm", gnorm);
  tensorboard_add(tb, "train/tokens_per_s", tps);
  tensorboard_add(tb, "train/flops_per_s", flops);
  if (mt->peak_flops > 0) tensorboard_add(tb, "train/mfu", mfu);
  tensorboard_add(tb, "train/peak_mem_bytes", (double)q->rss);
  tensorboard_add(tb, "train/step_ms", dt * 1e3);
  tensorboard_add(tb, "train/compute_ms", (dt - comm_wait) * 1e3);
  tensorboard_add(tb, "train/comm_wait_ms", comm_wait * 1e3);
  tensorboard_add(tb, "train/straggler_spread_pct", sp->over_pct);
  tensorboard_write(tb, step);
}

void metrics_step_values(metrics_t *mt, int n, const double *loss, const double *gnorm, const skip_verdict_t *skip,
                         const straggler_stat_t *spread) {
  if (n > mt->npend) n = mt->npend;
  for (int i = 0; i < n; i++) {
    const metrics_pending_t *q = &mt->pend[i];
    const double own = (q->dt - q->comm_wait) * 1e3; /* without a spread: this rank's alone */
    const straggler_stat_t mine = {.min_ms = own, .median_ms = own, .max_ms = own, .slowest = mt->rank, .host = ""};
    step_record(mt, q, loss[i], gnorm[i], skip ? &skip[i] : NULL, spread ? &spread[i] : &mine);
  }
  memmove(mt->pend, mt->pend + n, (size_t)(mt->npend - n) * sizeof *mt->pend);
  mt->npend -= n;
}

void metrics_step(metrics_t *mt, int step, double loss, double lr, double gnorm, double dt, double comm_wait) {
  metrics_step_done(mt, step, lr, dt, comm_wait);
  metrics_step_values(mt, 1, &loss, &gnorm, NULL, NULL);
}

int metrics_pipeline(metrics_t *mt, int step, double busy_ms, double span_ms, int peak_inflight, size_t act_bytes,
                     char *err, size_t errlen) {
  enum { BUSY, SPAN, INFLIGHT, ACT, N };
  static const char *const keys[N] = {"pp_busy_ms", "pp_span_ms", "pp_peak_inflight", "pp_act_bytes"};
  comm_t *c = mesh_host_comm(mt->mesh, "pp");
  const int Q = comm_size(c);
  const float mine[N] = {(float)busy_ms, (float)span_ms, (float)peak_inflight, (float)act_bytes};
  float *all = malloc((size_t)Q * N * sizeof(float));
  if (!all) {
    return err_set(err, errlen, -1, "out of memory for the pipeline's record");
  }
  if (comm_all_gather(c, mine, all, N, DT_F32)) {
    err_set(err, errlen, 0, "gathering the pipeline's timings: %s", comm_errmsg(c));
    free(all);
    return -1;
  }
  char rec[4096];
  int at = snprintf(rec, sizeof rec, "{\"pp_step\":%d,\"pp_bubble\":[", step);
  for (int q = 0; q < Q && at < (int)sizeof rec; q++) {
    const float busy = all[q * N + BUSY], span = all[q * N + SPAN];
    at += snprintf(rec + at, sizeof rec - (size_t)at, "%s%.4f", q ? "," : "", span > 0 ? 1.0 - busy / span : 0.0);
  }
  for (int k = 0; k < N && at < (int)sizeof rec; k++) {
    at += snprintf(rec + at, sizeof rec - (size_t)at, "],\"%s\":[", keys[k]);
    for (int q = 0; q < Q && at < (int)sizeof rec; q++)
      at += snprintf(rec + at, sizeof rec - (size_t)at, k <= SPAN ? "%s%.3f" : "%s%.0f", q ? "," : "", all[q * N + k]);
  }
  if (at < (int)sizeof rec - 3) metrics_printf(mt, step, "%s]}\n", rec);
  free(all);
  return 0;
}

void metrics_eval(metrics_t *mt, int step, double loss) {
  const plan_t *p = mt->p;
  metrics_printf(mt, step, "{\"step\":%d,\"eval_loss\":%.9g}\n", step, loss);
  tensorboard_add(mt->tb, "eval/loss", loss);
  tensorboard_write(mt->tb, step);
  log_rank0("step %d/%d | eval loss %.4f (%d batches of %d x %d)", step, mt->steps, loss, p->eval.batches,
            p->train.micro_batch_size, p->train.seq_len);
  metrics_skip_traffic(mt); /* eval traffic is not a step's */
}

void metrics_done(metrics_t *mt) {
  if (mt->steps <= mt->start_step) return;
  char tps_s[32], total[32];
  fmt_thousands(tps_s, sizeof tps_s, (double)mt->tokens_per_step * (mt->steps - mt->start_step) / mt->t_in_steps);
  fmt_duration(total, sizeof total, metrics_now() - mt->t_loop);
  char skipped[64] = "";
  if (plan_skips(mt->p))
    snprintf(skipped, sizeof skipped, "; %d step%s skipped", mt->skipped_total, mt->skipped_total == 1 ? "" : "s");
  log_rank0("done: %d steps in %s, %s tok/s on average%s", mt->steps - mt->start_step, total, tps_s, skipped);
}

int metrics_close(metrics_t *mt, int *no_space, char *err, size_t errlen) {
  const int tb_failed = tensorboard_close(mt->tb, no_space, err, errlen) != 0;
  mt->tb = NULL;
  if (mt->f && fclose(mt->f) != 0 && !mt->err) metrics_failed(mt, errno, -1);
  mt->f = NULL;
  if (!mt->err) return tb_failed ? -1 : 0;
  err_set(err, errlen, 0, "log.metrics_file %s: %s failed: %s (the records from there on are lost)", mt->path, mt->what,
          strerror(mt->err));
  if (no_space) *no_space = mt->err == ENOSPC || mt->err == EDQUOT;
  return -1;
}

void metrics_free(metrics_t *mt) {
  if (!mt) return;
  if (mt->f) fclose(mt->f);
  mt->f = NULL;
  free(mt->pend);
  mt->pend = NULL;
  mt->npend = mt->cap = 0;
  tensorboard_close(mt->tb, NULL, NULL, 0);
  mt->tb = NULL;
}
