/* fs: small filesystem helpers shared by the launcher (log directories) and the trainer
 * (metrics, weights, checkpoints, exports). Errors are -errno; callers word the message. */
#ifndef MESHRUN_FS_H
#define MESHRUN_FS_H

#include <stddef.h>

/* mkdir -p: creates dir and every missing parent (mode 0755); existing ones are fine. Returns 0
 * or -errno, with the component that could not be made in failed (when non-NULL). "" is a
 * no-op. */
int fs_mkdir_p(const char *dir, char *failed, size_t failedlen);
/* mkdir -p of the directory part of path ("a/b/c.json" makes a/b; "c.json" makes nothing). */
int fs_mkdir_parent(const char *path, char *failed, size_t failedlen);
/* The directory part of path into out: "a/b/c.json" -> "a/b", "c.json" -> ".", "/c" -> "/".
 * 0, or -ENAMETOOLONG when it does not fit. */
int fs_dirname(const char *path, char *out, size_t len);
/* The whole of a regular file of at most max bytes, malloc'ed into *out with a NUL past its *len
 * bytes. Refused before reading: a path that is not a regular file (-EINVAL; a FIFO is opened
 * without waiting for a writer), a file over max (-EFBIG, *size gets its size). The limit holds
 * while reading too (a file that grows past it: -EFBIG with *size -1). Else 0 or -errno. size
 * may be NULL. */
int fs_read_file(const char *path, size_t max, char **out, size_t *len, long long *size);

/* The paths named by lines (one path or glob a line, as the trainer's data.train keeps a list):
 * a line without *, ? or [ is taken as it is; a glob is expanded, sorted, and must match.
 * Returns 0 with *out a NULL-terminated malloc'ed array (free with fs_paths_free) of *n paths;
 * -ENOENT with the glob that matched nothing in bad; -ENOMEM. */
int fs_expand_paths(const char *lines, char ***out, size_t *n, char *bad, size_t badlen);
void fs_paths_free(char **paths); /* accepts NULL */

/* Unlinks path if it is there. The existence check takes no lock; an unlink locks the
 * directory even to find nothing, which many processes sharing a directory contend for. */
void fs_unlink_if_there(const char *path);

#endif
