"""Plot support: matplotlib is optional (``pip install -e '.[plot]'``); without it, no PNG."""

from __future__ import annotations

from types import ModuleType


def pyplot() -> ModuleType | None:
    """``matplotlib.pyplot`` on the file-only Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
