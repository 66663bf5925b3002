"""SGLang's own classes on pagewire (run by scripts/sglang-check.sh).

Every process runs with PAGEWIRE_AS_MOONCAKE=1, so SGLang's unchanged
``from mooncake.engine import TransferEngine`` / ``from mooncake.store import ...`` get
pagewire. Nothing of SGLang is edited or replaced: this file only builds SGLang's objects
(transfer engine wrapper, PD KV manager with its sender, receiver and bootstrap server, KV
pools, host pools, the MooncakeStore HiCache backend), calls them the way SGLang's
schedulers and HiCache controller do, and checks the bytes.

    python check.py all                 the checks below, a summary line, exit status
    python check.py ROLE [JSON]         one side of a two-process check (driven by `all`):
                                        pd-target, pd-initiator, kvmgr-prefill, kvmgr-decode,
                                        hicache-writer, hicache-reader

The two sides of a check talk to the orchestrator over stdin/stdout: a side prints
``READY <json>`` (or ``STEP <json>``) and waits for a line on stdin; ``RESULT PASS|FAIL
name [why]`` lines are the verdicts. Environment: MOONCAKE_MASTER (pagewire's master).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
import traceback

SEED = 20261205
P, L, SIZE = 4, 2, 64  # page size, layers, device pool capacity (tokens)
H, D = 4, 8  # MHA heads, head dim
KV_LORA, ROPE = 10, 6  # MLA latent and rope widths
STEP_TIMEOUT = 180.0  # seconds for one side to answer (imports are slow on CI's cores)

# (pool kind, host layout): the layouts SGLang's MooncakeStore accepts for each pool
# (MHA layer_first is refused by MooncakeStore itself; page_first_kv_split is NPU-only).
HICACHE_CASES = [
    ("mha", "page_first"),
    ("mha", "page_first_direct"),
    ("mha", "page_head"),
    ("mla", "layer_first"),
    ("mla", "page_first"),
    ("mla", "page_first_direct"),
]
# Host pages written (source) and where the reader puts them (destination).
SRC_PAGES, DST_PAGES = [3, 7, 2, 8], [0, 5, 9, 1]
# PD: prefill pages -> decode pages (two contiguous runs and two single pages).
PD_SRC, PD_DST = [3, 4, 5, 9, 1], [0, 1, 2, 6, 10]


def result(ok: bool, name: str, why: str = "", prefix: str = "RESULT ") -> bool:
    """Prints a verdict; a child's ``RESULT`` lines are counted by the orchestrator."""
    print(f"{prefix}{'PASS' if ok else 'FAIL'} {name}{' (' + why + ')' if why else ''}", flush=True)
    return ok


def one_line(text: str) -> str:
    """A traceback's last lines (where it failed and why) on one line."""
    return " | ".join(line.strip() for line in text.strip().splitlines()[-4:])


def wait_line() -> str:
    line = sys.stdin.readline()
    if not line:
        raise SystemExit("orchestrator went away")
    return line.strip()


def pattern(seed: int, n: int) -> bytes:
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def fill(ptr: int, data: bytes) -> None:
    ctypes.memmove(ptr, data, len(data))


# --- PD: SGLang's MooncakeTransferEngine, registered as MooncakeKVManager does -----------


