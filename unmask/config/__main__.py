"""`python -m unmask.config > docs/configuration.md`: the key reference from the code."""

from unmask.config.run import reference_markdown

print(reference_markdown(), end="")
