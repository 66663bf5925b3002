"""pagewire: zero-copy KV-cache page transfers (RDMA verbs, TCP, in-process).

>>> import pagewire
>>> isinstance(pagewire.__version__, str)
True
"""

from pagewire import errors
from pagewire._native import __version__
from pagewire.errors import PagewireError

__all__ = ["__version__", "errors", "PagewireError"]

# --- layout: pools, page lists, transfer plans (pagewire_layout) ---------------------
from pagewire._native import Geometry, Pool, TransferPlan, pd_connector_plan, plan
from pagewire.errors import LayoutError

__all__ += ["Geometry", "Pool", "TransferPlan", "plan", "pd_connector_plan", "LayoutError"]
# --- end layout ----------------------------------------------------------------------

# --- store: the KV page store (pagewire_store) -----------------------------------------
from pagewire._native import StoreClient, StoreMaster  # noqa: E402
from pagewire.errors import StoreError  # noqa: E402

__all__ += ["StoreClient", "StoreMaster", "StoreError"]
# --- end store -------------------------------------------------------------------------
