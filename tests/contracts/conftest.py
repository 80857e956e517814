"""tests/contracts: one module per kind of kernel contract, each parametrised over every
public op and every backend available here. Shared builders live in ``cases.py`` beside this file."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
