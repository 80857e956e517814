"""Moved to :mod:`treadle.ops.dtensor` (the ops' own input check); this name stays for old imports."""
from treadle.ops.dtensor import DTensorInputError, refuse_dtensor  # noqa: F401
