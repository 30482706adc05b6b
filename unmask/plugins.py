"""Plug-ins from installed packages: each module a package names under the `unmask.plugins`
entry-point group is imported when the `unmask` command (before its parser is built) or
`unmask-lm-eval` starts, so what the module registers (an objective, a model family, a confidence score, a decoder, a
data format) is a choice of every command: `--decoder NAME` of generate and eval, a
`"decoder"` of a request to `unmask serve`, a `diffusion.objective` of train.

A package declares one in its pyproject.toml:

    [project.entry-points."unmask.plugins"]
    my_decoder = "my_package.decoders"

A module that fails to import stops the command with one line naming it (exit 2).
"""

from importlib.metadata import entry_points

from unmask.errors import InputError

GROUP = "unmask.plugins"


def load_plugins() -> list[str]:
    """Import every `unmask.plugins` entry point's module; their names, in load order.
    InputError naming the one that fails."""
    loaded = []
    for point in sorted(entry_points(group=GROUP), key=lambda p: p.name):
        try:
            point.load()
        except Exception as err:  # its own code: any failure is the plug-in's
            raise InputError(f"plug-in {point.name!r} ({point.value}) failed to load: "
                             f"{type(err).__name__}: {err}") from err  # fmt: skip
        loaded.append(point.name)
    return loaded
