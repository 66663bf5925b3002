/*
 * pagewire.h: pagewire's own C API.
 *
 * Link with -ltransfer_engine (the same library that implements transfer_engine_c.h).
 *
 *   - Handles (pw_engine, pw_region, pw_peer, pw_batch) are opaque. They are checked on
 *     every call: a handle that was never issued, was freed, or is of another kind gets
 *     PW_ERR_BAD_HANDLE, never a crash.
 *   - Every function returns a pw_status. PW_OK is success; PW_PENDING means "still
 *     running" (batches); everything else is an error, and pw_last_error() tells why.
 *   - Functions that wait take a timeout in milliseconds and never block longer (a
 *     connect waits at most PAGEWIRE_HANDSHAKE_TIMEOUT_MS).
 *   - Engine settings beyond the two arguments of pw_engine_new come from the PAGEWIRE_*
 *     environment variables (docs/transport.md).
 *   - All functions may be called from any thread.
 */
#ifndef PAGEWIRE_H
#define PAGEWIRE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------ errors */

typedef enum pw_status {
    PW_OK = 0,
    PW_PENDING = 1,                 /* the batch has work outstanding (not an error) */
    PW_ERR_INVALID_ARGUMENT = 2,    /* null pointer, unknown enum value, malformed string */
    PW_ERR_BAD_HANDLE = 3,          /* never issued, freed, or another kind of handle */
    PW_ERR_BUFFER_TOO_SMALL = 4,    /* output did not fit; the size needed is reported */
    PW_ERR_CONFIG = 5,              /* a PAGEWIRE_* setting or option is out of range */
    PW_ERR_BACKEND_UNAVAILABLE = 6, /* the requested backend cannot run here */
    PW_ERR_UNSUPPORTED = 7,         /* not available on this backend or build */
    PW_ERR_INVALID_RANGE = 8,       /* zero length, overflow, or not memory of this process */
    PW_ERR_UNREGISTERED = 9,        /* a local range outside registered memory */
    PW_ERR_PERMISSION = 10,         /* registered without the access the op needs */
    PW_ERR_REGION_OVERLAP = 11,     /* overlaps a registered region */
    PW_ERR_REGISTRATION = 12,       /* the backend refused the registration */
    PW_ERR_REGION_BUSY = 13,        /* transfers still use the region */
    PW_ERR_REMOTE_OUT_OF_BOUNDS = 14, /* a remote range outside what the peer exposes */
    PW_ERR_REMOTE_PERMISSION = 15,  /* the peer exposes it without the needed access */
    PW_ERR_EMPTY_BATCH = 16,        /* no op and no notification */
    PW_ERR_HANDSHAKE = 17,          /* handshake refused, wrong token, garbage */
    PW_ERR_CONNECT = 18,            /* the peer could not be reached */
    PW_ERR_PEER_GONE = 19,          /* the connection broke */
    PW_ERR_REMOTE_REFUSED = 20,     /* the peer refused an operation */
    PW_ERR_TIMEOUT = 21,            /* a deadline passed */
    PW_ERR_CANCELLED = 22,          /* the batch was cancelled */
    PW_ERR_DEVICE = 23,             /* RDMA device failure (work completion, verbs call) */
    PW_ERR_IO = 24,                 /* operating-system I/O error */
    PW_ERR_SHUTDOWN = 25,           /* the engine was freed */
    PW_ERR_LAYOUT = 26,             /* a pool description or page list was refused */
    PW_ERR_INTERNAL = 27,           /* a bug (caught inside the library) */
    PW_ERR_TOO_MANY_PEERS = 28      /* the engine holds its maximum of peers: disconnect one */
} pw_status;

/* A static description of a status value (never NULL). */
const char *pw_status_str(pw_status status);

/* Why the last failing call on this thread failed (also after transfer_engine_c.h
 * calls); NULL if the last call succeeded. Valid until the thread's next call. */
const char *pw_last_error(void);

/* The library version, e.g. "0.1.0". */
const char *pw_version(void);

/* ------------------------------------------------------------------------ handles */

typedef struct pw_engine pw_engine;
typedef struct pw_region pw_region;
typedef struct pw_peer pw_peer;
typedef struct pw_batch pw_batch;

