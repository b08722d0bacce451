"""Runnable plug-in examples (see docs/data.md): ``source="data.examples.plugin:ColourRamps"``."""
