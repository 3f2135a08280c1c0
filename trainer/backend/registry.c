/* registry: the compute backends this trainer knows, in the order messages and --version name
 * them. One line per backend, X(name): its entry backend_entry_<name>, defined in its own file
 * (backend_<name>.*), or in a build without its toolkit in the stand-in the Makefile compiles
 * instead (backend_<name>_absent.c), so that every build knows every name. device "auto" tries
 * the device backends in this order. */
#include "trainer/backend/backend.h"

#define BACKENDS(X) \
  X(cpu)            \
  X(cuda)

#define DECLARE(name) extern const backend_entry_t backend_entry_##name;
#define LIST(name) &backend_entry_##name,
BACKENDS(DECLARE)

const backend_entry_t *const backend_registry[] = {BACKENDS(LIST) NULL};
