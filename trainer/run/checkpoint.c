/* checkpoint: the run's save and resume policy over trainer/formats/ckpt (see checkpoint.h). */
#include "trainer/run/checkpoint.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/log.h"

/* train.skip_*'s window as a checkpoint tensor: its losses, then its norms. */
static const model_tensor_t skip_tensor = {.name = "window", .numel = 2 * SKIP_WINDOW, .ndim = 1,
                                           .shape = {2 * SKIP_WINDOW, 1}, .tp_split = MODEL_TP_REPLICATED};

/* The window into the save: its counts as extras, its values (every rank holds the same) into buf
 * (2 * SKIP_WINDOW floats that live until the save) and, on rank 0, as a chunk. 0 or CKPT_ENOMEM. */
static int skip_save(checkpoint_t *c, ckpt_state_t *st, ckpt_chunks_t *cs, float *buf) {
  skip_window_t w;
  c->skip_be->to_host(c->skip_be, &w, c->skip_dev, sizeof w);
  memcpy(buf, w.loss, sizeof w.loss);
  memcpy(buf + SKIP_WINDOW, w.norm, sizeof w.norm);
  const char *keys[3] = {"skip_window_n", "skip_window_next", "skip_total"};
  const int32_t vals[3] = {w.n, w.next, w.total};
  for (int i = 0; i < 3; i++) {
    char v[16];
    snprintf(v, sizeof v, "%d", vals[i]);
    ckpt_state_set(st, keys[i], v);
  }
  return c->rank == 0 ? ckpt_chunks_add_range(cs, "skip", &skip_tensor, 1, 0, 0, 2 * SKIP_WINDOW, buf) : 0;
}

static int save(checkpoint_t *c, dp_t *dp, int step, char *err, size_t errlen) {
  const plan_t *p = c->p;
  ckpt_state_t st;
  memset(&st, 0, sizeof st);
  st.step = step;
  st.optim_step = dp_optim_step(dp);
  st.data_position = (uint64_t)step * (uint64_t)p->train.global_batch_size;
  char v[64];
  snprintf(v, sizeof v, "%llu", (unsigned long long)p->seed);
  ckpt_state_set(&st, "seed", v);
  snprintf(v, sizeof v, "%d", p->train.global_batch_size);
  ckpt_state_set(&st, "global_batch_size", v);
  snprintf(v, sizeof v, "%d", p->train.steps);
  ckpt_state_set(&st, "train_steps", v);
  snprintf(v, sizeof v, "%llu", (unsigned long long)c->data_tokens);
  ckpt_state_set(&st, "data_tokens", v);
  ckpt_chunks_t cs = {0};
  float *host = NULL;
  /* A rank that cannot copy still joins the collective save, with n_chunks -1: the save then
   * fails on every rank instead of leaving the others waiting. (No chunks would not do: the
   * coverage check sees only tensors some rank saved, so when this rank was the only holder of
   * a tensor, e.g. DDP's rank 0 of every parameter, a checkpoint without it would commit.) */
  char cerr[256] = "";
  int crc = dp_ckpt_to_host(dp, &cs, &host, cerr, sizeof cerr);
  float skip_buf[2 * SKIP_WINDOW];
  if (!crc && c->skip_dev && skip_save(c, &st, &cs, skip_buf))
    crc = err_set(cerr, sizeof cerr, -1, "out of memory for the chunk of train.skip_*'s window");
  int rc = ckpt_writer_save(c->w, &st, crc ? NULL : cs.v, crc ? -1 : cs.n, err, errlen);
  if (crc) err_set(err, errlen, 0, "%s", cerr);
  ckpt_chunks_free(&cs);
  free(host);
  return rc ? rc : crc ? CKPT_EINVAL : 0;
}

/* What a failed save (or the commit of an asynchronous one) of step `step` means for the run.
 * Every rank gets the same rc and message from the writer, so every rank decides alike:
 * - a lack of space (CKPT_ENOSPC) stops the run at once (-1, no_restart set): a restart would
 *   fail the same way, so meshrun is asked not to spend one;
 * - a broken collective (CKPT_ECOMM) stops it too (-1): the group cannot save, nor train;
 * - anything else is one warning (rank 0) and the run goes on (0): the writer removed the
 *   save's .tmp and the next save may succeed. When it was the save after the last step,
 *   final_failed is set and final_err keeps the cause, for the exit status at the end. */
