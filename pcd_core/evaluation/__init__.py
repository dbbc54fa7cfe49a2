"""``pcd eval`` and ``pcd calibrate``: decision quality measured on labelled data.

``metrics`` is pure math on arrays, ``datasets`` builds the labelled sets from corpora that ship
inside packages, ``runner`` reads a model's answers on them, ``command`` is the CLI.
"""
