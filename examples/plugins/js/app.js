// 1F1B pipeline schedule (PipeDream-Flush) in JavaScript: the same plan as
// the bundled Rust `1f1b`. Stage s of p runs p - s - 1 warm-up forwards, then
// alternates one forward and one backward, then drains the backwards.
import {
  Pass, Pipeline, PluginInfo, applyRecomputeOption, exportStrategy, pipelineOptions, recomputeOption,
} from './piper_strategy.js';

/** The 1F1B order of stage s of p over m microbatches, as [pass, microbatch]. */
function schedule(p, s, m) {
  const warmup = Math.min(p - s - 1, m);
  const steps = [];
  for (let i = 0; i < warmup; i++) steps.push([Pass.F, i]);
  for (let i = 0; i < m - warmup; i++) steps.push([Pass.F, warmup + i], [Pass.B, i]);
  for (let i = m - warmup; i < m; i++) steps.push([Pass.B, i]);
  return steps;
}

class OneFOneB {
  info() {
    return pipelineOptions(
      new PluginInfo('1f1b-js', '0.1.0', '1F1B pipeline schedule (PipeDream-Flush), in JavaScript'),
      'pipeline stages (default: devices / data-parallel degree)',
      'microbatches per step (default: 2 x stages)').option(recomputeOption());
  }

  apply(dag, options) {
    const pipe = Pipeline.new(dag, options, '1f1b-js');
    pipe.splitPlace(dag, options);
    const [p, mbs] = [pipe.stages(), pipe.microbatches];
    for (let s = 0; s < p; s++) {
      dag.order(schedule(p, s, mbs).map(([pass, m]) => pipe.step(s, m, pass)));
    }
    applyRecomputeOption(dag, options, '1f1b-js');
  }
}

export const { info, apply } = exportStrategy(new OneFOneB());
