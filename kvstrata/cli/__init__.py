"""The ``kvstrata`` command: ``main`` parses the arguments (``main.py``),
``commands.py`` holds the bodies of ``run``, ``serve`` and ``bench``."""

from kvstrata.cli.main import main

__all__ = ["main"]
