/* dump: the flight recorder's folder and request signal (see dump.h). */
#include "common/dump.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/fs.h"

int dump_signal(void) { return SIGRTMIN + 5; }

int dump_folder(const char *error_file, char *dir, size_t len) {
  const char *d = getenv("MESHRUN_DUMP_DIR");
  struct stat sb;
  int n;
  if (d && *d) {
    n = snprintf(dir, len, "%s", d);
  } else if (error_file && *error_file && fs_dirname(error_file, dir, len) == 0 && stat(dir, &sb) == 0 &&
             S_ISDIR(sb.st_mode)) {
    return 0;
  } else {
    n = snprintf(dir, len, "/tmp/meshrun-dumps-%u", (unsigned)getuid());
  }
  return n < 0 || (size_t)n >= len ? -ENAMETOOLONG : 0;
}
