"""Mooncake's on-store tensor format as pagewire reads it, without torch (the tensors
themselves are compared against Mooncake's wheel by tensor_mooncake_diff.py, which needs
torch): every header field is checked against the object's length, and no byte string
makes the parser raise."""

import random
import struct

from pagewire import _mooncake_tensor as mt

# float32 (code 0), shape (2, 3): 24 bytes of data.
HEAD = mt.pack_header(0, [2, 3], [2, 3], 24)
OBJ = HEAD + bytes(range(24))


def field(offset: int, fmt: str, value) -> bytes:
    b = bytearray(OBJ)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


def test_layout_offsets():
    assert len(HEAD) == mt.HEADER_SIZE == 304
    magic, version, size, dtype, ndim, kind, flags, offset, nbytes = struct.unpack_from("<IHHiiIIQQ", HEAD)
    assert (magic, version, size, dtype, ndim, kind, flags, offset, nbytes) == (0x4D4F4F4E, 1, 304, 0, 2, 0, 0, 304, 24)
    shapes = struct.unpack_from("<16q", HEAD, 40)
    assert shapes == (2, 3) + (-1,) * 6 + (2, 3) + (-1,) * 6
    assert HEAD[168:] == bytes(136)  # no axes


def test_valid_object_parses():
    p = mt.parse_header(OBJ)
    assert (p.dtype, p.shape, p.offset, p.nbytes) == (0, [2, 3], 304, 24)
    assert mt.parse_header(mt.pack_header(10, [], [], 1) + b"\x01").shape == []  # a 0-d bool
    assert mt.parse_header(mt.pack_header(3, [0, 5], [0, 5], 0)).nbytes == 0  # empty


def test_shard_header():
    h = mt.pack_header(11, [4, 6], [4, 3], 24, [(mt.AXIS_TP, 0, 1, 2, 1, 0, 3)])
    assert struct.unpack_from("<I", h, 16)[0] == 1  # layout: a shard
    assert struct.unpack_from("<II", h, 168) == (1, 0)
    assert struct.unpack_from("<6iq", h, 176) == (1, 0, 1, 2, 1, 0, 3)
    assert mt.parse_header(h + bytes(24)).shape == [4, 3]


def test_every_inconsistency_is_refused():
    bad = [
        OBJ[:-1],  # data shorter than the header says
        OBJ + b"\0",  # longer
        OBJ[:303],  # not even a header
        field(0, "<I", 0x4D4F4F4F),  # magic
        field(4, "<H", 2),  # version
        field(6, "<H", 300),  # header size
        field(8, "<i", 15),  # dtype past the table
        field(8, "<i", -1),
        field(8, "<i", 8),  # int64: 6 elements are 48 bytes, not 24
        field(12, "<i", 9),  # more than 8 dims
        field(12, "<i", 3),  # a third dim that is -1
        field(16, "<I", 2),  # layout kind
        field(24, "<Q", 100),  # data offset inside the header
        field(32, "<Q", 23),  # data bytes
        field(40, "<q", -2),  # negative dim
        field(104, "<q", 4),  # local shape disagrees with the length
        field(56, "<q", 7),  # an unused dim that is not -1
        field(168, "<I", 5),  # more than 4 axes
    ]
    for i, obj in enumerate(bad):
        assert mt.parse_header(obj) is None, i
    axis = mt.pack_header(0, [4, 6], [2, 6], 48, [(mt.AXIS_TP, 0, 0, 2, 0, 0, 2)])
    for at, value in ((176, 7), (184, 2), (188, 0), (192, 2)):  # kind, rank == count, count 0, split >= ndim
        b = bytearray(axis + bytes(48))
        struct.pack_into("<i", b, at, value)
        assert mt.parse_header(bytes(b)) is None, at


