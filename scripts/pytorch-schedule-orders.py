#!/usr/bin/env python3
"""Per-rank action orders of PyTorch's zero-bubble pipeline schedules, read
from torch's own source (no torch import, no process group): the functions
that compute `pipeline_order` are taken out of
`torch/distributed/pipelining/schedules.py` and run on stand-ins for the
schedule object. Writes the order table the `zbv` and `interleaved-zb`
plugins' tests compare with.

    pip download --no-deps torch==2.11.0 -d /tmp/torch
    unzip -o /tmp/torch/torch-*.whl 'torch/distributed/pipelining/schedules.py' -d /tmp/torch
    python3 scripts/pytorch-schedule-orders.py /tmp/torch/torch/distributed/pipelining/schedules.py \
        > host/tests/data/pytorch-schedule-orders.txt
"""
import ast
import logging
import sys
from collections import defaultdict
from enum import Enum
from typing import Any, Callable, NamedTuple

path = sys.argv[1]
tree = ast.parse(open(path).read())
wanted_top = {"_ComputationType", "_Action", "_get_1f1b_rank_ops", "_get_warmup_ops"}
wanted_methods = {"ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"}
ns = {
    "logger": logging.getLogger("orders"),
    "defaultdict": defaultdict,
    "Enum": Enum,
    "NamedTuple": NamedTuple,
    "Any": Any,
    "Callable": Callable,
    "__name__": "orders",
}
methods = {}
for node in tree.body:
    if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in wanted_top:
        if isinstance(node, ast.ClassDef) and node.name == "_Action":
            # Fields and repr only (its static helpers need a regex).
            node.body = [b for b in node.body if not (isinstance(b, ast.FunctionDef) and b.name != "__repr__" and b.name != "__str__")]
        exec(compile(ast.Module([node], []), path, "exec"), ns)
    elif isinstance(node, ast.Assign) and all(
        isinstance(t, ast.Name) and t.id in {"FORWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "FULL_BACKWARD", "F", "I", "W", "B"}
        for t in node.targets
    ):
        exec(compile(ast.Module([node], []), path, "exec"), ns)
    elif isinstance(node, ast.ClassDef) and node.name in wanted_methods:
        for b in node.body:
            if isinstance(b, ast.FunctionDef) and b.name == "_calculate_single_rank_operations":
                mod = ast.Module([b], [])
                local = dict(ns)
                exec(compile(mod, path, "exec"), local)
                methods[node.name] = local["_calculate_single_rank_operations"]


class Stub:
    pass


def izb(p, v, m):
    s = Stub()
    s.pp_group_size, s.n_local_stages, s._n_microbatches = p, v, m
    rounds = max(1, m // p)
    assert m % rounds == 0
    s.number_of_rounds, s.microbatches_per_round = rounds, m // rounds
    return [methods["ScheduleInterleavedZeroBubble"](s, r) for r in range(p)]


def zbv(p, m):
    s = Stub()
    s.pp_group_size, s._n_microbatches, s.num_stages = p, m, 2 * p
    return [methods["ScheduleZBVZeroBubble"](s, r) for r in range(p)]


print("# PyTorch's per-rank orders, from torch/distributed/pipelining/schedules.py")
print("# (torch 2.11.0; scripts/pytorch-schedule-orders.py). An action: stage, F/I/W, microbatch.")
for p, m in [(1, 1), (1, 3), (2, 1), (2, 2), (2, 4), (2, 6), (3, 3), (3, 6), (4, 4), (4, 8), (4, 12)]:
    for r, ops in enumerate(zbv(p, m)):
        print(f"zbv p={p} m={m} rank={r}: " + " ".join(repr(a) for a in ops if a is not None))
for p, v, m in [(2, 2, 2), (2, 2, 4), (2, 3, 4), (3, 2, 3), (3, 2, 6), (4, 2, 4), (4, 2, 8), (4, 3, 8), (4, 2, 6)]:
    for r, ops in enumerate(izb(p, v, m)):
        print(f"interleaved-zb p={p} v={v} m={m} rank={r}: " + " ".join(repr(a) for a in ops if a is not None))
