# meshrun: one Makefile for both programs, their tests, the demo and the benchmarks.
# Objects go under $(BUILD), programs under $(BIN). Knobs: V=1 (show commands), DEBUG=1, ASAN=1,
# CUDA_HOME (the cuda backend builds only where nvcc exists), BUILD/BIN (separate trees).
#
# Unit tests are test/unit/test_*.c, one binary each. The first line of each test names the
# project sources it links:  // deps: common/store.c launcher/store_server.c
# Tools that tests drive are test/tools/*.c with the same "deps" line.

BUILD ?= build
BIN   ?= bin
PYTHON ?= /usr/bin/python3

CC      ?= cc
CFLAGS  := -std=gnu11 -Wall -Wextra -Werror -Wno-unused-parameter -Wno-missing-field-initializers \
           -fno-strict-aliasing -MMD -MP -I. -D_GNU_SOURCE
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

UV_CFLAGS    := $(shell pkg-config --cflags libuv 2>/dev/null)
UV_LIBS      := $(shell pkg-config --libs libuv 2>/dev/null || echo -luv)
CJSON_CFLAGS := $(shell pkg-config --cflags libcjson 2>/dev/null)
CJSON_LIBS   := $(shell pkg-config --libs libcjson 2>/dev/null || echo -lcjson)
BLAS_CFLAGS  := $(shell pkg-config --cflags openblas 2>/dev/null)
BLAS_LIBS    := $(shell pkg-config --libs openblas 2>/dev/null || echo -lopenblas)
CMOCKA_LIBS  := $(shell pkg-config --libs cmocka 2>/dev/null || echo -lcmocka)
CFLAGS += $(UV_CFLAGS) $(CJSON_CFLAGS) $(BLAS_CFLAGS) -fopenmp
LDFLAGS += -fopenmp
ALL_LIBS := $(UV_LIBS) $(CJSON_LIBS) $(BLAS_LIBS) $(LDLIBS)

ifneq ($(V),1)
  Q := @
endif