static int failed(checkpoint_t *c, int rc, int step, char *err, size_t errlen) {
  const int is_final = step == c->p->train.steps;
  if (rc == 0) return 0;
  if (rc == CKPT_ENOSPC || rc == CKPT_ECOMM) {
    char cause[2048];
    snprintf(cause, sizeof cause, "%s", err);
    err_set(err, errlen, 0, "the checkpoint of step %d failed, stopping: %s", step, cause);
    if (rc == CKPT_ENOSPC) c->no_restart = 1;
    return -1;
  }
  if (c->rank == 0)
    log_warn("the checkpoint of step %d failed (%s)%s", step, err,
             is_final ? "; the final weights are saved next, and the run will exit 1" : "; training goes on");
  if (is_final) c->final_failed = 1;
  return 0;
}

int checkpoint_peek(plan_t *p, char *from, size_t fromlen, int *carried) {
  *carried = 0;
  from[0] = 0;
  if (!strcmp(p->checkpoint.resume, "none")) return 0;
  ckpt_state_t st;
  int rc = ckpt_peek(p->checkpoint.dir[0] ? p->checkpoint.dir : ".", p->checkpoint.resume, &st, from, fromlen);
  if (rc == CKPT_ECORRUPT) return 1;
  if (rc) return 0;
  const char *g = ckpt_state_get(&st, "global_batch_size");
  unsigned long long G = g ? strtoull(g, NULL, 10) : st.step > 0 ? st.data_position / (uint64_t)st.step : 0;
  if (p->train.global_batch_size == 0 && G > 0 && G <= INT_MAX) {
    p->train.global_batch_size = (int)G;
    *carried = 1;
  }
  return 1;
}

/* The window the checkpoint carries, into skip_loaded (none: it was saved without train.skip_*,
 * or the keys are off now). 0, or 2 with the message in err when it cannot be read or its counts
 * are not a window's. */
static int skip_load(checkpoint_t *c, ckpt_t *ck, char *err, size_t errlen) {
  const ckpt_meta_t *meta = ckpt_meta(ck);
  if (!plan_skips(c->p) || !ckpt_has(ck, "skip", "window")) return 0;
  float buf[2 * SKIP_WINDOW];
  if (ckpt_read_tensor(ck, "skip", "window", buf, 2 * SKIP_WINDOW, err, errlen)) return 2;
  const char *n = ckpt_state_get(&meta->state, "skip_window_n"), *next = ckpt_state_get(&meta->state, "skip_window_next");
  const char *total = ckpt_state_get(&meta->state, "skip_total");
  skip_window_t *w = &c->skip_loaded;
  memset(w, 0, sizeof *w);
  w->n = n ? atoi(n) : -1;
  w->next = next ? atoi(next) : -1;
  w->total = total ? atoi(total) : -1;
  if (w->n < 0 || w->n > SKIP_WINDOW || w->next < 0 || w->next >= SKIP_WINDOW || w->total < 0)
    return err_set(err, errlen, 2, "checkpoint error: %s: train.skip_*'s window has counts n %s, next %s, total %s, "
                   "not those of a window of %d", meta->path, n ? n : "(none)", next ? next : "(none)",
                   total ? total : "(none)", SKIP_WINDOW);
  memcpy(w->loss, buf, sizeof w->loss);
  memcpy(w->norm, buf + SKIP_WINDOW, sizeof w->norm);
  c->skip_resumed = 1;
  return 0;
}

/* checkpoint.resume: "none", "auto" or a step directory. Sets *start_step (0: fresh); returns
 * 0, 2 or 1 as checkpoint_open does. Collective. */
