/* piper_strategy.c: the C SDK over the generated `piper:strategy` bindings
 * (see piper_strategy.h). Exports the component's `info` and `apply`. */
#include "piper_strategy.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- allocation: running out of memory is a trap the host reports as the memory cap ---- */

static void *xrealloc(void *p, size_t n) {
  void *q = realloc(p, n ? n : 1);
  if (!q) abort();
  return q;
}

static strategy_string_t borrowed(const char *s) {
  strategy_string_t out = {(uint8_t *)s, s ? strlen(s) : 0};
  return out;
}

/* ---- filters ---- */

piper_filter piper_all(void) {
  piper_filter f;
  memset(&f, 0, sizeof f);
  return f;
}

static piper_filter with(piper_filter f, const char *key, bool any, uint32_t index) {
  for (size_t i = 0; i < f.n && i < PIPER_MAX_TAGS; i++) {
    if (strcmp(f.tags[i].key, key) == 0) {
      f.tags[i].any = any;
      f.tags[i].index = index;
      return f;
    }
  }
  if (f.n < PIPER_MAX_TAGS) {
    f.tags[f.n].key = key;
    f.tags[f.n].any = any;
    f.tags[f.n].index = index;
  }
  f.n++; /* past PIPER_MAX_TAGS: invalid, refused when used */
  return f;
}

piper_filter piper_tag(const char *key, uint32_t index) { return with(piper_all(), key, false, index); }
piper_filter piper_and(piper_filter f, const char *key, uint32_t index) { return with(f, key, false, index); }
piper_filter piper_any(piper_filter f, const char *key) { return with(f, key, true, 0); }
piper_filter piper_pass(piper_filter f, const char *pass) {
  f.pass = pass;
  return f;
}

/* The WIT filter of f; its tag array is owned by the caller (free wit->tags.ptr). */
static void to_wit(const piper_filter *f, piper_strategy_dag_filter_t *wit) {
  size_t n = f->n < PIPER_MAX_TAGS ? f->n : PIPER_MAX_TAGS;
  wit->tags.ptr = xrealloc(NULL, n * sizeof(piper_strategy_types_tag_filter_t));
  wit->tags.len = n;
  for (size_t i = 0; i < n; i++) {
    wit->tags.ptr[i].key = borrowed(f->tags[i].key);
    wit->tags.ptr[i].value.tag =
        f->tags[i].any ? PIPER_STRATEGY_TYPES_TAG_MATCH_ANY : PIPER_STRATEGY_TYPES_TAG_MATCH_INDEX;
    wit->tags.ptr[i].value.val.index = f->tags[i].index;
  }
  wit->pass.is_some = f->pass != NULL;
  wit->pass.val = borrowed(f->pass);
}

/* ---- the DAG ---- */

struct piper_dag {
  piper_strategy_dag_borrow_training_dag_t handle;
  char *error;
};

bool piper_fail(piper_dag *dag, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(NULL, 0, fmt, ap);
  va_end(ap);
  if (n < 0) n = 0;
  char *m = xrealloc(NULL, (size_t)n + 1);
  va_start(ap, fmt);
  vsnprintf(m, (size_t)n + 1, fmt, ap);
  va_end(ap);
  free(dag->error);
  dag->error = m;
  return false;
}

const char *piper_error(const piper_dag *dag) { return dag->error ? dag->error : ""; }

static bool check_filter(piper_dag *dag, const piper_filter *f) {
  if (f->n > PIPER_MAX_TAGS) {
    return piper_fail(dag, "a filter has %zu tags; the C SDK holds at most %d (PIPER_MAX_TAGS)", f->n,
                      PIPER_MAX_TAGS);
  }
  return true;
}

/* Keep the host's message of a failed call; every dag-error case is a string. */
static bool host_error(piper_dag *dag, piper_strategy_dag_dag_error_t *err) {
  strategy_string_t *s = &err->val.unknown_tag;
  piper_fail(dag, "%.*s", (int)s->len, (const char *)s->ptr);
  piper_strategy_dag_dag_error_free(err);
  return false;
}

