/* attention_registry: the values of the plan's model.attention, in attn_choice_t order
 * (backend.h). "cudnn" is the fused kernel the cuda backend runs (trainer/backend/attention_cudnn.*);
 * a backend without one (cpu) takes "auto" and "reference" only. Like the backend and comm
 * registries, the one shared place that names the variants. */
#include "trainer/backend/backend.h"

const char *const attention_names[] = {"auto", "cudnn", "reference", NULL};
