"""Type stubs for the pagewire._native extension module."""

from typing import Any, Sequence, Union

import numpy.typing as npt

__version__: str

class PagewireError(Exception): ...

class U64Array:
    """Owns a uint64 vector; numpy views it without copying."""

    @property
    def __array_interface__(self) -> dict[str, Any]: ...
    def __len__(self) -> int: ...
    def __getitem__(self, i: int) -> int: ...
    def tolist(self) -> list[int]: ...

def _u64_roundtrip(obj: Union[Sequence[int], npt.ArrayLike]) -> Union[npt.NDArray[Any], list[int]]: ...
