/* A C strategy that fails on purpose (host/tests/languages.rs): mode = raise
 * (piper_fail with a message), directive (a directive the host refuses). */
#include <string.h>

#include "piper_strategy.h"

void piper_strategy_info(piper_info *info) {
  piper_info_set(info, "errors-c", "0.1.0", "fails on purpose");
  piper_info_option(info, "mode", PIPER_STR, "raise", "raise | directive");
}

bool piper_strategy_apply(piper_dag *dag, const piper_options *options) {
  const char *mode = "raise";
  if (piper_opt_str(dag, options, "mode", &mode) < 0) return false;
  if (strcmp(mode, "raise") == 0) return piper_fail(dag, "stage %d has no devices", 3);
  const uint32_t devices[] = {99};
  if (!piper_place(dag, piper_all(), devices, 1, "pp")) return false;
  return true;
}