static int resume(checkpoint_t *c, dp_t *dp, int world, int restart, int round, int *start_step, int *resumed,
                  char *err, size_t errlen) {
  const plan_t *p = c->p;
  *start_step = 0;
  *resumed = 0;
  const char *which = p->checkpoint.resume;
  if (!strcmp(which, "none")) return 0;
  ckpt_shape_t shape;
  ckpt_shape_from_plan(&shape, &p->model);
  ckpt_t *ck = NULL;
  int rc = ckpt_open(&ck, p->checkpoint.dir[0] ? p->checkpoint.dir : ".", which, &shape, c->cg, err, errlen);
  if (rc == CKPT_ENOENT && !strcmp(which, "auto")) {
    log_rank0("checkpoint.resume auto: no checkpoint in %s; starting from step 0", p->checkpoint.dir);
    return 0;
  }
  if (rc == CKPT_ECORRUPT && !strcmp(which, "auto")) { /* damage a restart would read again */
    char *nl = strchr(err, '\n');
    if (nl) *(nl > err && nl[-1] == ':' ? nl - 1 : nl) = 0;
    size_t n = strlen(err);
    snprintf(err + n, errlen - n, " (each named above): move %s away, or start over in it with "
             "checkpoint.resume=none and overwrite=true", p->checkpoint.dir);
    return 2;
  }
  if (rc) return rc == CKPT_ESHAPE || rc == CKPT_ENOENT || rc == CKPT_ECORRUPT || rc == CKPT_ENONFINITE ? 2 : 1;
  const ckpt_meta_t *meta = ckpt_meta(ck);
  const uint64_t G = (uint64_t)p->train.global_batch_size, step = (uint64_t)meta->state.step;
  const uint64_t pos = meta->state.data_position;
  if (step ? pos % step != 0 : pos != 0) { /* no global batch explains it (the metadata checksum passed) */
    err_set(err, errlen, 0,
            "checkpoint error: %s: data_position %llu is not a whole number of batches of its %llu "
            "steps: the checkpoint is inconsistent",
            meta->path, (unsigned long long)pos, (unsigned long long)step);
    ckpt_close(ck);
    return 1;
  }
  if (meta->state.data_position != step * G) {
    err_set(err, errlen, 0,
            "checkpoint error: %s consumed %llu samples in %llu steps (global batch %llu) but this "
            "plan's train.global_batch_size is %llu: the data order would not continue; set "
            "train.global_batch_size=%llu",
            meta->path, (unsigned long long)meta->state.data_position, (unsigned long long)step,
            step ? (unsigned long long)(meta->state.data_position / step) : 0ULL, (unsigned long long)G,
            step ? (unsigned long long)(meta->state.data_position / step) : 0ULL);
    ckpt_close(ck);
    return 2;
  }
  if (step > (uint64_t)p->train.steps) {
    err_set(err, errlen, 0, "checkpoint error: %s is at step %llu, beyond train.steps %d", meta->path,
            (unsigned long long)step, p->train.steps);
    ckpt_close(ck);
    return 2;
  }
  /* Another dataset size: the batches are drawn over other offsets, so the run goes on but no
   * longer reads what the uninterrupted one would have (older checkpoints have no count). */
  const char *saved_tokens = ckpt_state_get(&meta->state, "data_tokens");
  if (saved_tokens && strtoull(saved_tokens, NULL, 10) != c->data_tokens && c->rank == 0)
    log_warn("%s was saved over a dataset of %s tokens, this run's has %llu: the data changed, so the batches "
             "after step %llu are not those the run would have read", meta->path, saved_tokens,
             (unsigned long long)c->data_tokens, (unsigned long long)step);
  if (dp_ckpt_from_host(dp, ck, err, errlen)) {
    ckpt_close(ck);
    return 1;
  }
  if ((rc = skip_load(c, ck, err, errlen))) {
    ckpt_close(ck);
    return rc;
  }
  dp_set_optim_step(dp, (int)meta->state.optim_step);
  log_rank0("resumed from %s (step %llu, saved by world %d, now world %d, restart %d, round %d)", meta->path,
            (unsigned long long)step, meta->world_size, world, restart < 0 ? 0 : restart, round < 0 ? 0 : round);
  *start_step = (int)step;
  *resumed = 1;
  ckpt_close(ck);
  return 0;
}

