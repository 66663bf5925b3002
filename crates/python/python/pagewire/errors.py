"""pagewire's exceptions. Every one derives from :class:`PagewireError`.

>>> from pagewire.errors import PagewireError
>>> issubclass(PagewireError, Exception)
True
"""

from pagewire._native import PagewireError

__all__ = ["PagewireError"]

# --- layout --------------------------------------------------------------------------
from pagewire._native import LayoutError  # noqa: E402  (PagewireError, ValueError)

__all__ += ["LayoutError"]
# --- end layout ----------------------------------------------------------------------

# --- store ---------------------------------------------------------------------------
from pagewire._native import StoreError  # noqa: E402  (PagewireError; `.code`: Mooncake's number)

__all__ += ["StoreError"]
# --- end store -----------------------------------------------------------------------
