from syncdrop.cli import entry

entry()
