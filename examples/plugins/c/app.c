/* 1F1B pipeline schedule (PipeDream-Flush) in C: the same plan as the bundled
 * Rust `1f1b`. Stage s of p runs p - s - 1 warm-up forwards, then alternates
 * one forward and one backward, then drains the remaining backwards. */
#include <stdlib.h>
#include <string.h>

#include "piper_strategy.h"

#define WHO "1f1b-c"

void piper_strategy_info(piper_info *info) {
  piper_info_set(info, WHO, "0.1.0", "1F1B pipeline schedule (PipeDream-Flush), in C");
  piper_info_option(info, "stages", PIPER_INT, NULL,
                    "pipeline stages (default: devices / data-parallel degree)");
  piper_info_option(info, "microbatches", PIPER_INT, NULL,
                    "microbatches per step (default: 2 x stages)");
  piper_info_option(info, "stream", PIPER_STR, "pp", "stream of the activation/gradient transfers");
  piper_info_option(info, "recompute", PIPER_STR, "none",
                    "activation recomputation after the schedule: none, full or selective");
}

/* Add one order group: `pass` of microbatch m over regions [lo, hi). */
static void step(piper_order *o, uint32_t lo, uint32_t hi, uint32_t m, const char *pass) {
  piper_order_group(o);
  for (uint32_t r = lo; r < hi; r++) piper_order_add(o, piper_pass(piper_and(piper_tag("PP", r), "MB", m), pass));
}

bool piper_strategy_apply(piper_dag *dag, const piper_options *options) {
  uint32_t devices = piper_devices(dag), regions = piper_tag_extent(dag, "PP");
  if (regions == 0) return piper_fail(dag, WHO " needs a model annotated with PP regions");

  /* The device group a data-parallel strategy applied before put the model on. */
  piper_nodes fwd;
  if (!piper_query(dag, piper_pass(piper_all(), PIPER_F), &fwd)) return false;
  size_t dp = fwd.ptr[0].devices.len ? fwd.ptr[0].devices.len : 1;
  uint32_t *base = calloc(dp, sizeof(uint32_t));
  for (size_t i = 0; i < fwd.ptr[0].devices.len; i++) base[i] = fwd.ptr[0].devices.ptr[i];
  bool uniform = true;
  for (size_t n = 1; n < fwd.len; n++) {
    if (fwd.ptr[n].devices.len != fwd.ptr[0].devices.len) uniform = false;
    for (size_t i = 0; uniform && i < fwd.ptr[n].devices.len; i++)
      if (fwd.ptr[n].devices.ptr[i] != base[i]) uniform = false;
  }
  piper_nodes_free(&fwd);
  if (!uniform) return piper_fail(dag, WHO " needs the whole model on one device group before it runs");

  uint32_t p = devices / (uint32_t)dp, mbs;
  const char *stream = "pp";
  if (piper_opt_u32(dag, options, "stages", &p) < 0) return false;
  if (p == 0) return piper_fail(dag, WHO " needs at least 1 pipeline position, got 0");
  if (p > regions) return piper_fail(dag, WHO " needs stages <= PP regions: got %u stages for %u regions", p, regions);
  if ((uint64_t)p * dp > devices)
    return piper_fail(dag, WHO " needs pipeline devices x data-parallel degree <= devices: %u x %zu > %u", p, dp, devices);
  for (size_t i = 0; i < dp; i++)
    if (base[i] + p - 1 >= devices) return piper_fail(dag, WHO ": the data-parallel group leaves no room for %u positions", p);
  int got = piper_opt_u32(dag, options, "microbatches", &mbs);
  if (got < 0) return false;
  if (got == PIPER_OPT_ABSENT) mbs = 2 * p;
  if (mbs == 0) return piper_fail(dag, WHO " needs at least 1 microbatch, got 0");
  if (piper_opt_str(dag, options, "stream", &stream) < 0) return false;

  /* 1-2. Microbatches; stage s holds a contiguous block of regions on group base + s. */
  if (!piper_split(dag, piper_all(), "MB", mbs)) return false;
  uint32_t per = regions / p, extra = regions % p, *lo = calloc(p + 1, sizeof(uint32_t));
  uint32_t *group = calloc(dp, sizeof(uint32_t));
  for (uint32_t s = 0; s < p; s++) {
    lo[s + 1] = lo[s] + per + (s < extra);
    for (size_t i = 0; i < dp; i++) group[i] = base[i] + s;
    for (uint32_t r = lo[s]; r < lo[s + 1]; r++)
      if (!piper_place(dag, piper_tag("PP", r), group, dp, stream)) return false;
  }
  /* 3. Per stage: warm-up forwards, one forward one backward, cool-down backwards. */
  for (uint32_t s = 0; s < p; s++) {
    uint32_t warmup = p - s - 1 < mbs ? p - s - 1 : mbs;
    piper_order *o = piper_order_new();
    for (uint32_t i = 0; i < warmup; i++) step(o, lo[s], lo[s + 1], i, PIPER_F);
    for (uint32_t i = 0; i < mbs - warmup; i++) {
      step(o, lo[s], lo[s + 1], warmup + i, PIPER_F);
      step(o, lo[s], lo[s + 1], i, PIPER_B);
    }
    for (uint32_t i = mbs - warmup; i < mbs; i++) step(o, lo[s], lo[s + 1], i, PIPER_B);
    if (!piper_order_run(dag, o)) return false;
  }
  free(lo);
  free(group);
  free(base);
  /* 4. Activation recomputation, every region's forwards, if asked for. */
  const char *recompute = "none";
  if (piper_opt_str(dag, options, "recompute", &recompute) < 0) return false;
  if (strcmp(recompute, "none") == 0) return true;
  for (uint32_t r = 0; r < regions; r++)
    if (!piper_recompute(dag, piper_pass(piper_tag("PP", r), PIPER_F), recompute, NULL)) return false;
  return true;
}
