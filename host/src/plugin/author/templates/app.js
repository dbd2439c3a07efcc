// `{{name}}`: a Piper strategy. It starts as the smallest one that runs on
// any number of devices -- data parallelism over all of them -- for you to
// grow (the SDK is ./piper_strategy.js: Filter, Dag, Options, PluginInfo,
// Pipeline; `piper plugin build` supplies it).
import { Filter, PluginInfo, exportStrategy } from './piper_strategy.js';

class Plugin {
  info() {
    return new PluginInfo('{{name}}', '0.1.0', 'data parallelism over every device (a skeleton to grow)');
  }

  apply(dag, options) {
    const devices = [...Array(dag.cluster().devices).keys()];
    dag.replicate(Filter.all(), devices);
  }
}

export const { info, apply } = exportStrategy(new Plugin());
