// `{{name}}`: a Piper strategy. It starts as the smallest one that runs --
// every segment on device 0 -- for you to grow (the SDK is ./piper_strategy.js:
// Filter, Dag, Options, PluginInfo, Pipeline; `piper plugin build` supplies it).
import { Filter, PluginInfo, exportStrategy } from './piper_strategy.js';

class Plugin {
  info() {
    return new PluginInfo('{{name}}', '0.1.0', 'every segment on device 0 (a skeleton to grow)');
  }

  apply(dag, options) {
    dag.place(Filter.all(), [0], 'pp');
  }
}

export const { info, apply } = exportStrategy(new Plugin());