/* Region access bits. */
#define PW_ACCESS_LOCAL_WRITE 1u  /* the local engine may write it (READ targets) */
#define PW_ACCESS_REMOTE_WRITE 2u /* peers may write it */
#define PW_ACCESS_REMOTE_READ 4u  /* peers may read it */
#define PW_ACCESS_ALL 7u

/* Batch op directions. */
#define PW_OP_READ 0u  /* the peer's memory into local memory */
#define PW_OP_WRITE 1u /* local memory into the peer's memory */

/* ------------------------------------------------------------------------ engines */

/* backend: "auto", "verbs", "tcp", "loopback", or NULL (PAGEWIRE_TRANSPORT, else auto).
 * listen: control listener "ip:port", or NULL (PAGEWIRE_LISTEN, else "0.0.0.0:0"). */
pw_status pw_engine_new(const char *backend, const char *listen, pw_engine **out);

/* Closes every connection, fails pending batches, releases every registration. Regions,
 * peers and batches of the engine report PW_ERR_SHUTDOWN until freed. */
pw_status pw_engine_free(pw_engine *engine);

/* "ip:port" of the control listener (what peers pass to pw_peer_connect). */
pw_status pw_engine_local_addr(const pw_engine *engine, char *buf, size_t len);

/* "verbs", "tcp" or "loopback". */
pw_status pw_engine_backend(const pw_engine *engine, char *buf, size_t len);

/* Next remote notification within timeout_ms: the sender (see pw_peer_id) and the tag
 * it set with pw_batch_set_notify. PW_ERR_TIMEOUT if none came. */
pw_status pw_engine_poll_notification(pw_engine *engine, uint32_t timeout_ms,
                                      uint64_t *peer_id, uint32_t *tag);

/* Reaps completions once on this thread (required with PAGEWIRE_PROGRESS=manual,
 * optional otherwise). reaped may be NULL. */
pw_status pw_engine_progress(pw_engine *engine, size_t *reaped);

/* ------------------------------------------------------------------------ regions */

/* Registers [addr, addr+len) with PW_ACCESS_* bits. The memory must stay allocated until
 * the region is deregistered or the engine freed; peers may write it at any time while it
 * is registered with PW_ACCESS_REMOTE_WRITE. A range inside an existing region with no
 * more access shares that registration (each handle is deregistered on its own). */
pw_status pw_region_register(pw_engine *engine, void *addr, size_t len, uint32_t access,
                             pw_region **out);

/* Waits up to timeout_ms for batches using the region, then releases it and frees the
 * handle; PW_ERR_TIMEOUT if they did not finish (the handle stays valid). */
pw_status pw_region_deregister(pw_region *region, uint32_t timeout_ms);

/* ------------------------------------------------------------------------ peers */

/* Connects to the engine listening at "host:port" and runs the handshake. */
pw_status pw_peer_connect(pw_engine *engine, const char *addr, pw_peer **out);

/* Waits up to timeout_ms for a peer to connect to this engine. */
pw_status pw_peer_accept(pw_engine *engine, uint32_t timeout_ms, pw_peer **out);

/* The peer's number on this engine (as pw_engine_poll_notification reports it). */
pw_status pw_peer_id(const pw_peer *peer, uint64_t *id);

/* Fetches the peer's exposed regions again (after it registered more memory). */
pw_status pw_peer_refresh(pw_peer *peer);

/* Disconnects (pending batches to the peer fail) and frees the handle. */
pw_status pw_peer_close(pw_peer *peer);

/* ------------------------------------------------------------------------ batches */

pw_status pw_batch_new(pw_batch **out);

/* Appends one op; addresses are checked at submit. Refused (PW_PENDING) while running. */
pw_status pw_batch_add(pw_batch *batch, uint32_t op, uint64_t local, uint64_t remote,
                       uint64_t len);

/* Appends a transfer plan in data-flow order (pw_plan's output): for PW_OP_WRITE srcs
 * are local and dsts remote, for PW_OP_READ srcs are remote and dsts local. */
pw_status pw_batch_add_plan(pw_batch *batch, uint32_t op, const uint64_t *srcs,
                            const uint64_t *dsts, const uint64_t *lens, size_t n);

/* The peer is notified with tag once every byte of the batch is in its memory. */
pw_status pw_batch_set_notify(pw_batch *batch, uint32_t tag);

/* Deadline relative to submission; 0 = PAGEWIRE_BATCH_TIMEOUT_MS (30 s). */
pw_status pw_batch_set_timeout(pw_batch *batch, uint32_t timeout_ms);

