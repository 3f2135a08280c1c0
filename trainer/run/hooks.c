/* hooks: the test hooks of a training run (see hooks.h). */
#include "trainer/run/hooks.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/err.h"
#include "common/log.h"
#include "trainer/run/weights.h"

void hooks_init(hooks_t *h, int rank) {
  h->rank = rank;
  h->nan_rank = h->nan_step = -1;
  const char *s = getenv("MESHRUN_FAULT_NAN");
  if (s && sscanf(s, "%d:%d", &h->nan_rank, &h->nan_step) != 2) h->nan_rank = -1;
  h->slow_rank = h->slow_ms = -1;
  s = getenv("MESHRUN_FAULT_SLOW");
  if (s && (sscanf(s, "%d:%d", &h->slow_rank, &h->slow_ms) != 2 || h->slow_ms < 0)) h->slow_rank = -1;
  h->grad_rank = h->grad_step = -1;
  s = getenv("MESHRUN_FAULT_NAN_GRAD");
  if (s && sscanf(s, "%d:%d:%95s", &h->grad_rank, &h->grad_step, h->grad_tensor) != 3) h->grad_rank = -1;
  h->save_err = 0;
  char name[16] = "EIO";
  s = getenv("MESHRUN_FAULT_SAVE");
  if (s && sscanf(s, "%d:%d:%15s", &h->save_rank, &h->save_step, name) >= 2)
    h->save_err = !strcmp(name, "ENOSPC") ? ENOSPC : EIO;
  h->stall_rank = h->stall_step = -1;
  s = getenv("MESHRUN_FAULT_STALL");
  if (s && sscanf(s, "%d:%d", &h->stall_rank, &h->stall_step) != 2) h->stall_rank = -1;
  h->skip_rank = h->skip_step = -1;
  snprintf(h->skip_group, sizeof h->skip_group, "tp");
  s = getenv("MESHRUN_FAULT_SKIP");
  if (s && sscanf(s, "%d:%d:%15s", &h->skip_rank, &h->skip_step, h->skip_group) < 2) h->skip_rank = -1;
  h->spike_rank = h->spike_step[0] = h->spike_step[1] = -1;
  h->spike_now = 0;
  s = getenv("MESHRUN_FAULT_SPIKE");
  if (s && sscanf(s, "%d:%d:%d", &h->spike_rank, &h->spike_step[0], &h->spike_step[1]) < 2) h->spike_rank = -1;
}

int hooks_one_process(const hooks_t *h) { return h->dump_init || h->dump_batches; }

const char *hooks_step_fault(const hooks_t *h) {
  return h->nan_rank >= 0 ? "MESHRUN_FAULT_NAN" : h->grad_rank >= 0 ? "MESHRUN_FAULT_NAN_GRAD"
       : h->skip_rank >= 0 ? "MESHRUN_FAULT_SKIP" : NULL;
}

/* ckpt's hook: the "write" point of the faulty step fails with the chosen errno. */
static int save_fault(const char *point, int64_t step, void *arg) {
  const hooks_t *h = arg;
  return !strcmp(point, "write") && step == h->save_step ? h->save_err : 0;
}

void hooks_ckpt_writer(hooks_t *h, ckpt_writer_config_t *wc) {
  if (!h->save_err || h->save_rank != h->rank) return;
  wc->hook = save_fault;
  wc->hook_arg = h;
}

int hooks_initial_weights(hooks_t *h, model_t *m, dp_t *dp, const mesh_t *mesh, const char *plan_json, char *err,
                          size_t errlen) {
  if (!h->dump_init) return 0;
  return weights_save(m, dp, mesh, h->rank, h->dump_init, plan_json, 0, err, errlen);
}

int hooks_start(hooks_t *h, char *err, size_t errlen) {
  if (h->dump_batches && !(h->dump = fopen(h->dump_batches, "wb"))) {
    return err_set(err, errlen, -1, "cannot open %s: %s", h->dump_batches, strerror(errno));
  }
  return 0;
}