# --- CUDA: the cuda backend builds when nvcc exists; nothing else ever needs it.
CUDA_HOME ?= /usr/local/cuda
NVCC := $(shell command -v nvcc 2>/dev/null || ls $(CUDA_HOME)/bin/nvcc 2>/dev/null)
CU_SRC := $(wildcard trainer/*.cu)
ifneq ($(NVCC),)
ifneq ($(CU_SRC),)
  HAVE_CUDA := 1
  NVCCFLAGS := -O3 -std=c++17 -I. -arch=sm_90 -Xcompiler -Wall,-Werror,-fPIC -Werror all-warnings -MMD -MP
  CFLAGS += -DMESHRUN_HAVE_CUDA=1 -I$(CUDA_HOME)/include
  CUDA_LIBDIRS := $(CUDA_HOME)/lib64 $(CUDA_HOME)/lib
  CUDA_LIBS := $(foreach d,$(CUDA_LIBDIRS),-L$(d) -Wl,-rpath,$(d)) -lcublasLt -lcublas -lcudart -lnccl -lstdc++
endif
endif

COMMON_SRC   := $(wildcard common/*.c)
LAUNCHER_SRC := $(wildcard launcher/*.c)
TRAINER_SRC  := $(wildcard trainer/*.c)
COMMON_OBJ   := $(COMMON_SRC:%.c=$(BUILD)/%.o)
LAUNCHER_OBJ := $(LAUNCHER_SRC:%.c=$(BUILD)/%.o)
TRAINER_OBJ  := $(TRAINER_SRC:%.c=$(BUILD)/%.o) $(if $(HAVE_CUDA),$(CU_SRC:%.cu=$(BUILD)/%.o))

UNIT_SRC  := $(wildcard test/unit/test_*.c)
UNIT_BIN  := $(UNIT_SRC:test/unit/%.c=$(BUILD)/test/%)
GPU_SRC   := $(if $(HAVE_CUDA),$(wildcard test/gpu/test_*.c))
GPU_BIN   := $(GPU_SRC:test/gpu/%.c=$(BUILD)/test-gpu/%)
TOOL_SRC  := $(wildcard test/tools/*.c)
TOOL_BIN  := $(TOOL_SRC:test/tools/%.c=$(BUILD)/tools/%)

.PHONY: all test unit integration test-gpu demo bench bench-gpu install clean
all: $(BIN)/meshrun $(BIN)/trainer $(UNIT_BIN) $(TOOL_BIN) $(GPU_BIN)

$(BIN)/meshrun: $(LAUNCHER_OBJ) $(COMMON_OBJ)
	@mkdir -p $(@D)
	@$(if $(Q),echo "  LD      $@")
	$(Q)$(CC) $(LDFLAGS) -o $@ $^ $(ALL_LIBS)

$(BIN)/trainer: $(TRAINER_OBJ) $(COMMON_OBJ)
	@mkdir -p $(@D)
	@$(if $(Q),echo "  LD      $@")
	$(Q)$(CC) $(LDFLAGS) -o $@ $^ $(ALL_LIBS) $(CUDA_LIBS)

$(BUILD)/%.o: %.c
	@mkdir -p $(@D)
	@$(if $(Q),echo "  CC      $<")
	$(Q)$(CC) $(CFLAGS) -c -o $@ $<

$(BUILD)/%.o: %.cu
	@mkdir -p $(@D)
	@$(if $(Q),echo "  NVCC    $<")
	$(Q)$(NVCC) $(NVCCFLAGS) -c -o $@ $<

# A test or tool links its own object plus the sources its "// deps:" line names. Where the cuda
# backend is built, whatever links trainer/backend.c (the backend factory) also gets it and CUDA.
raw_deps = $(shell sed -n '1s|^// deps: *||p' $(1))
needs_cuda = $(if $(HAVE_CUDA),$(or $(filter trainer/backend.c %.cu,$(call raw_deps,$(1))),$(findstring test/gpu/,$(1))))
CU_OBJ := $(CU_SRC:%.cu=$(BUILD)/%.o)
deps_of = $(sort $(patsubst %.cu,$(BUILD)/%.o,$(patsubst %.c,$(BUILD)/%.o,$(call raw_deps,$(1)))) \
          $(if $(call needs_cuda,$(1)),$(CU_OBJ)))
define link_rule
$(2): $(BUILD)/$(1:%.c=%.o) $(call deps_of,$(1))
	@mkdir -p $$(@D)
	@$$(if $$(Q),echo "  LD      $$@")
	$$(Q)$$(CC) $$(LDFLAGS) -o $$@ $$^ $$(ALL_LIBS) $$(CMOCKA_LIBS) $(if $(call needs_cuda,$(1)),$$(CUDA_LIBS))
endef
$(foreach t,$(UNIT_SRC),$(eval $(call link_rule,$(t),$(t:test/unit/%.c=$(BUILD)/test/%))))
$(foreach t,$(TOOL_SRC),$(eval $(call link_rule,$(t),$(t:test/tools/%.c=$(BUILD)/tools/%))))
# GPU tests (test/gpu/test_*.c) build only with the cuda backend and run only under test-gpu.
$(foreach t,$(GPU_SRC),$(eval $(call link_rule,$(t),$(t:test/gpu/%.c=$(BUILD)/test-gpu/%))))

# The whole suite: C unit tests (each in its own process), then integration tests with real
# processes on loopback and the PyTorch oracle.
test: all
	$(Q)$(MAKE) --no-print-directory unit
	$(Q)$(MAKE) --no-print-directory integration

unit: $(UNIT_BIN)
	$(Q)scripts/run-unit-tests.sh $(UNIT_BIN)

integration: all
	$(Q)MESHRUN_BIN=$(abspath $(BIN)) MESHRUN_BUILD=$(abspath $(BUILD)) $(PYTHON) -m pytest -q -p no:cacheprovider test/integration

demo: $(BIN)/trainer
	$(Q)$(BIN)/trainer configs/demo.json

bench: all
	$(Q)MESHRUN_BIN=$(abspath $(BIN)) MESHRUN_BUILD=$(abspath $(BUILD)) scripts/bench.sh

test-gpu: all
	$(Q)MESHRUN_BIN=$(abspath $(BIN)) MESHRUN_BUILD=$(abspath $(BUILD)) scripts/test-gpu.sh $(GPU_BIN)

bench-gpu: all
	$(Q)scripts/bench-gpu.sh

PREFIX ?= /usr/local
install: $(BIN)/meshrun $(BIN)/trainer
	install -d $(DESTDIR)$(PREFIX)/bin
	install -m 755 $(BIN)/meshrun $(BIN)/trainer $(DESTDIR)$(PREFIX)/bin/

clean:
	rm -rf $(BUILD) $(BIN)

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
