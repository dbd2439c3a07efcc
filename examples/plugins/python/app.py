"""1F1B pipeline schedule (PipeDream-Flush) in Python: the same plan as the
bundled Rust `1f1b`. Stage s of p runs p - s - 1 warm-up forwards, then
alternates one forward and one backward, then drains the backwards."""

from piper_strategy import (Pass, Pipeline, PluginInfo, Strategy, apply_recompute_option, export,
                            pipeline_options, recompute_option)


def schedule(p, s, m):
    """The 1F1B order of stage s of p over m microbatches, as (pass, microbatch)."""
    warmup = min(p - s - 1, m)
    steps = [(Pass.F, i) for i in range(warmup)]
    for i in range(m - warmup):
        steps += [(Pass.F, warmup + i), (Pass.B, i)]
    steps += [(Pass.B, i) for i in range(m - warmup, m)]
    return steps


class OneFOneB(Strategy):
    def info(self):
        return pipeline_options(
            PluginInfo("1f1b-py", "0.1.0", "1F1B pipeline schedule (PipeDream-Flush), in Python"),
            "pipeline stages (default: devices / data-parallel degree)",
            "microbatches per step (default: 2 x stages)").option(recompute_option())

    def apply(self, dag, options):
        pipe = Pipeline.new(dag, options, "1f1b-py")
        pipe.split_place(dag, options)
        p, mbs = pipe.stages(), pipe.microbatches
        for s in range(p):
            dag.order([pipe.step(s, m, pass_name) for pass_name, m in schedule(p, s, mbs)])
        apply_recompute_option(dag, options, "1f1b-py")


WitWorld = export(OneFOneB)