bool piper_split(piper_dag *dag, piper_filter f, const char *dim, uint32_t n) {
  if (!check_filter(dag, &f)) return false;
  piper_strategy_dag_filter_t wf;
  to_wit(&f, &wf);
  strategy_string_t d = borrowed(dim);
  piper_strategy_dag_dag_error_t err;
  bool ok = piper_strategy_dag_method_training_dag_split(dag->handle, &wf, &d, n, &err);
  free(wf.tags.ptr);
  return ok || host_error(dag, &err);
}

bool piper_recompute(piper_dag *dag, piper_filter f, const char *policy, uint32_t *count) {
  piper_strategy_dag_recompute_policy_t p;
  if (policy != NULL && strcmp(policy, "full") == 0) {
    p = PIPER_STRATEGY_DAG_RECOMPUTE_POLICY_FULL;
  } else if (policy != NULL && strcmp(policy, "selective") == 0) {
    p = PIPER_STRATEGY_DAG_RECOMPUTE_POLICY_SELECTIVE;
  } else {
    return piper_fail(dag, "recompute policy `%s` is not full or selective",
                      policy != NULL ? policy : "(null)");
  }
  if (!check_filter(dag, &f)) return false;
  piper_strategy_dag_filter_t wf;
  to_wit(&f, &wf);
  uint32_t made = 0;
  piper_strategy_dag_dag_error_t err;
  bool ok = piper_strategy_dag_method_training_dag_recompute(dag->handle, &wf, p, &made, &err);
  free(wf.tags.ptr);
  if (ok && count != NULL) *count = made;
  return ok || host_error(dag, &err);
}

bool piper_place(piper_dag *dag, piper_filter f, const uint32_t *devices, size_t n_devices,
                 const char *stream) {
  if (!check_filter(dag, &f)) return false;
  piper_strategy_dag_filter_t wf;
  to_wit(&f, &wf);
  strategy_list_u32_t devs = {(uint32_t *)devices, n_devices};
  strategy_string_t s = borrowed(stream);
  piper_strategy_dag_dag_error_t err;
  bool ok = piper_strategy_dag_method_training_dag_place(dag->handle, &wf, &devs, &s, &err);
  free(wf.tags.ptr);
  return ok || host_error(dag, &err);
}

bool piper_replicate(piper_dag *dag, piper_filter f, const uint32_t *devices, size_t n_devices,
                     int zero_stage, const char *stream) {
  if (!check_filter(dag, &f)) return false;
  if (zero_stage < 0 || zero_stage > 3) {
    return piper_fail(dag, "piper_replicate: ZeRO stage must be 0..3, got %d", zero_stage);
  }
  piper_strategy_dag_filter_t wf;
  to_wit(&f, &wf);
  strategy_list_u32_t devs = {(uint32_t *)devices, n_devices};
  piper_strategy_dag_replicate_options_t o;
  memset(&o, 0, sizeof o);
  o.shard_optimizer = zero_stage >= 1;
  o.shard_grads = zero_stage >= 2;
  o.shard_params = zero_stage >= 3;
  o.reduce_stream = borrowed(stream);
  o.gather_stream = borrowed(stream);
  o.reshard_after_forward = true;
  piper_strategy_dag_dag_error_t err;
  bool ok = piper_strategy_dag_method_training_dag_replicate(dag->handle, &wf, &devs, &o, &err);
  free(wf.tags.ptr);
  return ok || host_error(dag, &err);
}

struct piper_order {
  size_t n_groups;
  size_t *lens;
  piper_filter **groups;
};

piper_order *piper_order_new(void) {
  piper_order *o = xrealloc(NULL, sizeof *o);
  memset(o, 0, sizeof *o);
  return o;
}

void piper_order_group(piper_order *o) {
  o->groups = xrealloc(o->groups, (o->n_groups + 1) * sizeof *o->groups);
  o->lens = xrealloc(o->lens, (o->n_groups + 1) * sizeof *o->lens);
  o->groups[o->n_groups] = NULL;
  o->lens[o->n_groups] = 0;
  o->n_groups++;
}

