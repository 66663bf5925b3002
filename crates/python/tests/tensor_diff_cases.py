"""The tensor calls of the store's differential test (tensor_mooncake_diff.py), against one
implementation per process: ``python tensor_diff_cases.py mooncake|pagewire OUT.json
[OTHER.json]``. Needs torch, Mooncake's wheel and pagewire's in one interpreter (the
virtualenv of scripts/sglang-check.sh), with ``PAGEWIRE_AS_MOONCAKE`` unset.

Writes OUT.json: ``cases`` (case name -> what callers branch on: return codes, and a
tensor read back as ``[dtype, shape, equal to what was put]``), ``digests`` (case name ->
SHA-256 of the raw bytes stored under the keys the case wrote, read with ``get``: the
on-store format, compared byte for byte across the two) and ``objects`` (key -> the raw
object, hex, and the fingerprint of the tensor ``get_tensor`` reads from it). With
OTHER.json (the other implementation's OUT.json) it only stores each of the other's raw
objects with ``put`` and reads it with ``get_tensor``: ``cross`` (key -> ``[put code,
fingerprint]``), whose fingerprint must equal the other's own.
"""

import ctypes
import hashlib
import importlib
import json
import sys
import types

import numpy as np
import torch

from store_diff_cases import MIB, start

DTYPES = [
    "float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "uint16", "int32",
    "uint32", "int64", "uint64", "bool", "float8_e4m3fn", "float8_e5m2",
]  # fmt: skip
SHAPES = {"0d": (), "1d": (5,), "4d": (2, 3, 2, 2), "empty": (0, 3)}


