/* step_run: train_step's setup for tests (see step_run.h). */
#include "test/support/step_run.h"

#include <stdio.h>
#include <string.h>

#include "common/err.h"
#include "test/support/serial_run.h"

static int setup(step_run_t *r, int rank, int world, store_t *st, char *err, size_t errlen) {
  const plan_t *p = &r->p;
  if (!(r->be = backend_create("cpu", 1, err, errlen))) return -1;
  if (world > 1) {
    if (mesh_create(&r->mesh, p->mesh.dp_replicate, p->mesh.dp_shard, p->mesh.tp, rank, world, err, errlen) ||
        mesh_connect(r->mesh, "cpu", NULL, st, 0, "127.0.0.1", 20000, err, errlen))
      return -1;
  }
  model_opts_t opts = {.max_b = p->train.micro_batch_size, .max_t = p->train.seq_len,
                       .decay_norms = p->train.decay_norms, .decay_embeddings = p->train.decay_embeddings,
                       .param_dtype = p->parallel.param_dtype, .reduce_dtype = p->parallel.reduce_dtype,
                       .strategy_casts = dp_is_sharded(r->mesh), .no_flat_buffers = dp_owns_buffers(r->mesh, p)};
  if (model_create_opts(&r->m, &p->model, r->be, &opts, err, errlen) ||
      dp_create(&r->dp, r->m, r->be, r->mesh, p, err, errlen))
    return -1;
  if (dp_init_params(r->dp, p->seed, p->model.init_std)) return err_set(err, errlen, -1, "%s", dp_errmsg(r->dp));
  if (data_load(&r->data, p, 1, err, errlen)) return -1;
  r->hooks = (hooks_t){.rank = rank, .nan_rank = -1, .slow_rank = -1, .grad_rank = -1, .stall_rank = -1, .skip_rank = -1};
  comm_t *dpc = r->mesh ? mesh_host_comm(r->mesh, "dp") : NULL;
  r->t = (train_t){.p = p, .m = r->m, .dp = r->dp, .be = r->be, .data = &r->data, .dpc = dpc, .mesh = r->mesh,
                   .hooks = &r->hooks, .dp_rank = dpc ? comm_rank(dpc) : 0, .dp_size = dpc ? comm_size(dpc) : 1};
  return train_init(&r->t, err, errlen);
}

int step_run_open(step_run_t *r, const char *const *sets, int nsets, int rank, int world, store_t *st, char *err,
                  size_t errlen) {
  memset(r, 0, sizeof *r);
  if (serial_run_plan(&r->p, sets, nsets, world, err, errlen) || setup(r, rank, world, st, err, errlen)) {
    step_run_close(r);
    return -1;
  }
  return 0;
}

int step_run_params(step_run_t *r, float *host, char *err, size_t errlen) {
  for (int u = 0; u < model_num_units(r->m); u++) {
    size_t off, n;
    model_unit_range(r->m, u, &off, &n);
    if (dp_unit_open(r->dp, u)) return err_set(err, errlen, -1, "unit %d: %s", u, dp_errmsg(r->dp));
    dp_unit_to_host(r->dp, u, host + off);
  }
  return 0;
}

void step_run_close(step_run_t *r) {
  if (!r) return;
  train_free(&r->t);
  data_free(&r->data);
  dp_destroy(r->dp);
  model_destroy(r->m);
  mesh_destroy(r->mesh);
  backend_destroy(r->be);
  memset(r, 0, sizeof *r);
}
