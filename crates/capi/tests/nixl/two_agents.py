"""A NIXL agent transfer through NIXL's Mooncake backend, on whatever libtransfer_engine.so
the plugin loads (pagewire's, for scripts/nixl-check.sh).

Two processes: `two_agents.py target DIR` exposes a 4 MiB buffer; `two_agents.py initiator
DIR` WRITEs 2 MiB into it with a notification, then READs 16 bytes back. They exchange
agent metadata and the target's buffer address through files in DIR. Bytes are verified
on the receiving side of each transfer. Exit status 0 when everything checked out.
"""

import os
import sys
import time

import numpy as np

try:
    from nixl_cu12._api import nixl_agent, nixl_agent_config
except ImportError:
    from nixl._api import nixl_agent, nixl_agent_config

N = 4 << 20
role, d = sys.argv[1], sys.argv[2]


def pattern(n):
    return (np.arange(n, dtype=np.uint64) * 2654435761 >> 7).astype(np.uint8)


def publish(name, data):
    with open(f"{d}/{name}.tmp", "wb") as f:
        f.write(data)
    os.rename(f"{d}/{name}.tmp", f"{d}/{name}")


def wait_for(name, timeout=60):
    t0 = time.time()
    while not os.path.exists(f"{d}/{name}"):
        if time.time() - t0 > timeout:
            sys.exit(f"{role}: timed out waiting for {name}")
        time.sleep(0.01)
    with open(f"{d}/{name}", "rb") as f:
        return f.read()


def run(agent, handle):
    state = agent.transfer(handle)
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    return state


agent = nixl_agent(role, nixl_agent_config(backends=["MOONCAKE"]))
buf = np.zeros(N, dtype=np.uint8)
if role == "initiator":
    buf[:] = pattern(N)
agent.register_memory([(buf.ctypes.data, N, 0, "")], "DRAM")
publish(f"{role}.meta", agent.get_agent_metadata())
publish(f"{role}.addr", str(buf.ctypes.data).encode())

if role == "target":
    agent.add_remote_agent(wait_for("initiator.meta"))
    notes, t0 = {}, time.time()
    while b"write-done" not in notes.get("initiator", []):
        for k, v in agent.get_new_notifs().items():
            notes.setdefault(k, []).extend(v)
        if time.time() - t0 > 60:
            sys.exit("target: no notification within 60 s")
        time.sleep(0.001)
    mb = 1 << 20
    ok = np.array_equal(buf[mb : 3 * mb], pattern(N)[: 2 * mb]) and not buf[:mb].any()
    print(f"target: notifications {notes}, written bytes {'verified' if ok else 'WRONG'}")
    buf[:16] = np.arange(100, 116, dtype=np.uint8)
    publish("target.ready", b"1")
    wait_for("initiator.done", 120)
    sys.exit(0 if ok else 1)

peer = agent.add_remote_agent(wait_for("target.meta"))
raddr = int(wait_for("target.addr"))
mb = 1 << 20
local = agent.get_xfer_descs([(buf.ctypes.data, 2 * mb, 0)], "DRAM")
remote = agent.get_xfer_descs([(raddr + mb, 2 * mb, 0)], "DRAM")
h = agent.initialize_xfer("WRITE", local, remote, peer, b"write-done")
t0 = time.time()
state = run(agent, h)
print(f"initiator: WRITE 2 MiB with a notification -> {state} in {(time.time() - t0) * 1e3:.1f} ms")
agent.release_xfer_handle(h)
wait_for("target.ready")
local = agent.get_xfer_descs([(buf.ctypes.data + 3 * mb, 16, 0)], "DRAM")
remote = agent.get_xfer_descs([(raddr, 16, 0)], "DRAM")
h = agent.initialize_xfer("READ", local, remote, peer)
state = run(agent, h)
got = [int(x) for x in buf[3 * mb : 3 * mb + 16]]
ok = state == "DONE" and got == list(range(100, 116))
print(f"initiator: READ 16 B -> {state}, bytes {'verified' if ok else f'WRONG {got}'}")
agent.release_xfer_handle(h)
publish("initiator.done", b"1")
sys.exit(0 if ok else 1)
