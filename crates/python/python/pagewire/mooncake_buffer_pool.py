"""What ``import mooncake.buffer_pool`` gives with ``PAGEWIRE_AS_MOONCAKE=1``: the store's
local-buffer pool under the names Mooncake's module gives it (``RegisteredBufferPool`` is
the same class as ``BufferPool``).

>>> import pagewire.mooncake_buffer_pool as bp, pagewire.mooncake_store as store
>>> bp.BufferPool is bp.RegisteredBufferPool is store.BufferPool
True
"""

from pagewire._mooncake_store_types import BufferPool

RegisteredBufferPool = BufferPool

__all__ = ["BufferPool", "RegisteredBufferPool"]
