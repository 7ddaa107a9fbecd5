"""Kiln's serve side: loads a compiled artifact and decodes with it. Imports no torch, no transformers."""

__version__ = "0.1.0"