def test_random_bytes_never_raise():
    rng = random.Random(20261205)
    shard = mt.pack_header(12, [4, 6], [4, 3], 24, [(mt.AXIS_TP, 0, 1, 2, 1, 0, 3)]) + bytes(24)
    manifest = mt.pack_manifest(0, [4, 6], 1, 2)
    for _ in range(5000):
        base = bytearray(rng.choice([OBJ, shard, manifest]))
        for _ in range(rng.randint(1, 6)):
            base[rng.randrange(len(base))] = rng.randrange(256)
        if rng.random() < 0.2:
            del base[rng.randrange(len(base)) :]
        mt.parse_header(bytes(base))
        mt.parse_manifest(bytes(base))


def test_manifest():
    m = mt.pack_manifest(12, [4, 6], 1, 2)
    assert len(m) == mt.MANIFEST_SIZE == 96 and m[:4] == b"NAMW" and m[28:32] == bytes(4)
    assert mt.parse_manifest(m) == (12, [4, 6], 1, 2)
    assert mt.parse_manifest(m[:95]) is None
    assert mt.parse_manifest(mt.pack_manifest(0, [4, 6], 2, 2)) is None  # split dim past ndim
    assert mt.parse_manifest(mt.pack_manifest(0, [4, 0], 0, 2)) == (0, [4, 0], 0, 2)  # empty: fine
    assert mt.parse_manifest(mt.pack_manifest(0, [4, -2], 0, 2)) is None
    assert mt.parse_manifest(mt.pack_manifest(0, [4, 6], 0, 0)) is None  # no shards


def test_key_names():
    assert mt.tp_key("k", 3) == "k_tp_3"
    assert mt.writer_key("k", 1, 4, 2) == "k__writer_1of4_sd2"
    assert mt.manifest_key("k") == "k__writer_manifest"


def test_writer_spec():
    class W:
        rank, size, split_dim = 1, 2, 0

    assert mt.writer_spec(W()) == (1, 2, 0)
    W.rank = 2
    assert mt.writer_spec(W()) is None
    assert mt.writer_spec(object()) is None


def test_parse_spec_and_keys():
    class Axis:
        def __init__(self, kind, rank=0, size=2, split_dim=None, expert_id=None, stage_id=None):
            self.kind, self.rank, self.size, self.split_dim = kind, rank, size, split_dim
            self.expert_id, self.stage_id = expert_id, stage_id

    class Spec:
        def __init__(self, *axes):
            self.axes = list(axes)

    one = mt.parse_spec(Spec(Axis("TP", 1, split_dim=1)))
    assert [a.ident() for a in one] == [(1, 1, 2, 1, None)]
    assert mt.spec_key("k", one) == "k_tp_1"
    assert mt.parallelism_manifest_key("k") == "k__parallelism_manifest"
    axes = mt.parse_spec(Spec(Axis("pp", 1, 2, stage_id=3), Axis("tp", 0, 4, 0), Axis("Ep", 0, 2, expert_id=5),
                              Axis("dp", 1, 3)))  # fmt: skip
    assert mt.spec_key("k", axes) == "k__dp_1of3__tp_0of4_sd0__ep_0of2_eid5__pp_1of2_sid3"
    # The header keeps the caller's order; only a split axis has an extent.
    assert mt.header_axes(axes, [2, 6]) == [(3, 0, 1, 2, -1, 3, 0), (1, 1, 0, 4, 0, 0, 2), (2, 2, 0, 2, -1, 5, 0),
                                            (0, 3, 1, 3, -1, 0, 0)]  # fmt: skip
    head = mt.pack_header(0, [8, 6], [2, 6], 48, mt.header_axes(axes, [2, 6]))
    assert [a.ident() for a in mt.stored_axes(head + bytes(48))] == [a.ident() for a in mt.canonical(axes)]
    for bad in (Spec(), Spec(Axis("tp", 2, split_dim=0)), Spec(Axis("tp")), Spec(Axis("xx")),
                Spec(Axis("dp", split_dim=0)), Spec(Axis("ep")), Spec(Axis("pp")), Spec(Axis("dp"), Axis("DP")),
                Spec(Axis("ep", split_dim=0, expert_id=1)), Spec(*[Axis("dp")] * 5), object()):  # fmt: skip
        assert mt.parse_spec(bad) is None

