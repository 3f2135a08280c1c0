# fuzz.mk: libFuzzer targets (fuzz/fuzz_<name>.c), built with clang under ASAN+UBSAN into
# $(BUILD)/fuzz/, apart from the gcc objects. Included from the top Makefile.
#
# Each target's first line names the project sources it links, as tests do
# (// deps: trainer/plan/plan.c fuzz/support.c); its second line caps the input size (// max_len: N).
# Those sources are compiled again with clang and coverage into $(BUILD)/fuzz/obj/.
#
#   make fuzz      each target FUZZ_SECONDS (60) on the repo corpus; new inputs go to
#                  $(BUILD)/fuzz/corpus/<name>/, never into the repo
#   make fuzz-ci   each target FUZZ_CI_SECONDS (15) from an empty scratch corpus plus the repo one
#                  (read-only), after the committed reproducers fuzz/crashes/<name>-*; fails on a crash
#   make fuzz-merge  adds to fuzz/corpus/<name>/ the inputs of $(BUILD)/fuzz/corpus/<name>/ that
#                  cover something new (libFuzzer -merge=1; files named by their SHA-1), to commit
# FUZZ_TARGETS picks targets (default all), FUZZ_JOBS how many run at once (default 2).

FUZZ_CC      ?= clang
FUZZ_DIR     := $(BUILD)/fuzz
FUZZ_SECONDS ?= 60
FUZZ_CI_SECONDS ?= 15
FUZZ_JOBS    ?= 2
FUZZ_SAN     ?= -fsanitize=address,undefined -fno-sanitize-recover=undefined
FUZZ_CFLAGS  := -std=gnu11 -g -O1 -fno-omit-frame-pointer -Wall -Wextra -Wno-unused-parameter \
                -Wno-missing-field-initializers -Wno-unknown-pragmas -fno-strict-aliasing -MMD -MP -I. -D_GNU_SOURCE -fopenmp \
                $(UV_CFLAGS) $(CJSON_CFLAGS) $(BLAS_CFLAGS) $(CRYPTO_CFLAGS) $(FUZZ_SAN) -fsanitize=fuzzer-no-link

FUZZ_SRC     := $(wildcard fuzz/fuzz_*.c)
FUZZ_NAMES   := $(FUZZ_SRC:fuzz/fuzz_%.c=%)
FUZZ_TARGETS ?= $(FUZZ_NAMES)
FUZZ_BIN     := $(FUZZ_NAMES:%=$(FUZZ_DIR)/fuzz_%)

$(FUZZ_DIR)/obj/%.o: %.c
	@mkdir -p $(@D)
	@$(if $(Q),echo "  FUZZCC  $<")
	$(Q)$(FUZZ_CC) $(FUZZ_CFLAGS) -c -o $@ $<

# clang, never nvcc: with backend.c or comm.c, their registries' sets as a build without CUDA
# has them (Makefile).
fuzz_deps_of = $(sort $(patsubst %.c,$(FUZZ_DIR)/obj/%.o,\
               $(call with_sets,$(call raw_deps,$(1)),$(BACKEND_SET_HOST),$(COMM_SET_HOST))))
define fuzz_link_rule
$(FUZZ_DIR)/fuzz_$(1): $(FUZZ_DIR)/obj/fuzz/fuzz_$(1).o $(call fuzz_deps_of,fuzz/fuzz_$(1).c)
	@$$(if $$(Q),echo "  FUZZLD  $$@")
	$$(Q)$$(FUZZ_CC) $$(FUZZ_SAN) -fsanitize=fuzzer -fopenmp -o $$@ $$^ $$(ALL_LIBS) $(if $(call needs_pcre2,fuzz/fuzz_$(1).c),$$(PCRE2_LIBS))
endef
$(foreach n,$(FUZZ_NAMES),$(eval $(call fuzz_link_rule,$(n))))

.PHONY: fuzz fuzz-ci fuzz-build fuzz-merge
fuzz-build: $(FUZZ_TARGETS:%=$(FUZZ_DIR)/fuzz_%)

fuzz: fuzz-build
	$(Q)FUZZ_JOBS=$(FUZZ_JOBS) fuzz/run.sh long $(FUZZ_SECONDS) $(FUZZ_DIR) $(FUZZ_TARGETS)

fuzz-ci: fuzz-build
	$(Q)FUZZ_JOBS=$(FUZZ_JOBS) fuzz/run.sh ci $(FUZZ_CI_SECONDS) $(FUZZ_DIR) $(FUZZ_TARGETS)

fuzz-merge: fuzz-build
	$(Q)for t in $(FUZZ_TARGETS); do \
	  [ -d $(FUZZ_DIR)/corpus/$$t ] || continue; \
	  n=$$(ls fuzz/corpus/$$t | wc -l); \
	  mkdir -p $(FUZZ_DIR)/artifacts/$$t; \
	  $(FUZZ_DIR)/fuzz_$$t -merge=1 -max_len=$$(sed -n '2s|^// max_len: *||p' fuzz/fuzz_$$t.c) \
	    -artifact_prefix=$(FUZZ_DIR)/artifacts/$$t/ fuzz/corpus/$$t $(FUZZ_DIR)/corpus/$$t \
	    >$(FUZZ_DIR)/logs/$$t.merge.log 2>&1 || exit 1; \
	  echo "  MERGE   $$t: $$n -> $$(ls fuzz/corpus/$$t | wc -l) inputs"; \
	done
