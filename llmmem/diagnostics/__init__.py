"""Seeing what llmmem and the process have: ``python -m llmmem info``."""

from llmmem.diagnostics.info import info

__all__ = ["info"]
