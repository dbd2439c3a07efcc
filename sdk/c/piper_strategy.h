/* piper_strategy.h: write a Piper parallelism strategy in C.
 *
 * The C twin of the Rust `piper-sdk`: typed filters, options and plugin info
 * over the `piper:strategy` bindings that `piper plugin build` generates
 * (wit-bindgen's C generator), so a strategy never touches raw WIT records.
 *
 * A strategy defines two functions:
 *
 *   void piper_strategy_info(piper_info *info);
 *   bool piper_strategy_apply(piper_dag *dag, const piper_options *options);
 *
 * Every directive returns false on failure and keeps the host's message in
 * the dag; `apply` returns false to fail the plugin with that message (or one
 * set with piper_fail). Strings passed in are borrowed for the call only.
 */
#ifndef PIPER_STRATEGY_H
#define PIPER_STRATEGY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "strategy.h"

/* ---- filters ---- */

#define PIPER_MAX_TAGS 8

/* PASS values. */
#define PIPER_F "F"
#define PIPER_B "B"
#define PIPER_BI "BI"
#define PIPER_BW "BW"
#define PIPER_R "R"
#define PIPER_UPDATE "update"

typedef struct {
  const char *key;
  bool any;       /* the node carries the tag, whatever its index */
  uint32_t index; /* otherwise: exactly this index */
} piper_tag_match;

/* Selects nodes: every tag must match (AND); `pass` (or NULL) restricts to one op. */
typedef struct {
  size_t n;
  piper_tag_match tags[PIPER_MAX_TAGS];
  const char *pass;
} piper_filter;

piper_filter piper_all(void);
piper_filter piper_tag(const char *key, uint32_t index);
/* Adding a tag past PIPER_MAX_TAGS makes the filter invalid: the directive it
 * is given to fails with a message saying so. */
piper_filter piper_and(piper_filter f, const char *key, uint32_t index);
piper_filter piper_any(piper_filter f, const char *key);
piper_filter piper_pass(piper_filter f, const char *pass);

/* ---- the DAG ---- */

typedef struct piper_dag piper_dag;

/* Copy the matched sub-DAG n times along `dim` (microbatches: "MB"). */
bool piper_split(piper_dag *dag, piper_filter f, const char *dim, uint32_t n);
/* Put the matched compute nodes on `devices`; crossing edges get send/recv on `stream`. */
bool piper_place(piper_dag *dag, piper_filter f, const uint32_t *devices, size_t n_devices,
                 const char *stream);
/* Data parallelism over `devices` with ZeRO stage 0..3, collectives on `stream`. */
bool piper_replicate(piper_dag *dag, piper_filter f, const uint32_t *devices, size_t n_devices,
                     int zero_stage, const char *stream);
/* Activation recomputation: the matched forwards keep only what `policy`
   ("full" or "selective") says; a recompute node (PASS R) rebuilds the rest
   right before the backward. Apply it after every split/place/replicate.
   *count (if not NULL) gets how many forwards got one. */
bool piper_recompute(piper_dag *dag, piper_filter f, const char *policy, uint32_t *count);
/* Run group i before group i+1 on one device: build groups with an order. */
typedef struct piper_order piper_order;
piper_order *piper_order_new(void);
/* Start the next group. */
void piper_order_group(piper_order *o);
/* Add a filter to the current group. */
void piper_order_add(piper_order *o, piper_filter f);
/* Run the order directive and free the builder. */
bool piper_order_run(piper_dag *dag, piper_order *o);

/* Number of devices of the cluster. */
uint32_t piper_devices(piper_dag *dag);
/* How many indices a tag key spans (0: no node carries it). */
uint32_t piper_tag_extent(piper_dag *dag, const char *key);
/* The nodes a filter matches; free with piper_nodes_free. */
typedef piper_strategy_dag_list_node_info_t piper_nodes;
bool piper_query(piper_dag *dag, piper_filter f, piper_nodes *out);
void piper_nodes_free(piper_nodes *nodes);

/* Fail with a message (printf format); returns false. */
bool piper_fail(piper_dag *dag, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The message of the last failure, or "". */
const char *piper_error(const piper_dag *dag);

/* ---- options ---- */

typedef struct piper_options piper_options;

#define PIPER_OPT_ABSENT 0
#define PIPER_OPT_SET 1
#define PIPER_OPT_ERROR (-1)
/* PIPER_OPT_SET with *out filled, PIPER_OPT_ABSENT, or PIPER_OPT_ERROR with
 * the message in the dag (wrong type, out of range). */
int piper_opt_u32(piper_dag *dag, const piper_options *o, const char *name, uint32_t *out);
/* *out points at a NUL-terminated copy that lives until apply returns. */
int piper_opt_str(piper_dag *dag, const piper_options *o, const char *name, const char **out);

/* ---- info ---- */

typedef enum { PIPER_INT, PIPER_FLOAT, PIPER_BOOL, PIPER_STR } piper_type;
typedef struct piper_info piper_info;
void piper_info_set(piper_info *info, const char *name, const char *version,
                    const char *description);
/* An option; `dflt` is its default as text, or NULL for none. */
void piper_info_option(piper_info *info, const char *name, piper_type type, const char *dflt,
                       const char *help);

/* A line in the host's log ("debug", "info" or "warn"), shown with the plugin's name. */
void piper_log(const char *level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---- what a strategy defines ---- */
void piper_strategy_info(piper_info *info);
bool piper_strategy_apply(piper_dag *dag, const piper_options *options);

#endif
