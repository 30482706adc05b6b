from unmask.cli import entry

entry()
