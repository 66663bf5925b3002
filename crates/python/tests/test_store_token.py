"""One token guards everything a store client opens: the master link, its engine and so
its segment. A storage node given ``token=`` (no ``PAGEWIRE_TOKEN``) must not let a plain
``pagewire.Engine`` without that token, or with another one, reach its segment. TCP on
127.0.0.1."""

import numpy as np
import pytest

import pagewire
from pagewire import StoreClient, StoreError, StoreMaster
from pagewire.errors import HandshakeError
from pagewire.mooncake_compat import MooncakeDistributedStore

from store_helpers import addr, buffer

TOKEN = "sesame"
MIB = 1 << 20


@pytest.fixture(autouse=True)
def no_env_token(monkeypatch):
    monkeypatch.delenv("PAGEWIRE_TOKEN", raising=False)


@pytest.fixture
def master():
    m = StoreMaster("127.0.0.1:0", token=TOKEN)
    yield m
    m.shutdown()


def client(master, **kw):
    return StoreClient(master.address, listen="127.0.0.1:0", transport="tcp", token=TOKEN, **kw)


def refused(endpoint):
    """A plain engine without the token, then one with a wrong token, connect to
    ``endpoint``: both get a HandshakeError of kind TokenMismatch."""
    for token in (None, "guess"):
        with pagewire.Engine(listen="127.0.0.1:0", backend="tcp", token=token) as e:
            with pytest.raises(HandshakeError) as err:
                e.connect(endpoint)
            assert err.value.kind == "TokenMismatch", err.value
            assert e.peers() == []


def test_a_store_token_guards_the_segment(master):
    """The attack of issue 29: the stranger is refused and the object reads back intact."""
    node = client(master, segment_size=16 * MIB)
    writer = client(master, local_copy=False)
    src = buffer(MIB)
    src[:] = np.random.default_rng(29).integers(0, 256, MIB, dtype=np.uint8)
    writer.register_buffer(addr(src), MIB)
    assert writer.put(["victim"], [[addr(src)]], [[MIB]]) == [0]

    refused(node.endpoint)

    reader = client(master, local_copy=False)
    dst = buffer(MIB)
    reader.register_buffer(addr(dst), MIB)
    assert reader.get(["victim"], [[addr(dst)]], [[MIB]]) == [MIB]
    assert np.array_equal(dst, src), "the object changed"
    for c in (reader, writer, node):
        c.close()


def test_a_token_and_another_pagewire_token_are_refused(master, monkeypatch):
    monkeypatch.setenv("PAGEWIRE_TOKEN", "other-secret")
    with pytest.raises(StoreError) as err:
        client(master, segment_size=4 * MIB)
    assert err.value.code == -600
    assert TOKEN not in str(err.value) and "other-secret" not in str(err.value)


def test_mooncake_store_takes_pagewire_token_for_master_and_segment(master, monkeypatch):
    monkeypatch.setenv("PAGEWIRE_TOKEN", TOKEN)
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MIB, 16 * MIB, "tcp", "", master.address) == 0
    try:
        assert s.put("k", b"value") == 0
        monkeypatch.delenv("PAGEWIRE_TOKEN")
        refused(s.get_hostname())
        assert s.get("k") == b"value"
    finally:
        s.close()
