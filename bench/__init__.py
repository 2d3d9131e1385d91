"""Benchmarking tools for servelm: the load generator (``servelm bench``), its datasets, and ``servelm plan``.

Not imported by the engine: they talk to a server over HTTP or read a model's config alone.
"""
