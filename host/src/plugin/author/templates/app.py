"""`{{name}}`: a Piper strategy. It starts as the smallest one that runs on
any number of devices -- data parallelism over all of them -- for you to grow
(the SDK is `piper_strategy`: Filter, Dag, Options, PluginInfo, Pipeline)."""

from piper_strategy import Filter, PluginInfo, Strategy, export


class Plugin(Strategy):
    def info(self):
        return PluginInfo("{{name}}", "0.1.0", "data parallelism over every device (a skeleton to grow)")

    def apply(self, dag, options):
        dag.replicate(Filter.all(), range(dag.cluster().devices))


WitWorld = export(Plugin)
