"""Environments written natively for the WEFT runtime (server modules: ``server = WeftServer(...)``).

Each environment module holds only its schema, tools and contracts; tasks, gold calls and verifiers
live in a separate ``*_tasks`` module that the server module never imports.
"""
