/* `{{name}}`: a Piper strategy. It starts as the smallest one that runs --
 * every segment on device 0 -- for you to grow (the SDK is piper_strategy.h;
 * `piper plugin build` supplies it with the generated WIT bindings). */
#include "piper_strategy.h"

void piper_strategy_info(piper_info *info) {
  piper_info_set(info, "{{name}}", "0.1.0", "every segment on device 0 (a skeleton to grow)");
}

bool piper_strategy_apply(piper_dag *dag, const piper_options *options) {
  (void)options;
  const uint32_t device0[] = {0};
  return piper_place(dag, piper_all(), device0, 1, "pp");
}
