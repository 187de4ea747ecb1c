"""Reproducible problems for checking invariance to the world size (``metaddp verify``, tests)."""