def make(dtype: str, shape, seed: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` with seeded random bytes (every bit pattern a
    float8 or bfloat16 may hold; bool 0 or 1)."""
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    n = int(np.prod(shape)) if shape else 1
    size = torch.empty(0, dtype=dt).element_size()
    if dtype == "bool":
        return torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8).bool().reshape(shape)
    raw = torch.randint(0, 256, (n * size,), generator=g, dtype=torch.uint8)
    if dtype.startswith("float"):  # no NaN payloads: equality must hold
        return torch.randn(n, generator=g).to(dt).reshape(shape)
    return raw.view(dt).reshape(shape)


def raw_bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def summary(t, want=None):
    """A read's result as callers see it: ``None``, a code, or ``[dtype, shape, same]``
    (``same``: the bytes equal ``want``'s)."""
    if t is None or isinstance(t, int):
        return t
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    same = None if want is None else raw_bytes(t) == raw_bytes(want)
    return [str(t.dtype).removeprefix("torch."), list(t.shape), same]


def catch(f):
    """``f()``, or the exception it raised as ``"Type: message"``."""
    try:
        return f()
    except Exception as e:  # noqa: BLE001 - the exception is the result
        return f"{type(e).__name__}: {e}"


def fingerprint(t):
    """A tensor read as ``[dtype, shape, SHA-256 of its bytes]`` (``None`` stays)."""
    if not isinstance(t, torch.Tensor):
        return summary(t)
    return [str(t.dtype).removeprefix("torch."), list(t.shape), hashlib.sha256(raw_bytes(t)).hexdigest()]


class Run:
    def __init__(self, impl: str) -> None:
        Store, self.Config, master, self.stop = start(impl)
        try:
            self.mod = importlib.import_module("mooncake.store" if impl == "mooncake" else "pagewire.mooncake_store")
            self.s = Store()
            self.uninit = Store()
            self.cases, self.digests, self.objects = {}, {}, {}
            self.setup = self.s.setup("127.0.0.1", "P2PHANDSHAKE", 256 * MIB, 16 * MIB, "tcp", "", master)
            self.buf = np.zeros(64 * MIB, dtype=np.uint8)
            self.p = self.buf.ctypes.data
            self.registered = self.s.register_buffer(self.p, self.buf.nbytes)
        except BaseException:
            self.stop()  # no master left behind
            raise

    def digest(self, case: str, keys) -> None:
        h = hashlib.sha256()
        for k in keys:
            raw = self.s.get(k)
            h.update(len(raw).to_bytes(8, "little") + raw)
        self.digests[case] = h.hexdigest()

    def keep(self, key: str) -> None:
        """Records ``key``'s raw object and the tensor read from it, for the cross-read."""
        self.objects[key] = [self.s.get(key).hex(), fingerprint(self.s.get_tensor(key))]

    # ------------------------------------------------------------------ cases

    def dtypes_and_shapes(self) -> None:
        s = self.s
        for dtype in DTYPES:
            for sname, shape in SHAPES.items():
                key, t = f"t_{dtype}_{sname}", make(dtype, shape)
                case = f"put_get_{dtype}_{sname}"
                self.cases[case] = [s.put_tensor(key, t), len(s.get(key)), summary(s.get_tensor(key), t)]
                self.digest(case, [key])
                self.keep(key)

    def refusals(self) -> None:
        s = self.s
        self.cases["unsupported_dtype"] = [
            s.put_tensor("u_complex", torch.zeros(3, dtype=torch.complex64)),
            s.put_tensor("u_fnuz", torch.zeros(3).to(torch.float8_e4m3fnuz)),
            s.batch_put_tensor(["u_b1", "u_b2"], [torch.zeros(2, dtype=torch.complex128), torch.zeros(2)]),
        ]
        self.cases["not_a_tensor"] = [s.put_tensor("u_np", np.zeros(4, np.float32)), s.put_tensor("u_list", [1, 2])]
        self.cases["nine_dims"] = s.put_tensor("u_9d", torch.zeros([1] * 9))
        self.cases["eight_dims"] = [s.put_tensor("u_8d", torch.ones([1] * 7 + [2])), summary(s.get_tensor("u_8d"))]
        t = make("int64", (3, 4), 1).t()
        self.cases["non_contiguous"] = [t.is_contiguous(), s.put_tensor("nc", t), summary(s.get_tensor("nc"), t)]
        self.digest("non_contiguous", ["nc"])
        self.keep("nc")
        self.cases["missing"] = [summary(s.get_tensor("nope")), [summary(x) for x in s.batch_get_tensor(["nope"])]]
        s.put("rawobj", b"x" * 400)
        self.cases["not_a_tensor_object"] = summary(s.get_tensor("rawobj"))
        self.cases["uninitialised"] = [
            self.uninit.put_tensor("k", torch.zeros(2)), summary(self.uninit.get_tensor("k")),
            self.uninit.batch_put_tensor(["k"], [torch.zeros(2)]),
            self.uninit.batch_get_tensor_into(["k"], [self.p], [4096]),
            self.uninit.put_tensor_with_tp("k", torch.zeros(2), 0, 2, 0),
        ]  # fmt: skip

    def overwrite(self) -> None:
        s, a, b = self.s, make("float32", (4,), 2), make("float32", (4,), 3)
        self.cases["put_existing_keeps_first"] = [s.put_tensor("ow", a), s.put_tensor("ow", b), summary(s.get_tensor("ow"), a)]
        self.cases["upsert_replaces"] = [s.upsert_tensor("ow", b), summary(s.get_tensor("ow"), b),
                                         s.upsert_tensor("ow_new", a), summary(s.get_tensor("ow_new"), a)]  # fmt: skip
        c = make("int16", (2, 2), 4)
        cfg = self.Config()
        cfg.replica_num = 1
        self.cases["pub"] = [s.pub_tensor("pub", c, cfg), summary(s.get_tensor("pub"), c),
                             s.upsert_pub_tensor("pub", a, cfg), summary(s.get_tensor("pub"), a),
                             s.batch_pub_tensor(["pb1", "pb2"], [a, c], cfg),
                             s.batch_upsert_pub_tensor(["pb1", "pb3"], [c, a], cfg),
                             [summary(x, w) for x, w in zip(s.batch_get_tensor(["pb1", "pb2", "pb3"]), [c, c, a])]]  # fmt: skip
        self.cases["upsert_not_a_tensor_keeps_old"] = [s.upsert_tensor("pub", [1]), summary(s.get_tensor("pub"), a)]
        self.digest("pub", ["pub", "pb1", "pb2", "pb3"])

    def batches(self) -> None:
        s = self.s
        t1, t2 = make("bfloat16", (3, 4), 5), make("uint8", (7,), 6)
        self.cases["batch_put"] = s.batch_put_tensor(["b1", "b2", "b3"], [t1, np.zeros(2), t2])
        self.cases["batch_put_mismatch"] = s.batch_put_tensor(["m1", "m2"], [t1])
        self.cases["batch_put_empty"] = s.batch_put_tensor([], [])
        self.cases["batch_get"] = [summary(x, w) for x, w in zip(s.batch_get_tensor(["b1", "b2", "b3"]), [t1, None, t2])]
        self.cases["batch_get_empty"] = s.batch_get_tensor([])
        self.cases["batch_upsert"] = [s.batch_upsert_tensor(["b1", "b4"], [t2, t1]), summary(s.get_tensor("b1"), t2),
                                      s.batch_upsert_tensor(["x"], []), s.batch_upsert_tensor([], [])]  # fmt: skip
        self.digest("batch_put", ["b1", "b2", "b3", "b4"])
        big = make("float32", (5, MIB), 7)  # 20 MiB: more than the 16 MiB local buffer
        self.cases["larger_than_local_buffer"] = [s.put_tensor("big", big), summary(s.get_tensor("big"), big)]

    def into(self) -> None:
        s, p, buf = self.s, self.p, self.buf
        t = make("float16", (4, 8), 8)
        s.put_tensor("in1", t)
        n = len(s.get("in1"))
        r = s.get_tensor_into("in1", p, 4096)
        shares = r is not None and p <= r.data_ptr() < p + 4096
        self.cases["get_into"] = [n, summary(r, t), shares]
        self.cases["get_into_exact"] = summary(s.get_tensor_into("in1", p, n), t)
        self.cases["get_into_too_small"] = [summary(s.get_tensor_into("in1", p, n - 1)), summary(s.get_tensor_into("in1", p, 100))]
        self.cases["get_into_missing"] = summary(s.get_tensor_into("nope", p, 4096))
        self.cases["get_into_null"] = summary(s.get_tensor_into("in1", 0, 4096))
        s.put("rawobj2", b"y" * 400)
        self.cases["get_into_not_a_tensor"] = summary(s.get_tensor_into("rawobj2", p, 4096))
        q = [p, p + MIB, p + 2 * MIB]
        self.cases["batch_get_into"] = [summary(x, w) for x, w in zip(
            s.batch_get_tensor_into(["in1", "nope", "in1"], q, [4096, 4096, 10]), [t, None, None])]  # fmt: skip
        self.cases["batch_get_into_mismatch"] = s.batch_get_tensor_into(["in1", "in1"], q[:1], [4096, 4096])
        self.cases["batch_get_into_null"] = s.batch_get_tensor_into(["in1", "in1"], [p, 0], [4096, 4096])
        self.cases["batch_get_into_empty"] = s.batch_get_tensor_into([], [], [])
        buf[:] = 0

    def from_buffers(self) -> None:
        s, p, buf = self.s, self.p, self.buf
        a, b = make("int32", (3, 5), 9), make("bool", (6,), 10)
        s.put_tensor("src_a", a)
        s.put_tensor("src_b", b)
        ra, rb = s.get("src_a"), s.get("src_b")
        buf[: len(ra)] = np.frombuffer(ra, np.uint8)
        buf[MIB : MIB + len(rb)] = np.frombuffer(rb, np.uint8)
        qa, qb = p, p + MIB
        self.cases["put_from"] = [s.put_tensor_from("fa", qa, len(ra)), summary(s.get_tensor("fa"), a)]
        self.cases["put_from_errors"] = [s.put_tensor_from("fe", qa, len(ra) - 1), s.put_tensor_from("fe", qa, 100),
                                         s.put_tensor_from("fe", 0, len(ra)), s.put_tensor_from("fe", qa + 8, len(ra))]  # fmt: skip
        self.cases["batch_put_from"] = [s.batch_put_tensor_from(["fb1", "fb2"], [qa, qb], [len(ra), len(rb)]),
                                        summary(s.get_tensor("fb2"), b)]  # fmt: skip
        self.cases["batch_put_from_one_bad"] = s.batch_put_tensor_from(["fc1", "fc2"], [qa, qb], [len(ra), len(rb) + 1])
        self.cases["batch_put_from_edges"] = [s.batch_put_tensor_from([], [], []),
                                              s.batch_put_tensor_from(["fd1", "fd2"], [qa], [len(ra)])]  # fmt: skip
        self.cases["upsert_from"] = [s.upsert_tensor_from("fa", qb, len(rb)), summary(s.get_tensor("fa"), b),
                                     s.upsert_tensor_from("fa", qa, 10), summary(s.get_tensor("fa"), b)]  # fmt: skip
        self.cases["batch_upsert_from"] = [s.batch_upsert_tensor_from(["fb1", "fu"], [qb, qa], [len(rb), len(ra)]),
                                           summary(s.get_tensor("fb1"), b), summary(s.get_tensor("fu"), a),
                                           s.batch_upsert_tensor_from([], [], [])]  # fmt: skip
        self.digest("from_buffers", ["fa", "fb1", "fb2", "fu"])
        stray = np.frombuffer(ra, np.uint8).copy()  # a valid object outside registered memory
        self.cases["put_from_unregistered"] = [s.put_tensor_from("fx", stray.ctypes.data, len(ra)),
                                               summary(s.get_tensor("fx"), a)]  # fmt: skip
        buf[:] = 0

    def tensor_parallel(self) -> None:
        s = self.s
        tensors = {"f16_4x6": make("float16", (4, 6), 11), "i32_8x4x2": make("int32", (8, 4, 2), 12)}
        for tname, t in tensors.items():
            for tp in (1, 2, 4):
                for split in range(t.dim()):
                    key, case = f"tp_{tname}_{tp}_{split}", f"tp_{tname}_size{tp}_dim{split}"
                    code = s.put_tensor_with_tp(key, t, tp_rank=tp - 1, tp_size=tp, split_dim=split)
                    shard_keys = [key] if tp == 1 else [f"{key}_tp_{r}" for r in range(tp)]
                    want = t.chunk(tp, split) if code == 0 else [None] * tp
                    reads = [summary(s.get_tensor_with_tp(key, r, tp, split), w) for r, w in zip(range(tp), want)]
                    self.cases[case] = [code, s.batch_is_exist([key] + [f"{key}_tp_{r}" for r in range(tp)]), reads]
                    if code == 0:
                        self.digest(case, shard_keys)
                        for k in shard_keys:
                            self.keep(k)
        t = tensors["f16_4x6"]
        self.cases["tp_refusals"] = [
            s.put_tensor_with_tp("tpr", t, 0, 4, 1),  # 6 is not a multiple of 4
            s.put_tensor_with_tp("tpr", t, 0, 2, 2),  # no dim 2
            s.put_tensor_with_tp("tpr", t, 0, 2, -1),
            s.put_tensor_with_tp("tpr", torch.tensor(1.0), 0, 2, 0),
            s.put_tensor_with_tp("tpr", np.zeros((4, 4)), 0, 2, 0),
            s.put_tensor_with_tp("tpr", torch.zeros(4, dtype=torch.complex64), 0, 2, 0),
            s.batch_is_exist(["tpr", "tpr_tp_0", "tpr_tp_1"]),
        ]
        self.cases["tp_read_other_rank"] = [summary(s.get_tensor_with_tp("tp_f16_4x6_2_0", 2, 2, 0)),
                                            summary(s.get_tensor_with_tp("tp_f16_4x6_2_0", -1, 2, 0)),
                                            summary(s.get_tensor_with_tp("tp_f16_4x6_2_0", 0, 1, 0))]  # fmt: skip
        u, v = make("int8", (2, 4), 13), make("bfloat16", (6, 2), 14)
        self.cases["batch_tp"] = [
            s.batch_put_tensor_with_tp(["bt1", "bt2", "bt3", "bt4"], [u, None, torch.zeros(3), v], 0, 2, 0),
            [summary(x, w) for x, w in zip(s.batch_get_tensor_with_tp(["bt1", "bt2", "bt4"], 1, 2), [u[1:], None, v[3:]])],
            s.batch_put_tensor_with_tp(["bt5"], [u, v], 0, 2, 0),
            s.batch_put_tensor_with_tp([], [], 0, 2, 0),
            s.batch_put_tensor_with_tp(["bt6"], [u], 0, 1, 0),
            [summary(x, w) for x, w in zip(s.batch_get_tensor_with_tp(["bt6", "bt1"], 0, 1), [u, None])],
        ]  # fmt: skip
        self.digest("batch_tp", ["bt1_tp_0", "bt1_tp_1", "bt4_tp_0", "bt4_tp_1", "bt6"])
        cfg = self.Config()
        self.cases["pub_tp"] = [
            s.pub_tensor_with_tp("ptp", v, cfg, 0, 2, 1), summary(s.get_tensor_with_tp("ptp", 1, 2, 1), v[:, 1:]),
            s.batch_pub_tensor_with_tp(["ptb1", "ptb2"], [u, v], cfg, 0, 2, 0),
            summary(s.get_tensor("ptb2_tp_0"), v[:3]),
        ]  # fmt: skip
        self.digest("pub_tp", ["ptp_tp_0", "ptp_tp_1", "ptb1_tp_0", "ptb2_tp_1"])
        p = self.p
        n = len(s.get("bt1_tp_1"))
        self.cases["tp_into"] = [
            summary(s.get_tensor_with_tp_into("bt1", p, 4096, 1, 2, 0), u[1:]),
            summary(s.get_tensor_with_tp_into("bt1", p, n - 1, 1, 2, 0)),
            summary(s.get_tensor_with_tp_into("bt6", p, 4096, 0, 1, 0), u),
            [summary(x, w) for x, w in zip(s.batch_get_tensor_with_tp_into(["bt1", "bt4", "nope"], [p, p + MIB, p + 2 * MIB],
                                                                          [4096, 4096, 4096], 0, 2), [u[:1], v[:3], None])],
            s.batch_get_tensor_with_tp_into(["bt1", "bt4"], [p], [4096, 4096], 0, 2),
        ]  # fmt: skip
        # The *_from forms take a whole serialized tensor and store its shards.
        raw = s.get("t_float32_4d")
        self.buf[: len(raw)] = np.frombuffer(raw, np.uint8)
        full = make("float32", SHAPES["4d"])
        self.cases["tp_from"] = [
            s.put_tensor_with_tp_from("tpf", p, len(raw), 0, 2, 1),
            summary(s.get_tensor_with_tp("tpf", 1, 2, 1), full.chunk(2, 1)[1]),
            s.put_tensor_with_tp_from("tpf2", p, len(raw), 0, 2, 0),
            s.put_tensor_with_tp_from("tpf3", p, len(raw), 0, 3, 1),
            s.put_tensor_with_tp_from("tpf4", p, len(raw) - 1, 0, 2, 0),
            s.put_tensor_with_tp_from("tpf5", p, len(raw), 0, 1, 0), summary(s.get_tensor("tpf5"), full),
            s.batch_put_tensor_with_tp_from(["tpb1", "tpb2"], [p, p], [len(raw), 10], 0, 2, 3),
            summary(s.get_tensor_with_tp("tpb1", 0, 2, 3), full.chunk(2, 3)[0]),
        ]  # fmt: skip
        self.digest("tp_from", ["tpf_tp_0", "tpf_tp_1", "tpf2_tp_1", "tpb1_tp_0", "tpb1_tp_1"])
        self.buf[:] = 0

    def parallelism(self) -> None:
        """The *_with_parallelism family without specs (the plain calls), and with one."""
        s, p, buf = self.s, self.p, self.buf
        a, b = make("float32", (4, 2), 15), make("int8", (3,), 16)
        cfg = self.Config()
        target = self.mod.ReadTarget()
        self.cases["parallelism_plain"] = [
            s.put_tensor_with_parallelism("par", a), summary(s.get_tensor_with_parallelism("par"), a),
            summary(s.get_tensor_with_parallelism("par", target), a),
            s.batch_put_tensor_with_parallelism(["par2", "par3"], [b, np.zeros(2)]),
            [summary(x, w) for x, w in zip(s.batch_get_tensor_with_parallelism(["par2", "par3"]), [b, None])],
            s.upsert_tensor_with_parallelism("par", b, None, cfg), summary(s.get_tensor("par"), b),
            s.batch_upsert_tensor_with_parallelism(["par2", "par4"], [a, a]), summary(s.get_tensor("par2"), a),
            s.batch_put_tensor_with_parallelism([], []), s.batch_put_tensor_with_parallelism(["par5"], []),
        ]  # fmt: skip
        self.digest("parallelism_plain", ["par", "par2", "par3", "par4"])
        ra = s.get("par2")
        buf[: len(ra)] = np.frombuffer(ra, np.uint8)
        self.cases["parallelism_from"] = [
            s.put_tensor_with_parallelism_from("pf1", p, len(ra)), summary(s.get_tensor("pf1"), a),
            s.put_tensor_with_parallelism_from("pf2", p, len(ra), None, cfg),
            s.put_tensor_with_parallelism_from("pf3", p, len(ra) - 1),
            s.upsert_tensor_with_parallelism_from("pf1", p, len(ra)),
            s.batch_put_tensor_with_parallelism_from(["pf4", "pf5"], [p, p], [len(ra), len(ra)]),
            s.batch_upsert_tensor_with_parallelism_from(["pf4", "pf6"], [p, p], [len(ra), 5]),
            s.batch_put_tensor_with_parallelism_from([], [], []),
        ]  # fmt: skip
        self.digest("parallelism_from", ["pf1", "pf2", "pf4", "pf5"])
        q = p + MIB
        self.cases["parallelism_into"] = [
            summary(s.get_tensor_with_parallelism_into("par2", q, 4096), a),
            summary(s.get_tensor_with_parallelism_into("par2", q, 10)),
            summary(s.get_tensor_with_parallelism_into("nope", q, 4096)),
            [summary(x, w) for x, w in zip(s.batch_get_tensor_with_parallelism_into(
                ["par2", "nope", "par"], [q, q + MIB, q + 2 * MIB], [4096, 4096, 4096]), [a, None, b])],
            s.batch_get_tensor_with_parallelism_into(["par2"], [q, q], [4096, 4096]),
        ]  # fmt: skip
        buf[:] = 0
        self.writer_partitions(a, cfg)
        axis = self.mod.ParallelAxis()
        axis.kind, axis.rank, axis.size, axis.split_dim = "tp", 0, 2, 0
        spec = self.mod.TensorParallelism()
        spec.axes = [axis]
        self.cases["parallelism_specs"] = [
            s.put_tensor_with_parallelism("pspec", a, spec),
            s.put_tensor_with_parallelism("pspec2", a, spec, cfg, object()),
        ]
    def writer_partitions(self, a, cfg) -> None:
        """Each writer stores its slice and the manifest; ReadTarget "full" joins them."""
        s, p, buf = self.s, self.p, self.buf
        t = make("float32", (4, 6), 17)
        W = lambda r, n, d: types.SimpleNamespace(rank=r, size=n, split_dim=d)  # noqa: E731
        full, shard = self.mod.ReadTarget(), self.mod.ReadTarget()
        full.mode, shard.mode = "FULL", "shard"
        self.cases["read_target_mode"] = [full.mode, catch(lambda: setattr(shard, "mode", "bogus")), shard.mode]
        first = s.put_tensor_with_parallelism("w", t, None, cfg, W(0, 2, 1))
        self.cases["writer_partition"] = [
            first, summary(s.get_tensor_with_parallelism("w", full)),
            s.put_tensor_with_parallelism("w", t, None, cfg, W(1, 2, 1)),
            summary(s.get_tensor_with_parallelism("w", full), t), summary(s.get_tensor_with_parallelism("w")),
            s.batch_is_exist(["w", "w__writer_0of2_sd1", "w__writer_1of2_sd1", "w__writer_manifest"]),
            summary(s.get_tensor_with_parallelism("w", shard)),
            s.put_tensor("wplain", a), summary(s.get_tensor_with_parallelism("wplain", full), a),
        ]  # fmt: skip
        self.cases["writer_partition_refusals"] = [
            s.put_tensor_with_parallelism("w2", t, None, cfg, W(0, 4, 1)),
            s.put_tensor_with_parallelism("w2", t, None, cfg, W(2, 2, 1)),
            s.put_tensor_with_parallelism("w2", t, None, cfg, W(0, 2, 5)),
            s.put_tensor_with_parallelism("w2", t, None, cfg, types.SimpleNamespace(rank=0)),
            s.put_tensor_with_parallelism("w2", np.zeros((4, 4)), None, cfg, W(0, 2, 0)),
            s.batch_is_exist(["w2__writer_manifest"]),
        ]
        u = make("int16", (6, 2), 18)
        twice = torch.cat([t[:, :3] * 2, t[:, 3:]], dim=1)
        self.cases["writer_partition_batch"] = [
            s.batch_put_tensor_with_parallelism(["wb1", "wb1"], [u, u], None, cfg, [W(0, 3, 0), W(1, 3, 0)]),
            summary(s.get_tensor_with_parallelism("wb1", full)),
            s.batch_put_tensor_with_parallelism(["wb1"], [u], None, cfg, [W(2, 3, 0)]),
            [summary(x, w) for x, w in zip(s.batch_get_tensor_with_parallelism(["wb1", "w"], [full, full]), [u, t])],
            s.batch_put_tensor_with_parallelism(["wb2", "wb3"], [u, u], None, cfg, [W(0, 2, 0)]),
            s.upsert_tensor_with_parallelism("w", t * 2, None, cfg, W(0, 2, 1)),
            summary(s.get_tensor_with_parallelism("w", full), twice),
            s.batch_upsert_tensor_with_parallelism(["w"], [t], None, cfg, [W(0, 2, 1)]),
            summary(s.get_tensor_with_parallelism("w", full), t),
        ]  # fmt: skip
        self.digest("writer_partition", ["w__writer_0of2_sd1", "w__writer_1of2_sd1", "w__writer_manifest",
                                         "wb1__writer_0of3_sd0", "wb1__writer_2of3_sd0", "wb1__writer_manifest"])  # fmt: skip
        e = torch.zeros(0, 4)
        self.cases["writer_partition_empty"] = [s.put_tensor_with_parallelism("we", e, None, cfg, W(0, 2, 1)),
                                                s.put_tensor_with_parallelism("we", e, None, cfg, W(1, 2, 1)),
                                                summary(s.get_tensor_with_parallelism("we", full), e)]  # fmt: skip
        self.digest("writer_partition_empty", ["we__writer_0of2_sd1", "we__writer_1of2_sd1", "we__writer_manifest"])
        q = p + 4 * MIB
        n = 304 + t.numel() * 4
        self.cases["writer_partition_into"] = [
            summary(s.get_tensor_with_parallelism_into("w", q, 4096, full), t),
            summary(s.get_tensor_with_parallelism_into("w", q, n - 1, full)),
            summary(s.get_tensor_with_parallelism_into("wplain", q, 4096, full), a),
        ]
        raw = s.get("t_float32_4d")
        buf[: len(raw)] = np.frombuffer(raw, np.uint8)
        whole = make("float32", SHAPES["4d"])
        self.cases["writer_partition_from"] = [
            s.put_tensor_with_parallelism_from("wf", p, len(raw), None, cfg, W(0, 2, 0)),
            s.batch_put_tensor_with_parallelism_from(["wf"], [p], [len(raw)], None, cfg, [W(1, 2, 0)]),
            summary(s.get_tensor_with_parallelism("wf", full), whole),
            s.upsert_tensor_with_parallelism_from("wf", p, len(raw), None, cfg, W(1, 2, 3)),
            s.put_tensor_with_parallelism_from("wf2", p, len(raw) - 1, None, cfg, W(0, 2, 0)),
        ]
        self.digest("writer_partition_from", ["wf__writer_0of2_sd0", "wf__writer_1of2_sd0", "wf__writer_manifest",
                                              "wf__writer_1of2_sd3"])  # fmt: skip
        buf[:] = 0

    def tp_specs(self) -> None:
        """A parallelism spec of one tensor-parallel axis: each rank stores its own slice."""
        s, p, buf, mod = self.s, self.p, self.buf, self.mod

        def spec(kind, rank, size, split):
            axis = mod.ParallelAxis()
            axis.kind, axis.rank, axis.size = kind, rank, size
            if split is not None:
                axis.split_dim = split
            out = mod.TensorParallelism()
            out.axes = [axis]
            return out

        def target(mode, parallelism=None):
            out = mod.ReadTarget()
            out.mode, out.parallelism = mode, parallelism
            return out

        t = make("float32", (4, 6), 19)
        sh = t.chunk(2, 1)
        s0, s1 = spec("tp", 0, 2, 1), spec("TP", 1, 2, 1)
        empty = mod.TensorParallelism()
        self.cases["tp_spec"] = [
            s.put_tensor_with_parallelism("ps", sh[0], s0),
            s.batch_is_exist(["ps", "ps_tp_0", "ps_tp_1", "ps__parallelism_manifest", "ps__tp_0of2_sd1"]),
            summary(s.get_tensor_with_parallelism("ps", target("shard", s0)), sh[0]),
            summary(s.get_tensor_with_parallelism("ps", target("full", s0))),
            s.put_tensor_with_parallelism("ps", sh[1], s1),
            summary(s.get_tensor_with_parallelism("ps", target("full", s1)), t),
            summary(s.get_tensor_with_parallelism("ps", target("as_stored", s1))),
            summary(s.get_tensor_with_parallelism("ps", target("full"))),
            [s.put_tensor_with_parallelism("pq", sh[0], q) for q in
             (spec("tp", 2, 2, 1), spec("tp", 0, 2, 5), spec("tp", 0, 2, None), spec("xx", 0, 2, 1), empty)],
            s.batch_is_exist(["pq_tp_0", "pq_tp_2", "pq__parallelism_manifest"]),
        ]  # fmt: skip
        self.digest("tp_spec", ["ps_tp_0", "ps_tp_1", "ps__parallelism_manifest"])
        s.put_tensor_with_tp("po", t, 0, 2, 1)
        u = make("int32", (4, 2), 20)
        self.cases["tp_spec_reads"] = [
            summary(s.get_tensor_with_parallelism("po", target("shard", s1)), sh[1]),
            summary(s.get_tensor_with_parallelism("po", target("full", s0)), t),
            s.batch_put_tensor_with_parallelism(["pb", "pb"], [u[:2], u[2:]], [spec("tp", 0, 2, 0), spec("tp", 1, 2, 0)]),
            [summary(x, w) for x, w in zip(s.batch_get_tensor_with_parallelism(
                ["pb", "ps"], [target("full", spec("tp", 0, 2, 0)), target("shard", s1)]), [u, sh[1]])],
            s.batch_put_tensor_with_parallelism(["pb2", "pb3"], [u, u], [s0]),
            s.upsert_tensor_with_parallelism("pb", u[:2] * 3, spec("tp", 0, 2, 0)),
            summary(s.get_tensor_with_parallelism("pb", target("full", spec("tp", 1, 2, 0))), torch.cat([u[:2] * 3, u[2:]])),
        ]  # fmt: skip
        self.digest("tp_spec_reads", ["pb_tp_0", "pb_tp_1", "pb__parallelism_manifest"])
        q = p + 6 * MIB
        self.cases["tp_spec_into"] = [
            summary(s.get_tensor_with_parallelism_into("ps", q, 4096, target("full", s0)), t),
            summary(s.get_tensor_with_parallelism_into("ps", q, 4096, target("shard", s1)), sh[1]),
            summary(s.get_tensor_with_parallelism_into("nope", q, 4096, target("shard", s1))),
        ]
        # The _from forms take the whole tensor and store every rank's slice (no manifest).
        s.put_tensor("ps_whole", t)
        raw = s.get("ps_whole")
        buf[: len(raw)] = np.frombuffer(raw, np.uint8)
        self.cases["tp_spec_from"] = [
            s.put_tensor_with_parallelism_from("pf", p, len(raw), s1),
            s.batch_is_exist(["pf", "pf_tp_0", "pf_tp_1", "pf__parallelism_manifest"]),
            summary(s.get_tensor_with_parallelism("pf", target("shard", s0)), sh[0]),
            s.batch_put_tensor_with_parallelism_from(["pf2"], [p], [len(raw)], [spec("tp", 0, 3, 1)]),
            summary(s.get_tensor_with_parallelism("pf2", target("full", spec("tp", 2, 3, 1))), t),
            s.put_tensor_with_parallelism_from("pf3", p, len(raw), spec("tp", 0, 4, 1)),
        ]
        self.digest("tp_spec_from", ["pf_tp_0", "pf_tp_1", "pf2_tp_0", "pf2_tp_1", "pf2_tp_2"])
        buf[:] = 0
        # Resharding reads: a shard of another tp size is cut out of the joined slices
        # (with the manifest, or the *_tp_<r> objects slice 0 names without one); a size
        # that does not divide the extent reads key_tp_<rank> as stored.
        self.cases["tp_spec_reshard"] = [
            summary(s.get_tensor_with_parallelism("ps", target("shard", spec("tp", 1, 4, 1)))),
            summary(s.get_tensor_with_parallelism("ps", target("shard", spec("tp", 2, 3, 1))), t[:, 4:]),
            summary(s.get_tensor_with_parallelism("ps", target("shard", spec("tp", 0, 1, 1))), t),
            summary(s.get_tensor_with_parallelism("po", target("shard", spec("tp", 1, 3, 1))), t[:, 2:4]),
            summary(s.get_tensor_with_parallelism("po", target("shard", spec("tp", 0, 2, 0)))),
            summary(s.get_tensor_with_parallelism_into("ps", p, 4096, target("shard", spec("tp", 5, 6, 1))), t[:, 5:]),
            summary(s.get_tensor_with_parallelism_into("ps", p, 4096, target("shard", spec("tp", 1, 4, 1)))),
            # A writer partition's slice reads as the tp shard of that partition, not re-cut.
            summary(s.get_tensor_with_parallelism("w", target("shard", spec("tp", 1, 2, 1)))),
            summary(s.get_tensor_with_parallelism("w", target("shard", spec("tp", 0, 3, 1)))),
            summary(s.get_tensor_with_parallelism("w", target("full", spec("tp", 0, 2, 1)))),
        ]  # fmt: skip
        buf[:] = 0

    def multi_specs(self) -> None:
        """Parallelism specs of several axes, or without a tp axis: shard keys with one
        suffix per axis in canonical order, headers with the axes in the caller's order."""
        s, p, buf, mod = self.s, self.p, self.buf, self.mod

        def spec(*axes):
            made = []
            for kind, rank, size, *extra in axes:
                axis = mod.ParallelAxis()
                axis.kind, axis.rank, axis.size = kind, rank, size
                for name, value in zip(("split_dim", "expert_id", "stage_id"), extra):
                    if value is not None:
                        setattr(axis, name, value)
                made.append(axis)
            out = mod.TensorParallelism()
            out.axes = made  # Mooncake's axes property gives a copy: assign the list
            return out

        def target(mode, parallelism=None):
            out = mod.ReadTarget()
            out.mode, out.parallelism = mode, parallelism
            return out

        def get(key, mode, parallelism, want=None):
            return summary(s.get_tensor_with_parallelism(key, target(mode, parallelism)), want)

        t = make("float32", (4, 6), 21)
        tp0, tp1, dp1 = ("tp", 0, 2, 1), ("tp", 1, 2, 1), ("dp", 1, 2)
        self.cases["multi_spec"] = [
            s.put_tensor_with_parallelism("m1", t, spec(tp0, dp1)),
            s.batch_is_exist(["m1__dp_1of2__tp_0of2_sd1", "m1__tp_0of2_sd1__dp_1of2", "m1__parallelism_manifest",
                              "m1_tp_0", "m1"]),
            get("m1", "shard", spec(dp1, tp0), t[:, :3]),
            get("m1", "full", spec(tp0, dp1)),
            s.put_tensor_with_parallelism("m1", t, spec(dp1, tp1)),
            get("m1", "full", spec(tp0, dp1), t),
            get("m1", "shard", spec(("dp", 0, 2), tp0)),
            get("m1", "shard", spec(dp1, ("tp", 2, 3, 1)), t[:, 4:]),
            get("m1", "shard", spec(dp1, ("tp", 0, 6, 1)), t[:, :1]),
            get("m1", "shard", spec(dp1, ("tp", 0, 4, 1))),
            get("m1", "full", spec(dp1, ("tp", 0, 2, 0))),
            get("m1", "as_stored", spec(dp1, tp0)),
            s.put_tensor_with_parallelism("m2", t, spec(("pp", 1, 2, None, None, 3), ("tp", 1, 4, 0),
                                                        ("ep", 0, 4, None, 5))),
            s.batch_is_exist(["m2__tp_1of4_sd0__ep_0of4_eid5__pp_1of2_sid3", "m2__parallelism_manifest"]),
            get("m2", "shard", spec(("ep", 0, 4, None, 5), ("tp", 1, 4, 0), ("pp", 1, 2, None, None, 3)), t[1:2]),
            get("m2", "shard", spec(("ep", 0, 4, None, 6), ("tp", 1, 4, 0), ("pp", 1, 2, None, None, 3))),
            get("m2", "shard", spec(("ep", 0, 4, None, 5), ("tp", 0, 2, 0), ("pp", 1, 2, None, None, 3))),
        ]  # fmt: skip
        self.digest("multi_spec", ["m1__dp_1of2__tp_0of2_sd1", "m1__dp_1of2__tp_1of2_sd1", "m1__parallelism_manifest",
                                   "m2__tp_1of4_sd0__ep_0of4_eid5__pp_1of2_sid3",
                                   "m2__parallelism_manifest"])  # fmt: skip
        self.keep("m1__dp_1of2__tp_0of2_sd1")
        self.keep("m2__tp_1of4_sd0__ep_0of4_eid5__pp_1of2_sid3")
        self.cases["generic_spec"] = [
            s.put_tensor_with_parallelism("g1", t, spec(dp1)),
            s.batch_is_exist(["g1__dp_1of2", "g1", "g1__parallelism_manifest"]),
            get("g1", "shard", spec(dp1), t),
            get("g1", "shard", spec(("dp", 0, 2))),
            get("g1", "full", spec(dp1)),
            summary(s.get_tensor("g1__dp_1of2"), t),
            s.put_tensor_with_parallelism("g2", t[0], spec(("pp", 0, 2, None, None, 7), ("dp", 1, 3),
                                                           ("ep", 2, 4, None, 0))),
            s.batch_is_exist(["g2__dp_1of3__ep_2of4_eid0__pp_0of2_sid7"]),
            get("g2", "shard", spec(("dp", 1, 3), ("ep", 2, 4, None, 0), ("pp", 0, 2, None, None, 7)), t[0]),
            s.upsert_tensor_with_parallelism("g1", t * 2, spec(dp1)),
            get("g1", "shard", spec(dp1), t * 2),
            s.batch_put_tensor_with_parallelism(["g3", "g4"], [t, t], [spec(("ep", 1, 2, None, 4)), spec(tp0, dp1)]),
            [summary(x, w) for x, w in zip(s.batch_get_tensor_with_parallelism(
                ["g3", "g4", "g4"], [target("shard", spec(("ep", 1, 2, None, 4))), target("shard", spec(tp0, dp1)),
                                     target("full", spec(tp0, dp1))]), [t, t[:, :3], None])],
        ]  # fmt: skip
        self.digest("generic_spec", ["g1__dp_1of2", "g2__dp_1of3__ep_2of4_eid0__pp_0of2_sid7", "g3__ep_1of2_eid4",
                                     "g4__dp_1of2__tp_0of2_sd1"])  # fmt: skip
        self.keep("g2__dp_1of3__ep_2of4_eid0__pp_0of2_sid7")
        self.cases["multi_spec_refusals"] = [
            s.put_tensor_with_parallelism("mr", t, q) for q in (
                spec(tp0, ("tp", 1, 2, 1)), spec(("dp", 0, 2, 1)), spec(("ep", 0, 2)), spec(("pp", 0, 2)),
                spec(("ep", 0, 2, 1, 3)), spec(("pp", 0, 2, 0, None, 1)), spec(dp1, ("tp", 0, 4, 1)),
                spec(("dp", 2, 2), tp0), spec(("dp", 0, 0)), spec(("dp", 0, 2), ("ep", 0, 2, None, 1), tp0,
                                                                 ("pp", 0, 2, None, None, 1), ("xx", 0, 1)),
                spec(("dp", 0, 2), tp0, ("zz", 0, 1)))
        ] + [
            s.batch_is_exist(["mr__dp_0of2", "mr__parallelism_manifest"]),
            get("g1", "shard", spec(("dp", 1, 2, 0))),
            s.batch_put_tensor_with_parallelism(["mr2", "mr3"], [t, t], [spec(dp1), spec(("pp", 0, 2))]),
        ]  # fmt: skip
        s.put_tensor("mwhole", t)
        raw = s.get("mwhole")
        buf[: len(raw)] = np.frombuffer(raw, np.uint8)
        q = p + 6 * MIB
        self.cases["multi_spec_from"] = [
            s.put_tensor_with_parallelism_from("mf", p, len(raw), spec(("dp", 0, 2), ("tp", 1, 3, 1))),
            s.batch_is_exist(["mf__dp_0of2__tp_0of3_sd1", "mf__dp_0of2__tp_2of3_sd1", "mf__parallelism_manifest"]),
            get("mf", "full", spec(("dp", 0, 2), ("tp", 0, 3, 1)), t),
            get("mf", "shard", spec(("dp", 0, 2), ("tp", 2, 3, 1)), t[:, 4:]),
            get("mf", "shard", spec(("dp", 0, 2), ("tp", 0, 2, 1))),
            s.put_tensor_with_parallelism_from("mf2", p, len(raw), spec(("pp", 1, 2, None, None, 0))),
            get("mf2", "shard", spec(("pp", 1, 2, None, None, 0)), t),
            s.batch_put_tensor_with_parallelism_from(["mf3"], [p], [len(raw)], [spec(dp1, ("tp", 0, 4, 1))]),
        ]  # fmt: skip
        # Into reads: the tensor, and the header written before it (the stored shard's, a
        # re-cut shard's naming the request's axes, a whole tensor's), compared as bytes.
        heads = hashlib.sha256()
        for key, mode, parallelism, want in (
            ("m1", "shard", spec(dp1, tp1), t[:, 3:]), ("m1", "full", spec(dp1, tp1), t),
            ("m1", "shard", spec(tp1, dp1), t[:, 3:]), ("m1", "shard", spec(("tp", 1, 3, 1), dp1), t[:, 2:4]),
            ("g1", "shard", spec(dp1), t * 2), ("ps", "shard", spec(("tp", 0, 2, 1)), None),
        ):  # fmt: skip
            buf[6 * MIB : 6 * MIB + 512] = 0
            self.cases["multi_spec_from"].append(
                summary(s.get_tensor_with_parallelism_into(key, q, 4096, target(mode, parallelism)), want))
            heads.update(bytes(buf[6 * MIB : 6 * MIB + 304]))
        self.digests["multi_spec_into_headers"] = heads.hexdigest()
        s.put_tensor("m0d", torch.tensor(7.5))
        raw0 = s.get("m0d")
        buf[: len(raw0)] = np.frombuffer(raw0, np.uint8)
        self.cases["multi_spec_from"] += [
            s.put_tensor_with_parallelism_from("mf4", p, len(raw0), spec(("dp", 0, 1))),
            summary(s.get_tensor_with_parallelism("mf4", target("shard", spec(("dp", 0, 1))))),
        ]
        self.digest("multi_spec_from", ["mf__dp_0of2__tp_0of3_sd1", "mf__dp_0of2__tp_1of3_sd1",
                                        "mf__dp_0of2__tp_2of3_sd1", "mf2__pp_1of2_sid0", "mf4__dp_0of1"])  # fmt: skip
        # An upsert of another tp size replaces the manifest; reads that its slices cannot
        # serve fall back to the slices of the requested size.
        tp03 = ("tp", 0, 3, 1)
        self.cases["multi_spec_upsert"] = [
            s.batch_upsert_tensor_with_parallelism(["m1"], [t * 3], [spec(dp1, tp03)]),
            get("m1", "full", spec(dp1, tp03)),
            get("m1", "shard", spec(dp1, tp03), (t * 3)[:, :2]),
            get("m1", "shard", spec(dp1, tp1), t[:, 3:]),
            get("m1", "full", spec(dp1, tp0), t),
            get("m1", "shard", spec(dp1, ("tp", 1, 3, 1)), t[:, 2:4]),
            s.upsert_tensor_with_parallelism("m1", t * 3, spec(tp03, dp1)),
            [summary(x, w) for x, w in zip(s.batch_get_tensor_with_parallelism_into(
                ["m1", "g1", "nope"], [p + 6 * MIB, p + 7 * MIB, p + 8 * MIB], [4096, 4096, 4096],
                [target("shard", spec(dp1, tp03)), target("shard", spec(dp1)), target("full", spec(dp1, tp0))]),
                [(t * 3)[:, :2], t * 2, None])],
        ]  # fmt: skip
        self.digest("multi_spec_upsert", ["m1__dp_1of2__tp_0of3_sd1", "m1__parallelism_manifest"])
        buf[:] = 0

    def cross(self, other: dict) -> dict:
        """Stores each of the other implementation's raw objects and reads them back."""
        out = {}
        for key, (hexraw, _summary) in other["objects"].items():
            raw = bytes.fromhex(hexraw)
            code = self.s.put("x_" + key, raw)
            out[key] = [code, fingerprint(self.s.get_tensor("x_" + key))]
        return out


def main() -> None:
    impl, out_path = sys.argv[1], sys.argv[2]
    other = json.load(open(sys.argv[3])) if len(sys.argv) > 3 else None
    r = Run(impl)
    try:
        r.cases["setup"] = [r.setup, r.registered]
        if other is None:
            for phase in (r.dtypes_and_shapes, r.refusals, r.overwrite, r.batches, r.into, r.from_buffers,
                          r.tensor_parallel, r.parallelism, r.tp_specs, r.multi_specs):  # fmt: skip
                phase()
            result = {"cases": r.cases, "digests": r.digests, "objects": r.objects}
        else:
            result = {"cross": r.cross(other)}
        with open(out_path, "w") as f:
            json.dump(result, f)
    finally:
        r.s.close()
        r.stop()


if __name__ == "__main__":
    main()
