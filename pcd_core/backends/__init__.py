"""Backends: the two primitives every model runtime implements (``base.py``), one module per runtime.

A backend knows tokens, positions and masks, never schemas; ``tests/test_import_contracts.py`` and the
contracts in ``pyproject.toml`` keep it so.
"""
