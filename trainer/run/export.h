/* export: the `trainer export` program. Writes any weights the trainer reads (our safetensors,
 * a llama2.c file, a Hugging Face folder, a checkpoint's parameters; the format found from the
 * content) as a llama2.c file or a Hugging Face folder. The model is the file's own when no
 * plan file is given (the --set model keys checked against it), else the plan's, checked
 * against the file (a mismatch names the field, exit 2). To HF, the tokenizer goes along when one is known: data.tokenizer (or,
 * without a plan file, the one in our file's metadata plan, or the source HF folder's) when it
 * is a tokenizer.json, copied beside the weights (its post-processor made to put BOS first,
 * as trainer sample does with a prompt: tokenizer_json_bos_first) with a tokenizer_config.json
 * naming its BOS and EOS and the model's inputs (input_ids, attention_mask: no token_type_ids),
 * so the folder is complete for `transformers`; a llama2.c tokenizer.bin is
 * converted to a sentencepiece-style tokenizer.json (tokenizer_llama2c_json: the same ids), read
 * back, and written the same way; one that cannot be converted (byte tokens not at 3..258) is
 * left out with a warning naming why. Without a tokenizer, the tokenizer files an earlier export
 * left in the folder are removed (a warning each). Either way the tokenizer's BOS and EOS ids go into config.json
 * and generation_config.json (config.json says null without a tokenizer), so that
 * transformers' generate stops at EOS as `trainer sample` does. No model is built, no device
 * is opened. The conversion itself is trainer/run/weights' and trainer/formats/interop's job. */
#ifndef MESHRUN_EXPORT_H
#define MESHRUN_EXPORT_H

#include <stddef.h>

#include "trainer/plan/plan.h"

/* path: the weights; plan_file: p came from a plan file (else sets, the --set list, names the
 * model keys to check). Returns 0, 2 (usage: unknown format, a weights file not of this model,
 * a tokenizer larger than the vocabulary) or 1 (I/O), with one line in err. */
int export_run(const plan_t *p, const char *path, int plan_file, const char *const *sets, int nsets,
               const char *format, const char *out, char *err, size_t errlen);

#endif