void hooks_spike(hooks_t *h, int step) {
  h->spike_now = h->spike_rank == h->rank && (step == h->spike_step[0] || step == h->spike_step[1]);
  if (h->spike_now) log_warn("MESHRUN_FAULT_SPIKE: this rank's targets of step %d are all token 0", step);
}

int hooks_batch(hooks_t *h, const int32_t *tok, int32_t *tgt, size_t n, char *err, size_t errlen) {
  for (size_t i = 0; h->spike_now && i < n; i++) tgt[i] = 0;
  if (h->dump && (fwrite(tok, sizeof(int32_t), n, h->dump) != n || fwrite(tgt, sizeof(int32_t), n, h->dump) != n)) {
    return err_set(err, errlen, -1, "cannot write %s: %s", h->dump_batches, strerror(errno));
  }
  return 0;
}

int hooks_nan_loss(const hooks_t *h, int step, int micro) {
  return h->nan_rank == h->rank && h->nan_step == step && micro == 0;
}

int hooks_nan_loss_pp(const hooks_t *h, int step, int last_stage) {
  if (!hooks_nan_loss(h, step, 0)) return 0;
  if (!last_stage) log_warn("MESHRUN_FAULT_NAN: this rank holds no loss (only the pipeline's last stage does); "
                            "nothing poisoned");
  return last_stage;
}

void hooks_nan_grad(const hooks_t *h, model_t *m, backend_t *be, dp_t *dp, int step) {
  if (!h || h->grad_rank != h->rank || h->grad_step != step) return;
  const model_tensor_t *x = model_find_tensor(m, h->grad_tensor);
  float *g = model_grads(m);
  /* without the flat buffer (FSDP, HSDP, ZeRO-2) the strategy poisons the unit's gradients
   * before it reduces them */
  if (!x || (!g && (!dp || dp_poison_grad(dp, x->name)))) {
    log_warn("MESHRUN_FAULT_NAN_GRAD: %s; nothing poisoned", !x ? "no such tensor here" : "no flat gradient buffer");
    return;
  }
  const float nan = NAN;
  log_warn("MESHRUN_FAULT_NAN_GRAD: this rank's gradient of %s turns nan in step %d", x->name, step);
  if (g) be->to_device(be, g + x->offset, &nan, sizeof nan);
}

void hooks_slow(const hooks_t *h) {
  if (!h || h->slow_rank != h->rank) return;
  struct timespec ts = {.tv_sec = h->slow_ms / 1000, .tv_nsec = (long)(h->slow_ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

void hooks_stall(const hooks_t *h, int step) {
  if (h->stall_rank != h->rank || h->stall_step != step) return;
  log_warn("MESHRUN_FAULT_STALL: stalling before step %d until a signal ends this process", step);
  for (;;) pause();
}

void hooks_skip(const hooks_t *h, int step, const mesh_t *mesh) {
  if (h->skip_rank != h->rank || h->skip_step != step) return;
  /* "ppact", "ppgrad": the pipeline's channels on which this rank sends (mesh.h) */
  comm_t *c = !mesh                               ? NULL
              : !strcmp(h->skip_group, "ppact")  ? mesh->pp.send_act
              : !strcmp(h->skip_group, "ppgrad") ? mesh->pp.send_grad
                                                 : mesh_comm(mesh, h->skip_group);
  if (!c) {
    log_warn("MESHRUN_FAULT_SKIP: the mesh has no group %s; nothing skipped", h->skip_group);
    return;
  }
  log_warn("MESHRUN_FAULT_SKIP: skipping this rank's next call of %s in step %d", comm_name(c), step);
  comm_skip_next(c);
}

int hooks_stop(const hooks_t *h, int step, int steps) {
  if (!h->stop_after || step != h->stop_after || step >= steps) return 0;
  log_rank0("stopping after step %d (--stop-after)", step);
  return 1;
}

void hooks_close(hooks_t *h) {
  if (h && h->dump) fclose(h->dump);
  if (h) h->dump = NULL;
}
