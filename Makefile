# meshrun: one Makefile for both programs, their tests, the demo and the benchmarks.
# Objects go under $(BUILD), programs under $(BIN). Knobs: V=1 (show commands), DEBUG=1, ASAN=1,
# CUDA_HOME (the cuda backend builds only where nvcc exists), BUILD/BIN (separate trees), and for
# a machine without the -dev packages (the GPU machine; see scripts/make-kit.sh):
#   DEPS_PREFIX=DIR  headers and libraries from .debs unpacked into DIR (dpkg -x), not the system
#   NCCL_HOME=DIR    NCCL's include/ and lib/; lib/ may hold only libnccl.so.2, as in PyTorch's
#                    nvidia/nccl wheel folder
#   WERROR=0|1       warnings as errors; default 1 only with the compiler CI and development use
#                    (gcc 12), since a newer compiler's new warnings must not stop a build there
#
# Unit tests are test/unit/test_*.c, one binary each. The first line of each test names the
# project sources it links:  // deps: common/store.c launcher/store_server.c
# Tools that tests drive are test/tools/*.c with the same "deps" line.

BUILD ?= build
BIN   ?= bin
PYTHON ?= /usr/bin/python3

CC      ?= cc
CC_MAJOR := $(shell $(CC) -dumpversion 2>/dev/null | cut -d. -f1)
CC_IS_GCC := $(shell $(CC) -v 2>&1 | grep -q '^gcc version' && echo 1)
ifeq ($(CC_IS_GCC)$(CC_MAJOR),112)
  WERROR ?= 1
else
  WERROR ?= 0
endif
CFLAGS  := -std=gnu11 -Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers \
           -fno-strict-aliasing -MMD -MP -I. -D_GNU_SOURCE
ifeq ($(WERROR),1)
  CFLAGS += -Werror
endif
LDLIBS  := -lm -lpthread

ifeq ($(DEBUG),1)
  CFLAGS += -O0 -g
else
  CFLAGS += -O3 -march=x86-64-v2 -g
endif
ifeq ($(ASAN),1)
  CFLAGS  += -fsanitize=address,undefined -fno-omit-frame-pointer
  LDFLAGS += -fsanitize=address,undefined
endif

ifeq ($(DEPS_PREFIX),)
UV_CFLAGS    := $(shell pkg-config --cflags libuv 2>/dev/null)
UV_LIBS      := -l:libuv_a.a
CJSON_CFLAGS := $(shell pkg-config --cflags libcjson 2>/dev/null)
CJSON_LIBS   := $(shell pkg-config --libs libcjson 2>/dev/null || echo -lcjson)
BLAS_CFLAGS  := $(shell pkg-config --cflags openblas 2>/dev/null)
BLAS_LIBS    := $(shell pkg-config --libs openblas 2>/dev/null || echo -lopenblas)
CMOCKA_LIBS  := $(shell pkg-config --libs cmocka 2>/dev/null || echo -lcmocka)
# Nettle: HMAC-SHA256 for the store's job secret, base64 for etcd. Its static archive, like
# libuv's: what a process links dynamically it relocates at every start, and a 2048-node job
# started on one machine runs 4096 of them (meshrun and its worker); libcrypto alone cost each
# 0.4 ms there. Static, the GPU kit carries neither.
NETTLE_LIBS   := -l:libnettle.a
# PCRE2 (8-bit, libpcre2-dev): the tokenizer's pre-tokenizer regexes (\p{L}, lookahead); linked
# by the trainer and by what links trainer/formats/tokenizer.c (needs_pcre2 below).
PCRE2_LIBS    := -lpcre2-8
# protobuf-c (libprotobuf-c-dev, static like libuv) and its compiler protoc-c
# (protobuf-c-compiler): TensorBoard's event records (trainer/run/tensorboard.proto, below).
PROTOBUF_C_LIBS := -l:libprotobuf-c.a
PROTOC_C        := protoc-c
else
# Unpacked .debs: no pkg-config files to trust (they name /usr), and no update-alternatives links,
# so OpenBLAS is taken from its openblas-pthread folder directly.
DEPS_INC := $(DEPS_PREFIX)/usr/include
DEPS_LIB := $(DEPS_PREFIX)/usr/lib/x86_64-linux-gnu
UV_CFLAGS    := -I$(DEPS_INC) -I$(DEPS_INC)/x86_64-linux-gnu
UV_LIBS      := $(DEPS_LIB)/libuv_a.a
CJSON_CFLAGS := -I$(DEPS_INC)/cjson
CJSON_LIBS   := -L$(DEPS_LIB) -Wl,-rpath-link,$(DEPS_LIB) -lcjson
BLAS_CFLAGS  := -I$(DEPS_INC)/x86_64-linux-gnu/openblas-pthread
BLAS_LIBS    := -L$(DEPS_LIB)/openblas-pthread -Wl,-rpath-link,$(DEPS_LIB)/openblas-pthread -lopenblas
CMOCKA_LIBS  := -L$(DEPS_LIB) -lcmocka
NETTLE_LIBS   := $(DEPS_LIB)/libnettle.a
PCRE2_LIBS    := $(DEPS_LIB)/libpcre2-8.a
PROTOBUF_C_LIBS := $(DEPS_LIB)/libprotobuf-c.a
PROTOC_C        := LD_LIBRARY_PATH=$(DEPS_LIB) $(DEPS_PREFIX)/usr/bin/protoc-c
endif
CFLAGS += $(UV_CFLAGS) $(CJSON_CFLAGS) $(BLAS_CFLAGS) -fopenmp
LDFLAGS += -fopenmp
ALL_LIBS := $(UV_LIBS) $(CJSON_LIBS) $(BLAS_LIBS) $(NETTLE_LIBS) $(LDLIBS)

