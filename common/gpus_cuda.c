/* gpus_cuda: gpus.h for NVIDIA GPUs, counted as CUDA will number them, without the driver: one
 * /dev/nvidiaN file per GPU the driver exposes, restricted by CUDA_VISIBLE_DEVICES under CUDA's
 * rules. Built into both programs whatever the build has: the launcher counts GPUs for workers
 * that may come from another build. */
#include "common/gpus.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#define SEEN_MAX 256 /* ordinals remembered for duplicates (meshrun's most local ranks) */

/* nvidia0, nvidia1, ...: a GPU; nvidiactl, nvidia-uvm, nvidia-modeset and nvidia-caps are not. */
static int is_gpu_file(const char *name) {
  if (strncmp(name, "nvidia", 6) != 0 || !name[6]) return 0;
  for (const char *p = name + 6; *p; p++)
    if (!isdigit((unsigned char)*p)) return 0;
  return 1;
}

/* A device ordinal below n, in decimal ("-0" is 0, as strtol reads it): 0 with *out, or -1. */
static int ordinal(const char *s, long n, long *out) {
  const char *d = s + (*s == '-');
  if (!*d || d[strspn(d, "0123456789")]) return -1;
  errno = 0;
  const long v = strtol(s, NULL, 10);
  if (errno == ERANGE || v < 0 || v >= n) return -1;
  *out = v;
  return 0;
}

int gpus_count(const char *dev_dir, const char *visible) {
  DIR *d = opendir(dev_dir);
  if (!d) return 0;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (is_gpu_file(e->d_name)) n++;
  closedir(d);
  if (!visible || n == 0) return n;

  /* CUDA reads the list left to right and stops at the first entry it cannot use, so "0,7,1" on
   * a 4-GPU machine is one GPU and "" is none. UUIDs cannot be checked without the driver; each
   * counts as one GPU, never more than exist. */
  char seen[SEEN_MAX] = {0};
  int count = 0;
  const char *p = visible;
  while (count < n) {
    while (*p == ' ' || *p == '\t') p++;
    size_t len = strcspn(p, ",");
    char tok[128];
    if (len == 0 || len >= sizeof tok) break;
    memcpy(tok, p, len);
    tok[len] = '\0';
    for (size_t t = len; t > 0 && (tok[t - 1] == ' ' || tok[t - 1] == '\t'); t--) tok[t - 1] = '\0';
    long v;
    if (ordinal(tok, n, &v) == 0) {
      if (v < SEEN_MAX) {
        if (seen[v]) break;
        seen[v] = 1;
      }
      count++;
    } else if (strncmp(tok, "GPU-", 4) == 0 || strncmp(tok, "MIG-", 4) == 0) {
      count++;
    } else {
      break;
    }
    if (p[len] != ',') break;
    p += len + 1;
  }
  return count;
}

int gpus_visible(void) { return gpus_count("/dev", getenv("CUDA_VISIBLE_DEVICES")); }

const char *gpus_none_hint(void) { return "no /dev/nvidiaN, or CUDA_VISIBLE_DEVICES hides them all"; }
