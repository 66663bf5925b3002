/*
 * transfer_engine_c.h: pagewire's implementation of the Mooncake Transfer Engine C API.
 *
 * Link with -ltransfer_engine (pagewire's libtransfer_engine.so or .a). Every type and
 * signature below matches Mooncake's header of the same name, so code compiled against
 * either runs with pagewire's library. Behaviour, and where pagewire is stricter than
 * Mooncake, is described in docs/c-api.md of the pagewire repository. In short:
 *
 *   - int functions return 0 or a negative error (ERR_* in Mooncake's error.h);
 *     submitTransfer, submitTransferWithNotify, getTransferStatus and freeBatchID return
 *     0 or a positive status code; allocateBatchID returns INVALID_BATCH on failure;
 *     createTransferEngine returns NULL on failure.
 *   - Engine handles and batch ids are table entries, not pointers: an unknown, freed or
 *     INVALID_BATCH id, a destroyed engine or a null pointer gets an error, never a crash.
 *   - Only the "P2PHANDSHAKE" metadata mode exists. A segment name is "host:port" of the
 *     peer engine (what getLocalIpAndPort writes there).
 *   - Strings passed in are copied; the caller may free them when the call returns.
 *   - pw_last_error() (declared in pagewire.h) gives the reason for the last failure on
 *     the calling thread.
 */
#ifndef TRANSFER_ENGINE_C
#define TRANSFER_ENGINE_C

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Identifiers of segments (peer engines) and batches. */
#define segment_handle_t int32_t
#define segment_id_t int32_t
#define batch_id_t uint64_t

/* This engine's own segment. */
#define LOCAL_SEGMENT (0)
/* allocateBatchID's failure value. */
#define INVALID_BATCH UINT64_MAX

/* transfer_request.opcode */
#define OPCODE_READ (0)
#define OPCODE_WRITE (1)

/* One transfer: length bytes between local memory at source and the target segment's
 * memory at target_offset (an address in the target's address space). */
struct transfer_request {
    int opcode;
    void *source;
    segment_id_t target_id;
    uint64_t target_offset;
    uint64_t length;
};
typedef struct transfer_request transfer_request_t;

/* A notification: who sent it and what it says (both NUL-terminated). */
struct notify_msg {
    char *name;
    char *msg;
};
typedef struct notify_msg notify_msg_t;

/* transfer_status.status */
#define STATUS_WAITING (0)
#define STATUS_PENDING (1)
#define STATUS_INVALID (2)
#define STATUS_CANCELED (3)
#define STATUS_COMPLETED (4)
#define STATUS_TIMEOUT (5)
#define STATUS_FAILED (6)

struct transfer_status {
    int status;
    uint64_t transferred_bytes;
};

/* Declared for compatibility; no function here takes it. */
struct segment_desc {
    int type;
    union {
        struct {
            void *addr;
            uint64_t size;
            const char *location;
        } rdma;
        struct {
            const char *file_path;
            const char *subsystem_name;
            const char *proto;
            const char *ip;
            uint64_t port;
        } nvmeof;
    } desc_;
};

typedef struct transfer_status transfer_status_t;

struct buffer_entry {
    void *addr;
    size_t length;
};
typedef struct buffer_entry buffer_entry_t;

typedef struct segment_desc segment_desc_t;
typedef void *transfer_engine_t;
typedef void *transport_t;

/* Engine life cycle. metadata_conn_string must be "P2PHANDSHAKE"; local_server_name is
 * this host's address or name (a ":port" suffix is ignored: a free port is chosen);
 * ip_or_host_name, rpc_port and auto_discover are ignored (the backend is RDMA verbs when
 * a device is usable, TCP otherwise; PAGEWIRE_TRANSPORT or MC_FORCE_TCP=1 override). */
transfer_engine_t createTransferEngine(const char *metadata_conn_string,
                                       const char *local_server_name,
                                       const char *ip_or_host_name,
                                       uint64_t rpc_port, int auto_discover);

int discoverTopology(transfer_engine_t engine);

/* Writes "host:port", this engine's segment name. */
int getLocalIpAndPort(transfer_engine_t engine, char *buf_out, size_t buf_len);

transport_t installTransport(transfer_engine_t engine, const char *proto,
                             void **args);

int uninstallTransport(transfer_engine_t engine, const char *proto);

/* Segments: connect to a peer engine by its "host:port" name. */
segment_id_t openSegment(transfer_engine_t engine, const char *segment_name);

segment_id_t openSegmentNoCache(transfer_engine_t engine,
                                const char *segment_name);

int closeSegment(transfer_engine_t engine, segment_id_t segment_id);

int warmupEfaSegment(transfer_engine_t engine, const char *segment_name);

int removeLocalSegment(transfer_engine_t engine, const char *segment_name);

void destroyTransferEngine(transfer_engine_t engine);

/* Memory: buffers stay allocated until unregistered or the engine is destroyed. */
int registerLocalMemory(transfer_engine_t engine, void *addr, size_t length,
                        const char *location, int remote_accessible);

int unregisterLocalMemory(transfer_engine_t engine, void *addr);

int registerLocalMemoryBatch(transfer_engine_t engine,
                             buffer_entry_t *buffer_list, size_t buffer_len,
                             const char *location);

int unregisterLocalMemoryBatch(transfer_engine_t engine, void **addr_list,
                               size_t addr_len);

/* Batches: allocate an id, submit requests into it, poll each request's status by its
 * index (task_id), free it once nothing is pending. */
batch_id_t allocateBatchID(transfer_engine_t engine, size_t batch_size);

int submitTransfer(transfer_engine_t engine, batch_id_t batch_id,
                   struct transfer_request *entries, size_t count);

int submitTransferWithNotify(transfer_engine_t engine, batch_id_t batch_id,
                             struct transfer_request *entries, size_t count,
                             notify_msg_t notify_msg);

/* Notifications: malloc'ed array (free it with freeNotifsMsgBuf), NULL when empty. */
notify_msg_t *getNotifsFromEngine(transfer_engine_t engine, int *size);

int freeNotifsMsgBuf(notify_msg_t *msg, int size);

int genNotifyInEngine(transfer_engine_t engine, uint64_t target_id,
                      notify_msg_t notify_msg);

int getTransferStatus(transfer_engine_t engine, batch_id_t batch_id,
                      size_t task_id, struct transfer_status *status);

int freeBatchID(transfer_engine_t engine, batch_id_t batch_id);

int syncSegmentCache(transfer_engine_t engine);

struct nic_load_stat {
    char device_name[64];
    uint64_t inflight_bytes;
    double ewma_bandwidth_bps;
};
typedef struct nic_load_stat nic_load_stat_t;

int getNicLoadStats(transfer_engine_t engine, nic_load_stat_t *stats,
                    size_t *count);

void enableGracefulShutdown(transfer_engine_t engine);

int showLinks(transfer_engine_t engine, char *buf_out, size_t buf_len,
              int json);

#ifdef __cplusplus
}
#endif

#endif /* TRANSFER_ENGINE_C */
