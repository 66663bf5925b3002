"""pagewire: zero-copy KV-cache page transfers (RDMA verbs, TCP, in-process).

>>> import pagewire
>>> isinstance(pagewire.__version__, str)
True
"""

from pagewire import errors
from pagewire._native import __version__
from pagewire.errors import PagewireError

__all__ = ["__version__", "errors", "PagewireError"]
