/* export: the `trainer export` program. Writes a weights file saved by training as a llama2.c
 * file or a Hugging Face directory, checked against the plan's model; no model is built, no
 * device is opened. The conversion itself is trainer/weights' (and trainer/interop's) job. */
#ifndef MESHRUN_EXPORT_H
#define MESHRUN_EXPORT_H

#include <stddef.h>

#include "trainer/plan.h"

/* Returns 0, 2 (usage: unknown format, a file not of this model) or 1 (I/O), with the message
 * in err. */
int export_run(const plan_t *p, const char *weights, const char *format, const char *out, char *err, size_t errlen);

#endif
