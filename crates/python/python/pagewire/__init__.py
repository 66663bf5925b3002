"""pagewire: zero-copy KV-cache page transfers (RDMA verbs, TCP, in-process).

>>> import pagewire
>>> isinstance(pagewire.__version__, str)
True
"""

from pagewire._native import __version__

__all__ = ["__version__"]