void piper_order_add(piper_order *o, piper_filter f) {
  if (o->n_groups == 0) piper_order_group(o);
  size_t g = o->n_groups - 1;
  o->groups[g] = xrealloc(o->groups[g], (o->lens[g] + 1) * sizeof(piper_filter));
  o->groups[g][o->lens[g]++] = f;
}

static void order_free(piper_order *o) {
  for (size_t g = 0; g < o->n_groups; g++) free(o->groups[g]);
  free(o->groups);
  free(o->lens);
  free(o);
}

bool piper_order_run(piper_dag *dag, piper_order *o) {
  for (size_t g = 0; g < o->n_groups; g++) {
    for (size_t i = 0; i < o->lens[g]; i++) {
      if (!check_filter(dag, &o->groups[g][i])) {
        order_free(o);
        return false;
      }
    }
  }
  piper_strategy_dag_list_list_filter_t groups;
  groups.len = o->n_groups;
  groups.ptr = xrealloc(NULL, o->n_groups * sizeof *groups.ptr);
  for (size_t g = 0; g < o->n_groups; g++) {
    groups.ptr[g].len = o->lens[g];
    groups.ptr[g].ptr = xrealloc(NULL, o->lens[g] * sizeof(piper_strategy_dag_filter_t));
    for (size_t i = 0; i < o->lens[g]; i++) to_wit(&o->groups[g][i], &groups.ptr[g].ptr[i]);
  }
  piper_strategy_dag_dag_error_t err;
  bool ok = piper_strategy_dag_method_training_dag_order(dag->handle, &groups, &err);
  for (size_t g = 0; g < o->n_groups; g++) {
    for (size_t i = 0; i < o->lens[g]; i++) free(groups.ptr[g].ptr[i].tags.ptr);
    free(groups.ptr[g].ptr);
  }
  free(groups.ptr);
  order_free(o);
  return ok || host_error(dag, &err);
}

uint32_t piper_devices(piper_dag *dag) {
  piper_strategy_dag_cluster_info_t c;
  piper_strategy_dag_method_training_dag_cluster(dag->handle, &c);
  return c.devices;
}

uint32_t piper_tag_extent(piper_dag *dag, const char *key) {
  piper_strategy_dag_list_tag_t tags;
  piper_strategy_dag_method_training_dag_tag_extents(dag->handle, &tags);
  uint32_t n = 0;
  for (size_t i = 0; i < tags.len; i++) {
    if (tags.ptr[i].key.len == strlen(key) && memcmp(tags.ptr[i].key.ptr, key, tags.ptr[i].key.len) == 0) {
      n = tags.ptr[i].index;
    }
  }
  piper_strategy_dag_list_tag_free(&tags);
  return n;
}

bool piper_query(piper_dag *dag, piper_filter f, piper_nodes *out) {
  if (!check_filter(dag, &f)) return false;
  piper_strategy_dag_filter_t wf;
  to_wit(&f, &wf);
  piper_strategy_dag_dag_error_t err;
  bool ok = piper_strategy_dag_method_training_dag_query(dag->handle, &wf, out, &err);
  free(wf.tags.ptr);
  if (!ok) {
    out->ptr = NULL;
    out->len = 0;
  }
  return ok || host_error(dag, &err);
}

void piper_nodes_free(piper_nodes *nodes) { piper_strategy_dag_list_node_info_free(nodes); }

/* ---- options ---- */

struct piper_options {
  strategy_list_option_entry_t *entries;
  /* NUL-terminated copies handed out by piper_opt_str */
  char **strings;
  size_t n_strings;
};

static strategy_option_value_t *find(const piper_options *o, const char *name) {
  size_t n = strlen(name);
  for (size_t i = 0; i < o->entries->len; i++) {
    strategy_option_entry_t *e = &o->entries->ptr[i];
    if (e->name.len == n && memcmp(e->name.ptr, name, n) == 0) return &e->value;
  }
  return NULL;
}

