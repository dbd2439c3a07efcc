"""`{{name}}`: a Piper strategy. It starts as the smallest one that runs --
every segment on device 0 -- for you to grow (the SDK is `piper_strategy`:
Filter, Dag, Options, PluginInfo, Pipeline)."""

from piper_strategy import Filter, PluginInfo, Strategy, export


class Plugin(Strategy):
    def info(self):
        return PluginInfo("{{name}}", "0.1.0", "every segment on device 0 (a skeleton to grow)")

    def apply(self, dag, options):
        dag.place(Filter.all(), [0], "pp")


WitWorld = export(Plugin)
