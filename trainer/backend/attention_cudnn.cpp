/* attention_cudnn: cuDNN's fused flash attention for the cuda backend (attention_cudnn.h).
 *
 * One cudnn-frontend graph per direction and shape: the forward is SDPA with a causal mask
 * (top-left diagonal, right bound 0), or with none for a shape asked for as not causal (a block
 * of ring attention whose keys all precede its queries), scale 1/sqrt(D) and its stats (the
 * log-sum-exp) as an output; the backward is SDPA's backward from q, k, v, out, dout and those
 * stats, with the same mask. Grouped-query
 * heads are native (K and V have KV heads; cuDNN maps query head h to kv head h / (H/KV), as
 * backend.h does). The tensors are described by strides over the row-major (B,T,H,D) buffers, so
 * nothing is transposed or copied. Plans come from cuDNN's heuristics (mode A), built once per
 * shape and kept until close. The frontend's exceptions (it throws when a library cannot be
 * loaded) stop at this file's C functions and become text. */
#define NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING
#include <cudnn_frontend.h>
#include <dlfcn.h>
#include <math.h>
#include <stdio.h>

#include <map>
#include <memory>
#include <string>
#include <tuple>

#include "trainer/backend/attention_cudnn.h"

namespace cudnn_frontend {
void *cudnn_dlhandle = nullptr; /* the frontend's handle on the library it calls (dynamic loading) */
}

namespace fe = cudnn_frontend;

namespace {

enum : int64_t { U_Q = 1, U_K, U_V, U_O, U_STATS, U_DO, U_DQ, U_DK, U_DV };

struct shape_plans {
  std::shared_ptr<fe::graph::Graph> fwd, bwd;
  int64_t ws_fwd = 0, ws_bwd = 0;
  int deterministic = 0;
  std::string refused; /* non-empty: this shape cannot run here, and why */
};

typedef std::tuple<int, int, int, int, int, int> shape_key; /* b, t, h, kv, d, causal */

}  // namespace

struct cudnn_att {
  cudnnHandle_t handle = nullptr;
  cudnn_att_ws_fn ws = nullptr;
  void *ws_ctx = nullptr;
  char version[32] = "";
  std::map<shape_key, shape_plans> plans;
};

static void say(char *why, size_t len, const std::string &s) {
  if (why && len) snprintf(why, len, "%s", s.c_str());
}

/* One line of cuDNN's text: its messages can run over several lines. */
static std::string one_line(std::string s) {
  for (char &c : s)
    if (c == '\n' || c == '\r') c = ' ';
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s.size() > 300 ? s.substr(0, 300) + "..." : s;
}

/* A (B, T, heads, D) row-major buffer as cuDNN's (B, heads, T, D) tensor. */
static fe::graph::Tensor_attributes bthd(const char *name, int64_t uid, int b, int t, int heads, int d) {
  return fe::graph::Tensor_attributes()
      .set_name(name)
      .set_uid(uid)
      .set_dim({b, heads, t, d})
      .set_stride({(int64_t)t * heads * d, d, (int64_t)heads * d, 1});
}

static void stats_layout(const std::shared_ptr<fe::graph::Tensor_attributes> &s, int b, int t, int h) {
  s->set_uid(U_STATS).set_data_type(fe::DataType_t::FLOAT).set_dim({b, h, t, 1}).set_stride({(int64_t)h * t, t, 1, 1});
}

