"""A Python strategy that fails on purpose (host/tests/it/languages.rs):
mode = raise (a Python exception), loop (never returns), directive (a
directive the host refuses)."""

from piper_strategy import Filter, OptionSpec, PluginInfo, Strategy, export


def check_stage(stage):
    raise ValueError("stage %d has no devices" % stage)


class Plugin(Strategy):
    def info(self):
        return PluginInfo("errors-py", "0.1.0", "fails on purpose").option(
            OptionSpec.str("mode", "raise", "raise | loop | directive"))

    def apply(self, dag, options):
        mode = options.str("mode")
        if mode == "raise":
            check_stage(3)
        elif mode == "loop":
            n = 0
            while True:
                n += 1
        elif mode == "directive":
            dag.place(Filter.all(), [99], "pp")


WitWorld = export(Plugin)
