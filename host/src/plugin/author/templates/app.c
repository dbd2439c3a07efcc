/* `{{name}}`: a Piper strategy. It starts as the smallest one that runs on
 * any number of devices -- data parallelism over all of them -- for you to
 * grow (the SDK is piper_strategy.h; `piper plugin build` supplies it with the
 * generated WIT bindings). */
#include <stdlib.h>
#include "piper_strategy.h"

void piper_strategy_info(piper_info *info) {
  piper_info_set(info, "{{name}}", "0.1.0", "data parallelism over every device (a skeleton to grow)");
}

bool piper_strategy_apply(piper_dag *dag, const piper_options *options) {
  (void)options;
  uint32_t n = piper_devices(dag);
  uint32_t *devices = malloc(n * sizeof *devices);
  if (devices == NULL) return false;
  for (uint32_t d = 0; d < n; d++) devices[d] = d;
  bool ok = piper_replicate(dag, piper_all(), devices, n, 0, "dp");
  free(devices);
  return ok;
}
