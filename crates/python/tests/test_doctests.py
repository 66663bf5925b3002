"""The runnable examples at the top of the package's modules."""

import doctest

import pagewire
import pagewire.errors
import pagewire._mooncake_store_types
import pagewire._mooncake_tensor
import pagewire.mooncake_buffer_pool
import pagewire.mooncake_compat
import pagewire.mooncake_store


def test_module_examples():
    for mod in (
        pagewire,
        pagewire.errors,
        pagewire.mooncake_compat,
        pagewire.mooncake_store,
        pagewire._mooncake_store_types,
        pagewire._mooncake_tensor,
        pagewire.mooncake_buffer_pool,
    ):
        failed, tried = doctest.testmod(mod, raise_on_error=False, verbose=False)
        assert tried > 0 and failed == 0, mod.__name__
