"""pagewire: zero-copy KV-cache page transfers (RDMA verbs, TCP, in-process).

>>> import pagewire
>>> isinstance(pagewire.__version__, str)
True

Moving bytes between two engines (loopback here; ``backend="tcp"`` or ``"verbs"`` across
hosts):

>>> src, dst = bytearray(b"pages" * 1000), bytearray(5000)
>>> with pagewire.Engine(backend="loopback") as a, pagewire.Engine(backend="loopback") as b:
...     s = a.register(src, access="local")
...     d = b.register(dst, access="w")
...     peer = a.connect(b.address)
...     _ = a.submit(peer, [s.addr], [d.addr], [len(src)], notify=7).wait(5.0)
...     note = b.poll_notification(5.0)
>>> note.tag, bytes(dst[:10])
(7, b'pagespages')
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

# --- transport (native API) --------------------------------------------------------------
from pagewire._native import (  # noqa: E402
    Engine,
    Handle,
    Notification,
    Peer,
    PreparedBatch,
    Region,
)

__all__ += ["Engine", "Region", "Peer", "Handle", "PreparedBatch", "Notification"]
# --- end transport ----------------------------------------------------------------------

# --- store: the KV page store (pagewire_store) -----------------------------------------
from pagewire._native import StoreClient, StoreMaster  # noqa: E402
from pagewire.errors import StoreError  # noqa: E402

__all__ += ["StoreClient", "StoreMaster", "StoreError"]
# --- end store -------------------------------------------------------------------------
