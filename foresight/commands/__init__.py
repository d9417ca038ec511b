"""Verbs of the `foresight` command, one module each (see foresight.cli)."""
