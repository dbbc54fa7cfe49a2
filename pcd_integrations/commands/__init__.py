"""The ``pcd`` command line: ``main.py`` dispatches, each subcommand module parses and prints.

The work itself (filling, deciding, benchmarking, evaluating) lives in ``pcd_core``; these modules only
turn arguments into calls and results into tables or JSON.
"""
