"""The one exception type for bad user input (config, data, checkpoint, CLI).

The CLI turns it into one line on stderr and exit code 2; nothing else catches it.
Messages say what is wrong and how to fix it: the key, the path, the expected form.
"""


class InputError(Exception):
    """Bad input from the user: a config key, a path, a data file, a checkpoint."""