/* Checks every op (local ranges registered, remote ranges exposed by the peer, with the
 * needed access), then posts them all; on error nothing is posted. A finished batch can
 * be submitted again. */
pw_status pw_batch_submit(pw_batch *batch, pw_peer *peer);

/* PW_OK (every byte moved), PW_PENDING, or the failure. Never blocks. */
pw_status pw_batch_status(pw_batch *batch);

/* Waits up to timeout_ms: PW_OK, PW_PENDING (still running), or the failure. */
pw_status pw_batch_wait(pw_batch *batch, uint32_t timeout_ms);

/* Best effort: bytes already in flight may still land (inside the target ranges). */
pw_status pw_batch_cancel(pw_batch *batch);

pw_status pw_batch_bytes_done(pw_batch *batch, uint64_t *bytes);

/* Forgets the ops, notification and timeout of a batch that is not running. */
pw_status pw_batch_reset(pw_batch *batch);

/* Frees the handle; a running batch carries on to its end. */
pw_status pw_batch_free(pw_batch *batch);

/* ------------------------------------------------------------------------ layout */

#define PW_POOL_MHA 0u       /* one buffer: K half, then V half (head_dim == v_head_dim) */
#define PW_POOL_MHA_SPLIT 1u /* separate K and V buffers (v_base required) */
#define PW_POOL_MLA 2u       /* one latent buffer of kv_dim elements per token and layer */

#define PW_LAYOUT_LAYER_FIRST 0u       /* (L, S, H, D) */
#define PW_LAYOUT_PAGE_FIRST 1u        /* (S, L, H, D) */
#define PW_LAYOUT_PAGE_FIRST_DIRECT 2u /* (N, L, P, H, D) */
#define PW_LAYOUT_PAGE_HEAD 3u         /* (N, H, P, L, D) */

#define PW_CHECKS_STRICT 0u /* every slot of every page is checked */
#define PW_CHECKS_SGLANG 1u /* only what SGLang itself reads */

/* A host KV pool. Fields that do not apply to the kind are 0. */
typedef struct pw_pool_desc {
    uint32_t kind;        /* PW_POOL_* */
    uint32_t layout;      /* PW_LAYOUT_* */
    uint64_t layers;
    uint64_t page_size;   /* tokens per page */
    uint64_t heads;       /* MHA kinds */
    uint64_t head_dim;    /* MHA kinds */
    uint64_t v_head_dim;  /* 0 = head_dim */
    uint64_t kv_dim;      /* MLA */
    uint64_t dtype_bytes;
    uint64_t capacity;    /* token slots, a multiple of page_size */
    uint64_t base;        /* pool (K buffer) address */
    uint64_t v_base;      /* V buffer address, used when has_v_base != 0 */
    uint32_t has_v_base;
    uint32_t checks;      /* PW_CHECKS_* */
} pw_pool_desc;

/* SGLang's get_page_buffer_meta: for token slot indices (whole pages of page_size
 * consecutive slots), one (ptr, len) per page and buffer (and per layer for layer_first).
 * On PW_OK, *n_out entries were written. PW_ERR_BUFFER_TOO_SMALL sets *n_out to the
 * entries needed and writes nothing. */
pw_status pw_page_meta(const pw_pool_desc *pool, const uint64_t *indices, size_t n_indices,
                       uint64_t *ptrs, uint64_t *lens, size_t capacity, size_t *n_out);

/* The same for page indices (page p is token slots p*page_size ...). */
pw_status pw_page_meta_for_pages(const pw_pool_desc *pool, const uint64_t *pages,
                                 size_t n_pages, uint64_t *ptrs, uint64_t *lens,
                                 size_t capacity, size_t *n_out);

/* The coalesced copies moving src_pages of pool src to dst_pages of pool dst, as
 * (srcs[i], dsts[i], lens[i]). Buffer handling as pw_page_meta. */
pw_status pw_plan(const pw_pool_desc *src, const pw_pool_desc *dst,
                  const uint64_t *src_pages, const uint64_t *dst_pages, size_t n_pages,
                  uint64_t *srcs, uint64_t *dsts, uint64_t *lens, size_t capacity,
                  size_t *n_out);

#ifdef __cplusplus
}
#endif

#endif /* PAGEWIRE_H */
