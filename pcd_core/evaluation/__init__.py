"""``pcd eval`` and ``pcd calibrate``: decision quality measured on labelled data.

``metrics`` is pure math on arrays, ``datasets`` builds the labelled sets from corpora that ship
inside packages, ``runner`` reads a model's answers on them. The ``pcd eval`` and ``pcd calibrate``
commands live outside the core, in ``pcd_integrations/commands/evaluate.py``.
"""
