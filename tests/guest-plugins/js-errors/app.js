// A JavaScript strategy that fails on purpose (host/tests/languages.rs):
// mode = raise (a JS exception), loop (never returns), directive (a directive
// the host refuses).
import { Filter, OptionSpec, PluginInfo, exportStrategy } from './piper_strategy.js';

function checkStage(stage) {
  throw new RangeError(`stage ${stage} has no devices`);
}

class Plugin {
  info() {
    return new PluginInfo('errors-js', '0.1.0', 'fails on purpose')
      .option(OptionSpec.str('mode', 'raise', 'raise | loop | directive'));
  }

  apply(dag, options) {
    const mode = options.str('mode');
    if (mode === 'raise') checkStage(3);
    if (mode === 'loop') for (;;) {}
    if (mode === 'directive') dag.place(Filter.all(), [99], 'pp');
  }
}

export const { info, apply } = exportStrategy(new Plugin());