int piper_opt_u32(piper_dag *dag, const piper_options *o, const char *name, uint32_t *out) {
  strategy_option_value_t *v = find(o, name);
  if (!v) return PIPER_OPT_ABSENT;
  if (v->tag != STRATEGY_OPTION_VALUE_INT) {
    piper_fail(dag, "option `%s`: expected an integer", name);
    return PIPER_OPT_ERROR;
  }
  if (v->val.int_ < 0 || v->val.int_ > (int64_t)UINT32_MAX) {
    piper_fail(dag, "option `%s`: must be between 0 and %u, got %lld", name, UINT32_MAX,
               (long long)v->val.int_);
    return PIPER_OPT_ERROR;
  }
  *out = (uint32_t)v->val.int_;
  return PIPER_OPT_SET;
}

int piper_opt_str(piper_dag *dag, const piper_options *o, const char *name, const char **out) {
  strategy_option_value_t *v = find(o, name);
  if (!v) return PIPER_OPT_ABSENT;
  if (v->tag != STRATEGY_OPTION_VALUE_STR) {
    piper_fail(dag, "option `%s`: expected a string", name);
    return PIPER_OPT_ERROR;
  }
  piper_options *m = (piper_options *)o;
  char *s = xrealloc(NULL, v->val.str.len + 1);
  memcpy(s, v->val.str.ptr, v->val.str.len);
  s[v->val.str.len] = 0;
  m->strings = xrealloc(m->strings, (m->n_strings + 1) * sizeof(char *));
  m->strings[m->n_strings++] = s;
  *out = s;
  return PIPER_OPT_SET;
}

/* ---- info ---- */

struct piper_info {
  strategy_plugin_info_t *wit;
};

void piper_info_set(piper_info *info, const char *name, const char *version,
                    const char *description) {
  strategy_string_dup(&info->wit->name, name);
  strategy_string_dup(&info->wit->version, version);
  strategy_string_dup(&info->wit->description, description);
}

void piper_info_option(piper_info *info, const char *name, piper_type type, const char *dflt,
                       const char *help) {
  strategy_list_option_spec_t *l = &info->wit->options;
  l->ptr = xrealloc(l->ptr, (l->len + 1) * sizeof *l->ptr);
  strategy_option_spec_t *s = &l->ptr[l->len++];
  strategy_string_dup(&s->name, name);
  s->type = (strategy_option_type_t)type;
  s->default_.is_some = dflt != NULL;
  if (dflt) {
    strategy_string_dup(&s->default_.val, dflt);
  } else {
    s->default_.val.ptr = NULL;
    s->default_.val.len = 0;
  }
  strategy_string_dup(&s->help, help);
}

void piper_log(const char *level, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(NULL, 0, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  char *m = xrealloc(NULL, (size_t)n + 1);
  va_start(ap, fmt);
  vsnprintf(m, (size_t)n + 1, fmt, ap);
  va_end(ap);
  piper_strategy_log_level_t lv = PIPER_STRATEGY_LOG_LEVEL_INFO;
  if (strcmp(level, "debug") == 0) lv = PIPER_STRATEGY_LOG_LEVEL_DEBUG;
  if (strcmp(level, "warn") == 0) lv = PIPER_STRATEGY_LOG_LEVEL_WARN;
  strategy_string_t s = borrowed(m);
  piper_strategy_log_log(lv, &s);
  free(m);
}

/* ---- the component's exports ---- */

void exports_strategy_info(strategy_plugin_info_t *ret) {
  memset(ret, 0, sizeof *ret);
  piper_info info = {ret};
  piper_strategy_info(&info);
}

bool exports_strategy_apply(strategy_borrow_training_dag_t handle,
                            strategy_list_option_entry_t *options, strategy_string_t *err) {
  piper_dag dag = {handle, NULL};
  piper_options opts = {options, NULL, 0};
  bool ok = piper_strategy_apply(&dag, &opts);
  if (!ok) {
    strategy_string_dup(err, dag.error ? dag.error : "apply returned false without a message");
  }
  free(dag.error);
  for (size_t i = 0; i < opts.n_strings; i++) free(opts.strings[i]);
  free(opts.strings);
  strategy_list_option_entry_free(options);
  return ok;
}