ifneq ($(V),1)
  Q := @
endif

# --- CUDA: the cuda backend and the nccl comm build when nvcc exists; nothing else ever needs it.
CUDA_HOME ?= /usr/local/cuda
NVCC := $(shell command -v nvcc 2>/dev/null || ls $(CUDA_HOME)/bin/nvcc 2>/dev/null)
CU_SRC := $(wildcard trainer/*/*.cu)
ifneq ($(NVCC),)
ifneq ($(CU_SRC),)
  HAVE_CUDA := 1
  # Machine code for sm_90a (H100/H200: the a-variant unlocks Hopper's own instructions) and for
  # plain sm_90, with sm_90's PTX for newer GPUs; fatbins compressed for size (2.0 MB -> 0.25 MB
  # per binary that carries the kernels; they unpack once when the module loads).
  NVCC_ARCH := -gencode arch=compute_90a,code=sm_90a -gencode arch=compute_90,code=[sm_90,compute_90]
  NVCCFLAGS := -O3 -std=c++17 -I. $(NVCC_ARCH) --compress-mode=size -Xcompiler -Wall,-fPIC -MMD -MP
  ifeq ($(WERROR),1)
    NVCCFLAGS += -Xcompiler -Werror -Werror all-warnings
  endif
  CFLAGS += -I$(CUDA_HOME)/include
  # cuobjdump (with nvdisasm beside it) reads the built kernels' machine code for
  # test/tools/check_sass.py: the toolkit's, or the one scripts/install-deps.sh unpacks.
  CUOBJDUMP := $(firstword $(shell command -v cuobjdump 2>/dev/null) $(wildcard $(CUDA_HOME)/bin/cuobjdump) \
                 $(wildcard /usr/local/share/cuda-inspect/bin/cuobjdump))
  CUDA_LIBDIRS := $(CUDA_HOME)/lib64 $(CUDA_HOME)/lib
  # NCCL: the toolkit's, or NCCL_HOME's; a lib/ without the unversioned link (a wheel) is linked
  # by its soname.
  NCCL_LIB := -lnccl
  ifneq ($(NCCL_HOME),)
    CFLAGS += -I$(NCCL_HOME)/include
    NVCCFLAGS += -I$(NCCL_HOME)/include
    CUDA_LIBDIRS := $(NCCL_HOME)/lib $(CUDA_LIBDIRS)
    NCCL_LIB := $(if $(wildcard $(NCCL_HOME)/lib/libnccl.so),-lnccl,-l:libnccl.so.2)
  endif
  CUDA_LIBS := $(foreach d,$(CUDA_LIBDIRS),-L$(d) -Wl,-rpath,$(d)) -lcublasLt -lcublas -lcudart $(NCCL_LIB) -lstdc++ -ldl
  # cuDNN attention (trainer/backend/attention_cudnn.cpp): cudnn-frontend's headers (a header-only
  # C++ library; scripts/install-deps.sh unpacks them from its PyPI wheel) and cuDNN's own header.
  # libcudnn is opened at run time, never linked. Host code only, so g++ compiles it (nvcc takes
  # four times as long over the frontend's templates), -Os: graph building is not hot, and the
  # frontend's code is in the trainer and three GPU test binaries (the kit stays under 55 MiB).
  CUDNN_FE_INC ?= /usr/local/share/cudnn-frontend/include
  ifneq ($(and $(wildcard $(CUDNN_FE_INC)/cudnn_frontend.h),$(wildcard $(CUDA_HOME)/include/cudnn.h)),)
    HAVE_CUDNN := 1
    CXXFLAGS_CUDNN := -Os -std=c++17 -Wall -fPIC -MMD -MP -I. -isystem $(CUDNN_FE_INC) -isystem $(CUDA_HOME)/include
  endif
endif
endif

# --- oneDNN (libdnnl-dev): used where its header exists, by the bf16 gemm benchmark
# (test/tools/gemm_bench.c); without it that builds without its oneDNN column. HAVE_DNNL=0 turns
# it off. Only what needs it gets -DMESHRUN_HAVE_DNNL and links -ldnnl (needs_dnnl below).
comma := ,
ifeq ($(DEPS_PREFIX),)
  DNNL_HEADER := $(wildcard /usr/include/dnnl.h)
else
  DNNL_HEADER := $(wildcard $(DEPS_INC)/dnnl.h)
endif
HAVE_DNNL ?= $(if $(DNNL_HEADER),1,0)
ifeq ($(HAVE_DNNL),1)
  $(BUILD)/test/tools/gemm_bench.o: CFLAGS += -DMESHRUN_HAVE_DNNL=1
  DNNL_LIBS := $(if $(DEPS_PREFIX),-L$(DEPS_LIB) -Wl$(comma)-rpath-link$(comma)$(DEPS_LIB)) -ldnnl
endif

# --- Variants are files, picked here (libuv's way), never #ifdefs in shared code. A backend
# that needs a toolkit has its files, built where the toolkit is, and a stand-in
# (<file>_absent.c) built where it is not, which registers the name as known but not built.
# The registries (trainer/backend/registry.c, trainer/comm/registry.c) list every backend; what
# links a registry's dispatch (backend.c, comm.c) links the registry and every backend it lists:
# its set, as a build without CUDA has it (_HOST: also the fuzz targets') or as this build does.
# The comm dispatch's set also holds its second file, the flight recorder (comm_flight.c), and the
# file helpers and the dump folder (common/dump.c) that one uses.
CUDA_VARIANT     := trainer/backend/backend_cuda.cu trainer/comm/comm_nccl.c
CUDA_STAND_INS   := trainer/backend/backend_cuda_absent.c trainer/comm/comm_nccl_absent.c
# The cuda backend's cuDNN attention: its file where cudnn-frontend is, its stand-in elsewhere.
CUDNN_PART       := $(if $(HAVE_CUDNN),trainer/backend/attention_cudnn.cpp,trainer/backend/attention_cudnn_absent.c)
NOT_BUILT        := $(if $(HAVE_CUDA),$(CUDA_STAND_INS),$(CUDA_VARIANT)) \
                    $(filter-out $(if $(HAVE_CUDA),$(CUDNN_PART)),trainer/backend/attention_cudnn_absent.c)
BACKEND_SET_HOST := trainer/backend/registry.c trainer/backend/attention_registry.c trainer/backend/backend_cpu.c \
                    trainer/backend/backend_cuda_absent.c
COMM_SET_HOST    := trainer/comm/registry.c trainer/comm/comm_cpu.c trainer/comm/comm_staged.c \
                    trainer/comm/comm_nccl_absent.c trainer/comm/comm_flight.c common/fs.c \
                    common/dump.c
BACKEND_SET      := $(filter-out $(NOT_BUILT),$(BACKEND_SET_HOST) trainer/backend/backend_cuda.cu common/gpus_cuda.c) \
                    $(if $(HAVE_CUDA),$(CUDNN_PART))
COMM_SET         := $(filter-out $(NOT_BUILT),$(COMM_SET_HOST) trainer/comm/comm_nccl.c)

COMMON_SRC   := $(wildcard common/*.c)
LAUNCHER_SRC := $(wildcard launcher/*.c)
TRAINER_SRC  := $(filter-out $(NOT_BUILT),$(wildcard trainer/*/*.c))
COMMON_OBJ   := $(COMMON_SRC:%.c=$(BUILD)/%.o)
LAUNCHER_OBJ := $(LAUNCHER_SRC:%.c=$(BUILD)/%.o)
TRAINER_OBJ  := $(TRAINER_SRC:%.c=$(BUILD)/%.o) $(if $(HAVE_CUDA),$(CU_SRC:%.cu=$(BUILD)/%.o)) \
                $(if $(HAVE_CUDNN),$(BUILD)/trainer/backend/attention_cudnn.o)