def pd_pool():
    """The decode/prefill KV pool SGLang's PD connector registers (MHA, on CPU here)."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(SIZE, P, torch.bfloat16, H, D, L, "cpu", False,
                            start_layer=0, end_layer=L - 1)


def pd_engine():
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        MooncakeTransferEngine,
    )

    return MooncakeTransferEngine(hostname="127.0.0.1")


def pd_target(_: dict) -> None:
    """Decode side: registers its KV buffers (register_buffer_to_engine's batch_register)
    and an aux buffer (register), waits for the prefill side's WRITE, checks every byte,
    then deregisters (batch_deregister, deregister)."""
    te = pd_engine()
    pool = pd_pool()
    ptrs, lens, item_lens = pool.get_contiguous_buf_infos()
    aux = ctypes.create_string_buffer(4096)
    ok = result(te.batch_register(list(ptrs), list(lens)) == 0,
                "pd: batch_register of the decode KV buffers")
    try:
        te.register(ctypes.addressof(aux), len(aux))
        ok &= result(True, "pd: register of an aux buffer")
    except RuntimeError as e:
        ok &= result(False, "pd: register of an aux buffer", str(e))
    print("READY " + json.dumps({"session": te.get_session_id(), "ptrs": ptrs,
                                  "aux": ctypes.addressof(aux)}), flush=True)
    wait_line()  # the prefill side has sent
    bad = []
    for i, (ptr, n, item) in enumerate(zip(ptrs, lens, item_lens)):
        got = ctypes.string_at(ptr, n)
        src = pattern(SEED + i, n)
        want = bytearray(n)
        for s, d in zip(PD_SRC, PD_DST):
            want[d * item : (d + 1) * item] = src[s * item : (s + 1) * item]
        if got != bytes(want):
            bad.append(i)
    ok &= result(not bad, "pd: decode pages equal the prefill pages, nothing else written",
                 f"buffers {bad} differ" if bad else "")
    ok &= result(ctypes.string_at(ctypes.addressof(aux), 16) == b"aux-bytes-landed",
                 "pd: aux buffer written")
    ok &= result(te.batch_deregister(list(ptrs)) == 0, "pd: batch_deregister")
    try:
        te.deregister(ctypes.addressof(aux))
        ok &= result(True, "pd: deregister")
    except RuntimeError as e:
        ok &= result(False, "pd: deregister", str(e))
    print("STEP {}", flush=True)
    wait_line()  # the prefill side has tried again
    sys.exit(0 if ok else 1)


def pd_initiator(info: dict) -> None:
    """Prefill side: the transfer plan of SGLang's _send_kvcache_generic (runs of
    contiguous pages by SGLang's group_concurrent_contiguous, all layers, K then V, in one
    batch_transfer_sync), then the same after the peer deregistered (must fail)."""
    import numpy as np
    from sglang.srt.disaggregation.common.utils import group_concurrent_contiguous

    te = pd_engine()
    pool = pd_pool()
    ptrs, lens, item_lens = pool.get_contiguous_buf_infos()
    for i, (ptr, n) in enumerate(zip(ptrs, lens)):
        fill(ptr, pattern(SEED + i, n))
    aux = ctypes.create_string_buffer(b"aux-bytes-landed", 64)
    ok = result(te.batch_register(list(ptrs), list(lens)) == 0,
                "pd: batch_register of the prefill KV buffers")
    te.register(ctypes.addressof(aux), len(aux))
    runs_src, runs_dst = group_concurrent_contiguous(
        np.array(PD_SRC, dtype=np.int32), np.array(PD_DST, dtype=np.int32))
    srcs, dsts, sizes = [], [], []
    for src_ptr, dst_ptr, item in zip(ptrs, info["ptrs"], item_lens):
        for rs, rd in zip(runs_src, runs_dst):
            srcs.append(src_ptr + rs[0] * item)
            dsts.append(dst_ptr + rd[0] * item)
            sizes.append(item * len(rs))
    ok &= result(len(runs_src) == 3, "pd: group_concurrent_contiguous found the 3 runs")
    rc = te.batch_transfer_sync(info["session"], srcs, dsts, sizes)
    ok &= result(rc == 0, "pd: batch_transfer_sync of all layers", f"returned {rc}")
    rc = te.transfer_sync(info["session"], ctypes.addressof(aux), info["aux"], 16)
    ok &= result(rc == 0, "pd: transfer_sync of the aux buffer", f"returned {rc}")
    print("STEP {}", flush=True)
    wait_line()  # the decode side has deregistered
    rc = te.batch_transfer_sync(info["session"], srcs, dsts, sizes)
    ok &= result(rc < 0, "pd: batch_transfer_sync into deregistered memory fails", f"returned {rc}")
    te.batch_deregister(list(ptrs))
    te.deregister(ctypes.addressof(aux))
    sys.exit(0 if ok else 1)


# --- PD: SGLang's MooncakeKVManager, KVSender and KVReceiver --------------------------
#
# Each side is one scheduler rank as SGLang sets it up (publish of ServerArgs, the shared
# engine from maybe_init_shared_mooncake_transfer_engine, KVArgs filled the way
# PrefillBootstrapQueue/DecodePreallocQueue._init_kv_manager fill them from a real KV pool
# and MetadataBuffers), both registered through SGLang's MooncakeKVBootstrapServer, which
# this orchestrator runs (SGLang runs it in the prefill server's HTTP process).

# A Llama-shaped config matching the pools (ServerArgs resolves the model's config).
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H * D,
    "intermediate_size": 2 * H * D, "num_attention_heads": H, "num_key_value_heads": H,
    "head_dim": D, "num_hidden_layers": L, "vocab_size": 256, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
}  # fmt: skip
KV_ROOM = 4242  # the request's bootstrap room
KV_AUX = 3  # its MetadataBuffers row on prefill (source) and on decode (destination)
KV_DST_AUX = 1


def kv_server_args(info: dict, mode: str):
    """Minimal valid ServerArgs for one PD side, published as the scheduler does. The
    model directory holds only a config.json: the KV manager never loads weights."""
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(
        model_path=info["model"], skip_tokenizer_init=True, device="cpu", host="127.0.0.1",
        page_size=P, disaggregation_mode=mode, disaggregation_transfer_backend="mooncake",
        disaggregation_bootstrap_port=info["bootstrap_port"],
    )  # fmt: skip
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))
    return args


def kv_pool(kind: str):
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    if kind == "mha":
        return MHATokenToKVPool(SIZE, P, torch.bfloat16, H, D, L, "cpu", False,
                                start_layer=0, end_layer=L - 1)
    return MLATokenToKVPool(SIZE, P, torch.bfloat16, KV_LORA, ROPE, L, "cpu", False,
                            start_layer=0, end_layer=L - 1)


def kv_manager(info: dict, mode: str):
    """(manager, pool, metadata buffers) for one side, built by SGLang's own code. The
    caller keeps the pool and the buffers alive: the manager holds only their addresses."""
    import torch
    from sglang.srt.disaggregation import utils as du
    from sglang.srt.distributed.bootstrap import init_parallel_runtime
    from sglang.srt.runtime_context import get_device, get_disagg, get_parallel

    args = kv_server_args(info, mode)
    # What the model runner does next: the shared engine, then the process groups
    # (gloo, world size 1, on CPU).
    init_parallel_runtime(server_args=args, device="cpu", dist_port=free_port())
    pool = kv_pool(info["kind"])
    meta = du.MetadataBuffers(8, hidden_size=H * D, hidden_states_dtype=torch.bfloat16,
                              max_sampling_mask_tokens=args.sampling_mask_max_tokens)
    kv_args = du.get_kv_class(du.TransferBackend.MOONCAKE, du.KVClassType.KVARGS)()
    kv_args.engine_rank = 0
    kv_args.pp_rank = 0
    kv_args.system_dp_rank = get_parallel().dp_rank
    kv_args.rust_http_port = None
    kv_args.kv_cache_dtype_str = "bfloat16"
    kv_args.kv_layout = du.get_pd_kv_layout(pool)
    kv_args.prefill_start_layer = pool.start_layer
    kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = (
        du.get_kv_transfer_buf_infos(pool))
    kv_args.prefill_end_layer = pool.end_layer
    kv_args.num_draft_entries = 0
    kv_args.kv_layer_ids = du.build_kv_layer_ids(
        token_to_kv_pool=pool, draft_token_to_kv_pool=None, num_draft_entries=0,
        num_hidden_layers=L)
    mla = du.is_mla_backend(pool)
    if not mla:
        kv_args.kv_head_num = pool.head_num
        kv_args.total_kv_head_num = H
    kv_args.page_size = pool.page_size
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = meta.get_buf_infos()
    kv_args.ib_device = get_disagg().disaggregation_ib_device
    kv_args.gpu_id = get_device().gpu_id
    du.setup_state_kv_args(kv_args, pool, None, L)
    manager_class = du.get_kv_class(du.TransferBackend.MOONCAKE, du.KVClassType.MANAGER)
    disagg = du.DisaggregationMode.PREFILL if mode == "prefill" else du.DisaggregationMode.DECODE
    return manager_class(kv_args, disagg, args, mla), pool, meta


def kv_poll(obj, want: int, timeout: float = 60.0) -> int:
    """Polls a KVSender/KVReceiver until ``want`` or Failed (as the schedulers' loops do)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    deadline = time.monotonic() + timeout
    while True:
        state = obj.poll()
        if state in (want, KVPoll.Failed) or time.monotonic() > deadline:
            return state
        time.sleep(0.01)


def kv_why(mgr, state: int, want: int) -> str:
    """Why a poll did not reach ``want``: the state, and the manager's failure record."""
    if state == want:
        return ""
    return f"poll gave {state}, failure record: {mgr.failure_records.get(KV_ROOM)!r}"


def kv_regions(mgr) -> list:
    """(ptr, length, item length) of every buffer the manager registered: the KV buffers
    (one item a page), then the MetadataBuffers (one item a request row: aux)."""
    a = mgr.kv_args
    return [list(zip(a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens)),
            list(zip(a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens))]


def kv_expected(regions: list, seed: int, moves: list) -> list:
    """Indices of the regions whose bytes differ from: zero, except items ``d`` holding
    item ``s`` of the source pattern for each (s, d) in ``moves``."""
    bad = []
    for i, (ptr, n, item) in enumerate(regions):
        src, want = pattern(seed + i, n), bytearray(n)
        for s, d in moves:
            want[d * item : (d + 1) * item] = src[s * item : (s + 1) * item]
        if ctypes.string_at(ptr, n) != bytes(want):
            bad.append(i)
    return bad


def kvmgr_prefill(info: dict) -> None:
    """Prefill side: MooncakeKVManager(PREFILL) and a MooncakeKVSender for one request;
    sends PD_SRC pages and the aux row once the decode side asked for them."""
    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender

    mgr, pool, meta = kv_manager(info, "prefill")
    kv, aux = kv_regions(mgr)
    for seed, regions in ((SEED + 50, kv), (SEED + 70, aux)):
        for i, (ptr, n, _) in enumerate(regions):
            fill(ptr, pattern(seed + i, n))
    sender = MooncakeKVSender(mgr, f"127.0.0.1:{info['bootstrap_port']}", KV_ROOM)
    sender.init(len(PD_SRC), KV_AUX)
    kind = info["kind"]
    # The decode side starts with this one: its start-up counts in this wait.
    state = kv_poll(sender, KVPoll.WaitingForInput, STEP_TIMEOUT)
    ok = result(state == KVPoll.WaitingForInput,
                f"kvmgr {kind}: sender bootstrapped by the decode side's metadata",
                kv_why(mgr, state, KVPoll.WaitingForInput))
    if ok:
        sender.send(np.array(PD_SRC, dtype=np.int32))
        state = kv_poll(sender, KVPoll.Success)
        ok &= result(state == KVPoll.Success, f"kvmgr {kind}: sender.send polled to Success",
                     kv_why(mgr, state, KVPoll.Success))
    wait_line()  # the decode side has checked its bytes
    sys.exit(0 if ok else 1)


def kvmgr_decode(info: dict) -> None:
    """Decode side: MooncakeKVManager(DECODE) and a MooncakeKVReceiver; after Success,
    every destination page and the aux row equal the prefill side's, nothing else
    written."""
    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVReceiver

    kind = info["kind"]
    mgr, pool, meta = kv_manager(info, "decode")
    kv, aux = kv_regions(mgr)
    addr = f"127.0.0.1:{info['bootstrap_port']}"
    # The decode scheduler's prealloc queue retries until the prefill rank registered.
    deadline = time.monotonic() + STEP_TIMEOUT
    while not mgr.try_ensure_parallel_info(addr) and time.monotonic() < deadline:
        time.sleep(0.2)
    receiver = MooncakeKVReceiver(mgr, addr, KV_ROOM)
    receiver.init(0)
    state = kv_poll(receiver, KVPoll.WaitingForInput)
    ok = result(state == KVPoll.WaitingForInput,
                f"kvmgr {kind}: receiver.init found the prefill rank through the bootstrap server",
                kv_why(mgr, state, KVPoll.WaitingForInput))
    if ok:
        receiver.send_metadata(np.array(PD_DST, dtype=np.int32), KV_DST_AUX)
        state = kv_poll(receiver, KVPoll.Success)
        ok &= result(state == KVPoll.Success, f"kvmgr {kind}: receiver polled to Success",
                     kv_why(mgr, state, KVPoll.Success))
    bad = kv_expected(kv, SEED + 50, list(zip(PD_SRC, PD_DST)))
    ok &= result(not bad, f"kvmgr {kind}: decode pages equal the prefill pages, nothing else",
                 f"KV buffers {bad} differ" if bad else "")
    bad = kv_expected(aux, SEED + 70, [(KV_AUX, KV_DST_AUX)])
    ok &= result(not bad, f"kvmgr {kind}: aux (MetadataBuffers) row written, nothing else",
                 f"aux buffers {bad} differ" if bad else "")
    sys.exit(0 if ok else 1)


# --- HiCache: real host pools through SGLang's MooncakeStore ---------------------------


def host_pool(kind: str, layout: str):
    """A host pool built from a CPU device pool, as SGLang's hybrid_pool_assembler builds
    it (pin_memory off: there is no CUDA here)."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    if kind == "mha":
        dev = MHATokenToKVPool(SIZE, P, torch.bfloat16, H, D, L, "cpu", False,
                               start_layer=0, end_layer=L - 1)
        return MHATokenToKVPoolHost(
            dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, P, layout, pin_memory=False,
            device_capacity_tokens=dev.size, start_layer=dev.start_layer,
            end_layer=dev.end_layer, write_back_staging=dev.hicache_write_back_staging)
    dev = MLATokenToKVPool(SIZE, P, torch.bfloat16, KV_LORA, ROPE, L, "cpu", False,
                           start_layer=0, end_layer=L - 1)
    return MLATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, P, layout, pin_memory=False,
        override_kv_cache_dim=dev.kv_cache_dim, device_capacity_tokens=dev.size,
        start_layer=dev.start_layer, end_layer=dev.end_layer, target_layer_num=dev.layer_num)


def host_tensors(pool) -> list:
    """The host memory MooncakeStore registers (its _iter_host_pool_buffers)."""
    get = getattr(pool, "get_hybrid_pool_buffer", None)
    return [t for t in (get() if get else [pool.kv_buffer]) if t is not None]


def slots(pages):
    import torch

    return torch.tensor([p * P + t for p in pages for t in range(P)], dtype=torch.int64)


def page_keys(case: str) -> list:
    return [hashlib.sha256(f"{case}/{i}".encode()).hexdigest() for i in range(len(SRC_PAGES))]


def make_store(kind: str, layout: str):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=kind == "mla", enable_storage_metrics=False,
        is_page_first_layout=layout != "layer_first", model_name=f"pagewire/{kind}-{layout}",
    )  # fmt: skip
    return MooncakeStore(config)


def shared_engine(tag: str):
    """With SGLANG_HICACHE_MOONCAKE_REUSE_TE=1, the process-wide engine SGLang's
    maybe_init_shared_mooncake_transfer_engine creates for HiCache on Mooncake."""
    from sglang.srt.distributed.device_communicators import mooncake_transfer_engine as mte
    from sglang.srt.environ import envs

    if not envs.SGLANG_HICACHE_MOONCAKE_REUSE_TE.get():
        return None
    return mte.init_mooncake_transfer_engine(hostname="127.0.0.1")


def check_reuse(store, te, tag: str, name: str) -> bool:
    if te is None:
        return True
    reused = getattr(store, "_shared_mooncake_transfer_engine", None) is te
    host = store.store.get_hostname()
    return result(reused and host == te.get_session_id(),
                  f"{tag}: {name}: MooncakeStore reuses the shared engine",
                  f"reused={reused}, store segment {host!r}, engine {te.get_session_id()!r}")


def hicache_writer(info: dict) -> None:
    tag = info["tag"]
    te = shared_engine(tag)
    ok, keep = True, []
    for n, (kind, layout) in enumerate(HICACHE_CASES):
        name = f"{kind} {layout}"
        try:
            pool = host_pool(kind, layout)
            for i, t in enumerate(host_tensors(pool)):
                fill(t.data_ptr(), pattern(SEED + 100 * n + i, t.numel() * t.element_size()))
            store = make_store(kind, layout)
            ok &= check_reuse(store, te, tag, name)
            store.register_mem_pool_host(pool)
            got = store.batch_set_v1(page_keys(f"{tag}/{name}"), slots(SRC_PAGES))
            ok &= result(list(got) == [True] * len(SRC_PAGES), f"{tag}: {name}: batch_set_v1",
                         f"{got}")
            keep.append((pool, store))
        except Exception:
            ok &= result(False, f"{tag}: {name}: write", one_line(traceback.format_exc()))
    print("READY {}", flush=True)
    wait_line()  # the reader is done: the objects in this process's segment may go
    sys.exit(0 if ok else 1)


def hicache_reader(info: dict) -> None:
    tag = info["tag"]
    te = shared_engine(tag)
    ok = True
    for n, (kind, layout) in enumerate(HICACHE_CASES):
        name = f"{kind} {layout}"
        try:
            pool, ref = host_pool(kind, layout), host_pool(kind, layout)
            for i, t in enumerate(host_tensors(ref)):
                fill(t.data_ptr(), pattern(SEED + 100 * n + i, t.numel() * t.element_size()))
            store = make_store(kind, layout)
            ok &= check_reuse(store, te, tag, name)
            store.register_mem_pool_host(pool)
            keys = page_keys(f"{tag}/{name}")
            ok &= result(store.batch_exists(keys + ["absent" * 8]) == len(keys),
                         f"{tag}: {name}: batch_exists")
            got = store.batch_get_v1(keys, slots(DST_PAGES))
            ok &= result(list(got) == [True] * len(keys), f"{tag}: {name}: batch_get_v1", f"{got}")
            same, why = compare_pages(pool, ref)
            ok &= result(same, f"{tag}: {name}: pages byte-exact", why)
        except Exception:
            ok &= result(False, f"{tag}: {name}: read", one_line(traceback.format_exc()))
    sys.exit(0 if ok else 1)


def compare_pages(pool, ref):
    """(ok, why): every destination page of ``pool`` equals its source page of ``ref``
    (SGLang's own get_page_buffer_meta gives the segments), and every other byte of
    ``pool`` is still zero."""
    for sp, dp in zip(SRC_PAGES, DST_PAGES):
        sptrs, ssizes = ref.get_page_buffer_meta(slots([sp]))
        dptrs, dsizes = pool.get_page_buffer_meta(slots([dp]))
        if list(ssizes) != list(dsizes):
            return False, f"page sizes differ: {ssizes} vs {dsizes}"
        for a, b, size in zip(sptrs, dptrs, dsizes):
            if ctypes.string_at(a, size) != ctypes.string_at(b, size):
                return False, f"page {sp} -> {dp} differs"
    written = set()
    dptrs, dsizes = pool.get_page_buffer_meta(slots(DST_PAGES))
    spans = sorted(zip(dptrs, dsizes))
    for t in host_tensors(pool):
        base, n = t.data_ptr(), t.numel() * t.element_size()
        mem = bytearray(ctypes.string_at(base, n))
        for ptr, size in spans:
            if base <= ptr < base + n:
                mem[ptr - base : ptr - base + size] = bytes(size)
                written.add(ptr)
        if any(mem):
            return False, "bytes outside the pages read were written"
    if len(written) != len(spans):
        return False, "a page segment lies outside the registered host tensors"
    return True, ""


# --- orchestration ----------------------------------------------------------------------


class Side:
    """One side of a two-process check: a child running this file with a role."""

    def __init__(self, role: str, info: dict, env: dict) -> None:
        self.role = role
        self.proc = subprocess.Popen(
            [sys.executable, "-u", __file__, role, json.dumps(info)], env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.results: list = []
        self.log: list = []
        # A thread reads the child's output: select() on a buffered pipe misses lines
        # already read into the buffer.
        self.lines: queue.Queue = queue.Queue()
        self.drained = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def until(self, word: str) -> dict:
        """Reads lines up to ``word <json>``; returns the JSON (or raises on exit)."""
        deadline = time.monotonic() + STEP_TIMEOUT
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"{self.role}: no {word} within {STEP_TIMEOUT:.0f} s")
            if line is None:  # the reader's end mark: finish() must not wait for it
                self.drained = True
                raise RuntimeError(f"{self.role} exited before {word}")
            self.take(line)
            if line.startswith(word + " "):
                return json.loads(line[len(word) + 1 :])

    def take(self, line: str) -> None:
        line = line.rstrip("\n")
        if line.startswith("RESULT "):
            self.results.append(line)
            print(line[len("RESULT ") :], flush=True)
        else:
            self.log.append(line)

    def go(self) -> None:
        try:
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()
        except OSError:  # it exited already: finish() reports how
            pass

    def finish(self) -> bool:
        try:
            self.proc.wait(timeout=STEP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        while not self.drained:
            line = self.lines.get()
            if line is None:
                self.drained = True
            else:
                self.take(line)
        return self.proc.returncode == 0

    def failure(self, why: str) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.finish()
        print(f"FAIL {self.role}: {why}; its last output:", flush=True)
        for line in self.log[-15:]:
            print(f"    {line}", flush=True)
        self.results.append(f"RESULT FAIL {self.role}")


def env_for(**extra) -> dict:
    env = dict(os.environ, PAGEWIRE_AS_MOONCAKE="1", MOONCAKE_LOCAL_HOSTNAME="127.0.0.1",
               MOONCAKE_TE_META_DATA_SERVER="P2PHANDSHAKE")
    env.update(extra)
    return env


def run_pair(first: str, second: str, env: dict, env2: dict, info: dict, steps: int) -> list:
    """``first`` prints READY and waits; ``second`` starts with READY's JSON; then
    ``steps`` STEP handshakes, alternating (second, first, second, ...): the side that
    printed STEP waits while the other goes on. Finally ``first`` is let go."""
    a = Side(first, info, env)
    try:
        ready = a.until("READY")
    except RuntimeError as e:
        a.failure(str(e))
        return a.results
    b = Side(second, {**info, **ready}, env2)
    sides = [b, a]
    try:
        for k in range(steps):
            sides[k % 2].until("STEP")
            sides[(k + 1) % 2].go()
    except RuntimeError as e:
        for s in sides:
            s.failure(str(e))
        return a.results + b.results
    settle(b)
    a.go()
    settle(a)
    return a.results + b.results


def settle(side: Side) -> None:
    """Waits for ``side`` to exit; a non-zero exit without a FAIL verdict is one."""
    if not side.finish() and not any(r.startswith("RESULT FAIL") for r in side.results):
        side.failure("exited non-zero")


def run_kvmgr(kinds: list, env: dict) -> list:
    """Per pool kind, SGLang's MooncakeKVBootstrapServer here and a prefill and a decode
    rank as children. All children start at once (the decode side waits for the prefill
    rank's registration as SGLang's does): their imports overlap."""
    import tempfile

    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVBootstrapServer

    with tempfile.TemporaryDirectory() as model:
        with open(os.path.join(model, "config.json"), "w") as f:
            json.dump(MODEL_CONFIG, f)
        pairs = []
        for kind in kinds:
            port = free_port()
            MooncakeKVBootstrapServer("127.0.0.1", port)  # serves from a daemon thread
            info = {"kind": kind, "model": model, "bootstrap_port": port}
            pairs.append((Side("kvmgr-prefill", info, env), Side("kvmgr-decode", info, env)))
        results = []
        for prefill, decode in pairs:
            settle(decode)
            prefill.go()  # the decode side has checked its bytes
            settle(prefill)
            results += prefill.results + decode.results
        return results


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_sglang_test(env: dict) -> list:
    """SGLang's own test_mooncake_store.py, unchanged, as its __main__ runs it."""
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    path = os.path.join(os.path.dirname(spec.origin), "srt", "mem_cache", "storage",
                        "mooncake_store", "test_mooncake_store.py")
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True,
                           timeout=STEP_TIMEOUT * 2)
    except subprocess.TimeoutExpired as e:
        result(False, "sglang test_mooncake_store.py", f"no exit within {e.timeout:.0f} s", "")
        return ["RESULT FAIL test_mooncake_store"]
    out = p.stdout + p.stderr
    passed = out.count("Single operation passed") + out.count("Batch operation passed")
    ok = p.returncode == 0 and "All tests passed" in out and passed == 5
    line = result(ok, "sglang test_mooncake_store.py (5 tests)",
                  f"{passed}/5 passed, exit {p.returncode}, {time.monotonic() - t0:.1f} s", "")
    if not ok:
        print("\n".join("    " + s for s in out.splitlines()[-25:]), flush=True)
    return [f"RESULT {'PASS' if line else 'FAIL'} test_mooncake_store"]


# The SGLang modules the checks use; a missing import fails the run and says which.
MODULES = [
    "torch",
    "sglang.srt.distributed.device_communicators.mooncake_transfer_engine",
    "sglang.srt.disaggregation.common.utils",
    "sglang.srt.disaggregation.mooncake.conn",
    "sglang.srt.disaggregation.utils",
    "sglang.srt.distributed.bootstrap",
    "sglang.srt.server_args",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.mla",
    "sglang.srt.mem_cache.storage.mooncake_store.mooncake_store",
]


def preflight() -> list:
    """Imports every module (with the hook on, as the checks run): failures as text."""
    import importlib

    bad = []
    if os.environ.get("PAGEWIRE_AS_MOONCAKE") != "1":
        bad.append("PAGEWIRE_AS_MOONCAKE=1 is not set")
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception as e:
            bad.append(f"{name}: {type(e).__name__}: {e}")
    for mod in ("mooncake.engine", "mooncake.store"):
        try:
            importlib.import_module(mod)
        except Exception as e:  # the wheel's import hook did not answer
            bad.append(f"{mod} (pagewire's hook): {type(e).__name__}: {e}")
    return bad


def main_all() -> int:
    t0 = time.monotonic()
    bad = preflight()
    for line in bad:
        print(f"FAIL import {line}", flush=True)
    if bad:
        print("sglang-check: add what is missing to scripts/sglang/requirements.txt", flush=True)
        print(f"0 passed, {len(bad)} failed", flush=True)
        return 1
    print(f"== imports took {time.monotonic() - t0:.0f} s", flush=True)
    results = []
    print("== (a) PD: MooncakeTransferEngine between two processes", flush=True)
    pd_env = env_for(MOONCAKE_PROTOCOL="tcp")
    results += run_pair("pd-target", "pd-initiator", pd_env, pd_env, {}, 2)
    # SGLang's own KV manager, sender and receiver; SGLANG_HOST_IP: the address SGLang
    # takes for this host (engine session, ZMQ) instead of probing the NICs.
    kv_env = env_for(MOONCAKE_PROTOCOL="tcp", SGLANG_HOST_IP="127.0.0.1", HF_HUB_OFFLINE="1")
    print("== (a') PD: SGLang's MooncakeKVManager, sender and receiver, prefill -> decode "
          "(MHA and MLA pools)", flush=True)
    t1 = time.monotonic()
    results += run_kvmgr(["mha", "mla"], kv_env)
    print(f"== (a') took {time.monotonic() - t1:.0f} s", flush=True)
    print("== (b) SGLang's test_mooncake_store.py", flush=True)
    results += run_sglang_test(env_for(MOONCAKE_PROTOCOL="tcp",
                                       MOONCAKE_GLOBAL_SEGMENT_SIZE=str(256 << 20)))
    for tag, extra in [
        ("hicache", dict(MOONCAKE_PROTOCOL="tcp", SGLANG_HICACHE_MOONCAKE_REUSE_TE="0")),
        # SGLang reuses the shared engine only for protocol "rdma" and a device name equal
        # to the engine's ("" with MC_FORCE_TCP=1, which pagewire also honours: TCP).
        ("hicache-reuse", dict(MOONCAKE_PROTOCOL="rdma", MC_FORCE_TCP="1",
                               SGLANG_HICACHE_MOONCAKE_REUSE_TE="1")),
    ]:
        print(f"== ({'c' if tag == 'hicache' else 'd'}) {tag}: host pools written by one "
              "process, read by another", flush=True)
        writer = env_for(MOONCAKE_GLOBAL_SEGMENT_SIZE=str(32 << 20), **extra)
        # The reader contributes no segment: what it reads lies in the writer's.
        reader = env_for(MOONCAKE_GLOBAL_SEGMENT_SIZE="0", **extra)
        results += run_pair("hicache-writer", "hicache-reader", writer, reader, {"tag": tag}, 0)
    passed = sum(r.startswith("RESULT PASS") for r in results)
    failed = len(results) - passed
    print(f"== sglang checks took {time.monotonic() - t0:.0f} s", flush=True)
    print(f"{passed} passed, {failed} failed", flush=True)
    return 1 if failed or not passed else 0


ROLES = {"pd-target": pd_target, "pd-initiator": pd_initiator,
         "kvmgr-prefill": kvmgr_prefill, "kvmgr-decode": kvmgr_decode,
         "hicache-writer": hicache_writer, "hicache-reader": hicache_reader}

if __name__ == "__main__":
    if sys.argv[1:2] == ["all"]:
        sys.exit(main_all())
    ROLES[sys.argv[1]](json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