static std::shared_ptr<fe::graph::Graph> new_graph() {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

/* Builds g on the handle; "" or cuDNN's reason. */
static std::string build(cudnn_att *a, fe::graph::Graph &g, int64_t *ws) {
  fe::error_t st = g.build(a->handle, {fe::HeurMode_t::A});
  if (!st.is_good()) return one_line(st.get_message());
  st = g.get_workspace_size(*ws);
  if (!st.is_good()) return one_line(st.get_message());
  return "";
}

static std::string build_fwd(cudnn_att *a, shape_plans &p, int b, int t, int h, int kv, int d, bool causal) {
  auto g = new_graph();
  auto q = g->tensor(bthd("q", U_Q, b, t, h, d));
  auto k = g->tensor(bthd("k", U_K, b, t, kv, d));
  auto v = g->tensor(bthd("v", U_V, b, t, kv, d));
  auto opt = fe::graph::SDPA_attributes()
                 .set_name("attention_fwd")
                 .set_generate_stats(true)
                 .set_causal_mask(causal)
                 .set_attn_scale(1.0f / sqrtf((float)d));
  auto outs = g->sdpa(q, k, v, opt);
  outs[0]->set_output(true).set_uid(U_O).set_dim({b, h, t, d}).set_stride({(int64_t)t * h * d, d, (int64_t)h * d, 1});
  outs[1]->set_output(true);
  stats_layout(outs[1], b, t, h);
  std::string e = build(a, *g, &p.ws_fwd);
  if (e.empty()) p.fwd = g;
  return e;
}

static std::string build_bwd(cudnn_att *a, shape_plans &p, int b, int t, int h, int kv, int d, bool causal,
                             bool det) {
  auto g = new_graph();
  auto q = g->tensor(bthd("q", U_Q, b, t, h, d));
  auto k = g->tensor(bthd("k", U_K, b, t, kv, d));
  auto v = g->tensor(bthd("v", U_V, b, t, kv, d));
  auto o = g->tensor(bthd("o", U_O, b, t, h, d));
  auto dout = g->tensor(bthd("dout", U_DO, b, t, h, d));
  auto stats = g->tensor(fe::graph::Tensor_attributes().set_name("stats"));
  stats_layout(stats, b, t, h);
  auto opt = fe::graph::SDPA_backward_attributes()
                 .set_name("attention_bwd")
                 .set_causal_mask(causal)
                 .set_attn_scale(1.0f / sqrtf((float)d))
                 .set_deterministic_algorithm(det);
  auto grads = g->sdpa_backward(q, k, v, o, dout, stats, opt);
  const int64_t uid[3] = {U_DQ, U_DK, U_DV};
  const int heads[3] = {h, kv, kv};
  for (int i = 0; i < 3; i++)
    grads[i]->set_output(true).set_uid(uid[i]).set_dim({b, heads[i], t, d}).set_stride(
        {(int64_t)t * heads[i] * d, d, (int64_t)heads[i] * d, 1});
  std::string e = build(a, *g, &p.ws_bwd);
  if (e.empty()) {
    p.bwd = g;
    p.deterministic = det;
  }
  return e;
}

static shape_plans &plans_of(cudnn_att *a, int b, int t, int h, int kv, int d, bool causal) {
  shape_key key(b, t, h, kv, d, causal);
  auto it = a->plans.find(key);
  if (it != a->plans.end()) return it->second;
  shape_plans &p = a->plans[key];
  std::string e;
  if (d % 8 != 0 || d > 256) {
    p.refused = "head dim " + std::to_string(d) + " (cuDNN's flash attention takes multiples of 8 up to 256)";
    return p;
  }
  try {
    e = build_fwd(a, p, b, t, h, kv, d, causal);
    if (!e.empty()) e = "forward: " + e;
    if (e.empty()) {
      std::string det = build_bwd(a, p, b, t, h, kv, d, causal, true);
      if (!det.empty()) { /* an older cuDNN: the nondeterministic backward, said by prepare */
        e = build_bwd(a, p, b, t, h, kv, d, causal, false);
        if (!e.empty()) e = "backward: " + e + " (deterministic: " + det + ")";
      }
    }
  } catch (const std::exception &x) {
    e = one_line(x.what());
  }
  if (!e.empty()) {
    p.fwd.reset();
    p.bwd.reset();
    p.refused = e;
  }
  return p;
}

static void *workspace(cudnn_att *a, int64_t bytes) {
  return bytes > 0 ? a->ws(a->ws_ctx, (size_t)bytes) : nullptr;
}

/* The shape's plans, built when first asked for; NULL with why when cuDNN refused the shape. */
static const shape_plans *ready(cudnn_att *a, int b, int t, int h, int kv, int d, int causal, char *why,
                                size_t len) {
  const shape_plans &p = plans_of(a, b, t, h, kv, d, causal != 0);
  if (p.refused.empty()) return &p;
  say(why, len, p.refused);
  return nullptr;
}

/* Executes a built graph on the handle's stream: 0, or -1 with cuDNN's reason in why. */
static int run(cudnn_att *a, const fe::graph::Graph &g, int64_t ws, std::unordered_map<int64_t, void *> &ptr,
               const char *what, char *why, size_t len) {
  try {
    fe::error_t st = g.execute(a->handle, ptr, workspace(a, ws));
    if (st.is_good()) return 0;
    say(why, len, std::string(what) + ": " + one_line(st.get_message()));
  } catch (const std::exception &x) {
    say(why, len, one_line(x.what()));
  }
  return -1;
}

extern "C" {

cudnn_att_t *cudnn_att_open(void *stream, cudnn_att_ws_fn ws, void *ws_ctx, char *why, size_t len) {
  if (!fe::cudnn_dlhandle) {
    const char *names[] = {"libcudnn.so.9", "libcudnn_graph.so.9"};
    std::string tried;
    for (const char *n : names) {
      fe::cudnn_dlhandle = dlopen(n, RTLD_NOW | RTLD_LOCAL);
      if (fe::cudnn_dlhandle) break;
      const char *e = dlerror();
      tried += std::string(tried.empty() ? "" : "; ") + (e ? e : n);
    }
    if (!fe::cudnn_dlhandle) {
      say(why, len, "cuDNN 9 not found (" + one_line(tried) + ")");
      return nullptr;
    }
  }
  cudnn_att *a = new (std::nothrow) cudnn_att;
  if (!a) {
    say(why, len, "out of memory");
    return nullptr;
  }
  try {
    size_t v = fe::detail::get_backend_version();
    snprintf(a->version, sizeof a->version, "%zu.%zu.%zu", v / 10000, v / 100 % 100, v % 100);
    if (v < 90000) {
      say(why, len, std::string("cuDNN ") + a->version + " is older than 9.0");
      delete a;
      return nullptr;
    }
    cudnnStatus_t st = fe::detail::create_handle(&a->handle);
    if (st == CUDNN_STATUS_SUCCESS) st = fe::detail::set_stream(a->handle, (cudaStream_t)stream);
    if (st != CUDNN_STATUS_SUCCESS) {
      say(why, len, std::string("cuDNN ") + a->version + ": cudnnCreate: " + fe::detail::get_error_string(st));
      cudnn_att_close(a);
      return nullptr;
    }
  } catch (const std::exception &x) {
    say(why, len, one_line(x.what()));
    delete a;
    return nullptr;
  }
  a->ws = ws;
  a->ws_ctx = ws_ctx;
  return a;
}

void cudnn_att_close(cudnn_att_t *a) {
  if (!a) return;
  a->plans.clear();
  if (a->handle) {
    try {
      fe::detail::destroy_handle(a->handle);
    } catch (...) {
    }
  }
  delete a;
}

const char *cudnn_att_version(const cudnn_att_t *a) { return a ? a->version : ""; }

int cudnn_att_prepare(cudnn_att_t *a, int b, int t, int h, int kv, int d, int causal, int *deterministic, char *why,
                      size_t len) {
  const shape_plans *p = ready(a, b, t, h, kv, d, causal, why, len);
  if (!p) return -1;
  if (deterministic) *deterministic = p->deterministic;
  return 0;
}

int cudnn_att_fwd(cudnn_att_t *a, void *out, float *lse, const void *q, const void *k, const void *v, int b, int t,
                  int h, int kv, int d, int causal, char *why, size_t len) {
  const shape_plans *p = ready(a, b, t, h, kv, d, causal, why, len);
  if (!p) return -1;
  std::unordered_map<int64_t, void *> ptr = {
      {U_Q, (void *)q}, {U_K, (void *)k}, {U_V, (void *)v}, {U_O, out}, {U_STATS, (void *)lse}};
  return run(a, *p->fwd, p->ws_fwd, ptr, "forward", why, len);
}

int cudnn_att_bwd(cudnn_att_t *a, void *dq, void *dk, void *dv, const void *dout, const void *q, const void *k,
                  const void *v, const void *out, const float *lse, int b, int t, int h, int kv, int d, int causal,
                  char *why, size_t len) {
  const shape_plans *p = ready(a, b, t, h, kv, d, causal, why, len);
  if (!p) return -1;
  std::unordered_map<int64_t, void *> ptr = {{U_Q, (void *)q},     {U_K, (void *)k},        {U_V, (void *)v},
                                             {U_O, (void *)out},   {U_DO, (void *)dout},    {U_STATS, (void *)lse},
                                             {U_DQ, dq},           {U_DK, dk},              {U_DV, dv}};
  return run(a, *p->bwd, p->ws_bwd, ptr, "backward", why, len);
}

}  // extern "C"