# Code generated at build time, never committed: protoc-c compiles trainer/run/tensorboard.proto
# into $(BUILD)/gen/trainer/run/tensorboard.pb-c.{c,h}; tensorboard.c includes the header by
# that path under -I$(BUILD)/gen, and what links tensorboard.c links the generated object and
# protobuf-c (PB_OBJ, needs_pb below).
PB_PROTO := trainer/run/tensorboard.proto
PB_GEN   := $(BUILD)/gen/$(PB_PROTO:.proto=.pb-c)
PB_OBJ   := $(PB_GEN).o
TRAINER_OBJ += $(PB_OBJ)
# The etcd client is the launcher's (--rdzv_backend=etcd); the trainer has no use for it.
ETCD_OBJ     := $(BUILD)/common/etcd.o $(BUILD)/common/http.o

UNIT_SRC  := $(wildcard test/unit/test_*.c)
UNIT_BIN  := $(UNIT_SRC:test/unit/%.c=$(BUILD)/test/%)
GPU_SRC   := $(if $(HAVE_CUDA),$(wildcard test/gpu/test_*.c))
GPU_BIN   := $(GPU_SRC:test/gpu/%.c=$(BUILD)/test-gpu/%)
TOOL_SRC  := $(wildcard test/tools/*.c)
TOOL_BIN  := $(TOOL_SRC:test/tools/%.c=$(BUILD)/tools/%)

.PHONY: all test unit integration test-gpu demo stories bench bench-gpu install clean
all: $(BIN)/meshrun $(BIN)/trainer $(UNIT_BIN) $(TOOL_BIN) $(GPU_BIN)

$(BIN)/meshrun: $(LAUNCHER_OBJ) $(COMMON_OBJ)
	@mkdir -p $(@D)
	@$(if $(Q),echo "  LD      $@")
	$(Q)$(CC) $(LDFLAGS) -o $@ $^ $(ALL_LIBS)

# -rdynamic: the flight recorder's dumps name the program's own functions in stacks (comm.h).
$(BIN)/trainer: $(TRAINER_OBJ) $(filter-out $(ETCD_OBJ),$(COMMON_OBJ))
	@mkdir -p $(@D)
	@$(if $(Q),echo "  LD      $@")
	$(Q)$(CC) $(LDFLAGS) -rdynamic -o $@ $^ $(ALL_LIBS) $(PCRE2_LIBS) $(PROTOBUF_C_LIBS) $(CUDA_LIBS)

$(BUILD)/%.o: %.c
	@mkdir -p $(@D)
	@$(if $(Q),echo "  CC      $<")
	$(Q)$(CC) $(CFLAGS) -c -o $@ $<

# One protoc-c run makes both files (a grouped target, GNU make 4.3).
$(PB_GEN).c $(PB_GEN).h &: $(PB_PROTO)
	@mkdir -p $(BUILD)/gen
	@$(if $(Q),echo "  PROTOC  $<")
	$(Q)$(PROTOC_C) --proto_path=. --c_out=$(BUILD)/gen $<

$(PB_OBJ): $(PB_GEN).c
	@$(if $(Q),echo "  CC      $<")
	$(Q)$(CC) $(CFLAGS) -I$(BUILD)/gen -c -o $@ $<

$(BUILD)/trainer/run/tensorboard.o: CFLAGS += -I$(BUILD)/gen
$(BUILD)/trainer/run/tensorboard.o: $(PB_GEN).h

# ptxas reports each kernel's registers and spills (-Xptxas -v) into a log beside the object;
# check_ptxas prints the table and fails the build, deleting the object, when a kernel spills.
$(BUILD)/%.o: %.cu
	@mkdir -p $(@D)
	@$(if $(Q),echo "  NVCC    $<")
	$(Q)$(NVCC) $(NVCCFLAGS) -Xptxas -v -c -o $@ $< 2>$(@:.o=.ptxas) || { cat $(@:.o=.ptxas) >&2; rm -f $@; exit 1; }
	$(Q)$(PYTHON) test/tools/check_ptxas.py $(@:.o=.ptxas) || { rm -f $@; exit 1; }
	$(if $(CUOBJDUMP),$(Q)CUOBJDUMP=$(CUOBJDUMP) $(PYTHON) test/tools/check_sass.py $@ || { rm -f $@; exit 1; })

$(BUILD)/%.o: %.cpp
	@mkdir -p $(@D)
	@$(if $(Q),echo "  CXX     $<")
	$(Q)$(CXX) $(CXXFLAGS_CUDNN) -c -o $@ $<

# A test or tool links its own object plus the sources its "// deps:" line names, and with
# trainer/backend/backend.c or trainer/comm/comm.c the sets of their registries (above); the
# CUDA libraries where those sets hold the cuda variant.
raw_deps = $(shell sed -n '1s|^// deps: *||p' $(1))
with_sets = $(1) $(if $(filter trainer/backend/backend.c,$(1)),$(2)) $(if $(filter trainer/comm/comm.c,$(1)),$(3))
all_deps = $(call with_sets,$(call raw_deps,$(1)),$(BACKEND_SET),$(COMM_SET))
needs_cuda = $(if $(HAVE_CUDA),$(or $(filter %.cu trainer/comm/comm_nccl.c,$(call all_deps,$(1))),$(findstring test/gpu/,$(1))))
needs_dnnl = $(if $(filter 1,$(HAVE_DNNL)),$(filter test/tools/gemm_bench.c,$(1)))
needs_pcre2 = $(filter trainer/formats/tokenizer.c,$(call raw_deps,$(1)))
needs_pb = $(filter trainer/run/tensorboard.c,$(call raw_deps,$(1)))
deps_of = $(sort $(patsubst %.cpp,$(BUILD)/%.o,$(patsubst %.cu,$(BUILD)/%.o,$(patsubst %.c,$(BUILD)/%.o,$(call all_deps,$(1))))) \
                 $(if $(call needs_pb,$(1)),$(PB_OBJ)))
define link_rule
$(2): $(BUILD)/$(1:%.c=%.o) $(call deps_of,$(1))
	@mkdir -p $$(@D)
	@$$(if $$(Q),echo "  LD      $$@")
	$$(Q)$$(CC) $$(LDFLAGS) -o $$@ $$^ $$(ALL_LIBS) $$(CMOCKA_LIBS) $(if $(call needs_cuda,$(1)),$$(CUDA_LIBS)) $(if $(call needs_dnnl,$(1)),$$(DNNL_LIBS)) $(if $(call needs_pcre2,$(1)),$$(PCRE2_LIBS)) $(if $(call needs_pb,$(1)),$$(PROTOBUF_C_LIBS))
endef
$(foreach t,$(UNIT_SRC),$(eval $(call link_rule,$(t),$(t:test/unit/%.c=$(BUILD)/test/%))))
$(foreach t,$(TOOL_SRC),$(eval $(call link_rule,$(t),$(t:test/tools/%.c=$(BUILD)/tools/%))))
# GPU tests (test/gpu/test_*.c) build only with the cuda backend and run only under test-gpu.
$(foreach t,$(GPU_SRC),$(eval $(call link_rule,$(t),$(t:test/gpu/%.c=$(BUILD)/test-gpu/%))))

# The whole suite: C unit tests (each in its own process), then integration tests with real
# processes on loopback and the PyTorch oracle.
# The build runs on every core (the cuda backend's nvcc and the cuDNN attention's g++ take the
# longest; serially they add minutes to CI); the tests after it run as they always did.
NPROC := $(shell nproc 2>/dev/null || echo 2)
test:
	$(Q)$(MAKE) --no-print-directory -j$(NPROC) all
	$(Q)$(PYTHON) test/tools/check_rooms.py
	$(Q)$(PYTHON) test/tools/check_backend_names.py
	$(Q)$(PYTHON) test/tools/check_funclen.py
	$(Q)$(PYTHON) test/tools/check_codes.py
	$(Q)$(MAKE) --no-print-directory unit
	$(Q)$(MAKE) --no-print-directory integration
	$(Q)$(MAKE) --no-print-directory fuzz-ci

unit: $(UNIT_BIN)
	$(Q)scripts/run-unit-tests.sh $(UNIT_BIN)

integration: all
	$(Q)MESHRUN_BIN=$(abspath $(BIN)) MESHRUN_BUILD=$(abspath $(BUILD)) $(PYTHON) -m pytest -q -p no:cacheprovider test/integration

# The demo trains the byte-level model on tinyshakespeare, then draws its loss curve. It builds
# meshrun too: the README's next examples launch it after this first command. Each `make demo`
# starts out/demo afresh (overwrite=true); a run of your own refuses to replace what it left.
DEMO_OUT := out/demo
demo: $(BIN)/trainer $(BIN)/meshrun
	$(Q)$(BIN)/trainer configs/demo.json --set log.metrics_file=$(DEMO_OUT)/metrics.jsonl --set overwrite=true
	$(Q)/usr/bin/python3 tools/plot_metrics.py $(DEMO_OUT)/metrics.jsonl -o $(DEMO_OUT)/loss.png --lr
	@echo "demo: metrics in $(DEMO_OUT)/metrics.jsonl, loss curve in $(DEMO_OUT)/loss.png"

# A story model end to end: a BPE tokenizer trained on tinyshakespeare and llm.c shards of it
# (tools/prepare_data.py), then a 2.8M-parameter Llama trained on them, which prints a sample
# through the tokenizer (configs/stories.json; about 5 minutes on 2 cores).
STORIES_OUT := out/stories
stories: $(BIN)/trainer $(BIN)/meshrun
	$(Q)$(PYTHON) tools/prepare_data.py --train-tokenizer 1024 -o $(STORIES_OUT)/data data/tinyshakespeare.txt
	$(Q)$(BIN)/trainer configs/stories.json --set overwrite=true
	$(Q)$(PYTHON) tools/plot_metrics.py $(STORIES_OUT)/metrics.jsonl -o $(STORIES_OUT)/loss.png --lr
	@echo "stories: weights $(STORIES_OUT)/final.safetensors, metrics $(STORIES_OUT)/metrics.jsonl, loss curve $(STORIES_OUT)/loss.png"
	@echo "stories: more text: $(BIN)/trainer sample configs/stories.json --weights $(STORIES_OUT)/final.safetensors --set seed=7"

bench: all
	$(Q)MESHRUN_BIN=$(abspath $(BIN)) MESHRUN_BUILD=$(abspath $(BUILD)) bench/run.sh

test-gpu: all
	$(Q)MESHRUN_BIN=$(abspath $(BIN)) MESHRUN_BUILD=$(abspath $(BUILD)) scripts/test-gpu.sh $(GPU_BIN)

bench-gpu: all
	$(Q)bench/bench_gpu.sh

PREFIX ?= /usr/local
install: $(BIN)/meshrun $(BIN)/trainer
	install -d $(DESTDIR)$(PREFIX)/bin
	install -m 755 $(BIN)/meshrun $(BIN)/trainer $(DESTDIR)$(PREFIX)/bin/

clean:
	rm -rf $(BUILD) $(BIN)

include fuzz/fuzz.mk

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
