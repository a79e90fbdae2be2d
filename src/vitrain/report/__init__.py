"""Reports from records: plots and tables. Reads results; never trains."""

from vitrain.report.plots import pyplot

__all__ = ["pyplot"]