int checkpoint_open(checkpoint_t *c, const plan_t *p, dp_t *dp, const mesh_t *mesh, hooks_t *hooks, int rank,
                    int world, int restart, int round, const char *plan_json, uint64_t data_tokens, int *start_step,
                    int *resumed, char *err, size_t errlen) {
  memset(c, 0, sizeof *c);
  c->p = p;
  c->data_tokens = data_tokens;
  c->rank = rank;
  if (mesh) {
    ckpt_group_from_comm(&c->group, mesh_host_comm(mesh, "world")); /* host memory, whatever the device */
    c->cg = &c->group;
  }
  int rc = resume(c, dp, world, restart, round, start_step, resumed, err, errlen);
  if (rc || !p->checkpoint.dir[0]) return rc;
  const int tp = mesh ? mesh->dims[MESH_TP] : 1;
  ckpt_writer_config_t wc = {.dir = p->checkpoint.dir, .keep = p->checkpoint.keep, .async = p->checkpoint.async,
                             .group = c->cg, .plan_json = plan_json,
                             .mesh = {mesh ? mesh->dims[MESH_DP_REPLICATE] : 1, mesh ? mesh->dims[MESH_DP_SHARD] : 1,
                                      tp}};
  ckpt_shape_from_plan(&wc.shape, &p->model);
  hooks_ckpt_writer(hooks, &wc);
  return ckpt_writer_create(&c->w, &wc, err, errlen) ? 1 : 0;
}

void checkpoint_skip_window(checkpoint_t *c, backend_t *be, skip_window_t *win) {
  c->skip_be = be;
  c->skip_dev = win;
  if (c->skip_resumed) be->to_device(be, win, &c->skip_loaded, sizeof *win);
}

/* Keeps the cause of a failed final save for the end of the run. */
static void keep_final_err(checkpoint_t *c, const char *err) {
  if (c->final_failed && !c->final_err[0]) snprintf(c->final_err, sizeof c->final_err, "%s", err);
}

/* An async save in flight is committed by the first poll that finds every rank's writer done
 * (poll is collective: every rank calls it after every step), or before the next save starts. */
int checkpoint_due(const checkpoint_t *c, int step) {
  const plan_t *p = c->p;
  return c->w && (step == p->train.steps || (p->checkpoint.interval > 0 && step % p->checkpoint.interval == 0));
}

int checkpoint_after_step(checkpoint_t *c, dp_t *dp, int step, char *err, size_t errlen) {
  if (!c->w) return 0;
  const plan_t *p = c->p;
  const int due = checkpoint_due(c, step);
  int rc = 0, settled = 1;
  if (c->pending) {
    int64_t committed = -1;
    if (due) {
      rc = ckpt_writer_wait(c->w, err, errlen);
    } else {
      rc = ckpt_writer_poll(c->w, &committed, err, errlen);
      settled = rc != 0 || committed >= 0;
    }
    if (settled && rc && c->saved == c->pending) c->saved = 0; /* its commit failed */
    if (settled && failed(c, rc, c->pending, err, errlen)) return -1;
    if (settled) c->pending = 0;
  }
  if (due) {
    rc = save(c, dp, step, err, errlen);
    if (rc == 0) c->saved = step;
    if (rc == 0 && p->checkpoint.async)
      c->pending = step; /* in flight: its outcome comes with the commit */
    else if (failed(c, rc, step, err, errlen))
      return -1;
  }
  keep_final_err(c, err);
  return 0;
}

int checkpoint_now(checkpoint_t *c, dp_t *dp, int step, char *err, size_t errlen) {
  if (!c->w) return 0;
  int rc = 0;
  if (c->pending) { /* an asynchronous save in flight: committed (or failed) first */
    rc = ckpt_writer_wait(c->w, err, errlen);
    const int was = c->pending;
    c->pending = 0;
    if (rc && c->saved == was) c->saved = 0; /* its commit failed: save this step afresh */
  }
  if (c->saved == step) return 0;
  rc = save(c, dp, step, err, errlen);
  if (rc == 0 && c->p->checkpoint.async) rc = ckpt_writer_wait(c->w, err, errlen);
  if (rc == 0) c->saved = step;
  return rc ? -1 : 0;
}

int checkpoint_finish(checkpoint_t *c, char *err, size_t errlen) {
  if (!c->w || !c->pending) return 0;
  int rc = ckpt_writer_wait(c->w, err, errlen);
  if (failed(c, rc, c->pending, err, errlen)) return -1;
  keep_final_err(c, err);
  c->pending = 0;
  return 0;
}

int checkpoint_final_status(const checkpoint_t *c, char *err, size_t errlen) {
  if (!c->final_failed) return 0;
  return err_set(err, errlen, -1, "the checkpoint after the last step (%d) was not saved: %s", c->p->train.steps,
                 c->final_err);
}

void checkpoint_free(checkpoint_t *c) {
  if (!c) return;
  ckpt_writer_destroy(c->w); /* a save still in flight (only after a failure) is waited for */
  c->w = NULL;
}
