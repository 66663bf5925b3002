/*
 * Two processes move bytes through libtransfer_engine.so with Mooncake's C API.
 *
 * The parent (initiator) forks a child (target). The child creates an engine, registers
 * a pool for remote access, and reports its segment name and pool address over a pipe;
 * then it answers commands: verify that a range holds a given pattern, that a range is
 * untouched, that a notification arrived. The parent opens the child's segment, writes
 * and reads many sizes, and feeds every bad input listed in docs/c-api.md, checking the
 * documented code and (on the child) that nothing was written.
 *
 * The backend comes from the environment (PAGEWIRE_TRANSPORT=tcp or verbs), for both
 * processes. Exit status 0 means every check passed.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "pagewire.h"
#include "transfer_engine_c.h"

#define POOL_BYTES (8u << 20)
#define LOCAL_BYTES (8u << 20)

static int failures;
static const char *role = "parent";

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void fail(const char *file, int line, const char *fmt, ...) {
    va_list ap;
    fprintf(stderr, "[%s] FAIL %s:%d: ", role, file, line);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, " (last error: %s)\n", pw_last_error() ? pw_last_error() : "none");
    failures++;
}

#define CHECK(cond, ...)                                    \
    do {                                                    \
        if (!(cond)) fail(__FILE__, __LINE__, __VA_ARGS__); \
    } while (0)
#define CHECK_EQ(got, want, what)                                                         \
    do {                                                                                  \
        long long g_ = (long long)(got), w_ = (long long)(want);                          \
        if (g_ != w_) fail(__FILE__, __LINE__, "%s: got %lld, want %lld", what, g_, w_); \
    } while (0)

/* The byte at offset i of a pattern with this seed. */
static uint8_t pat(uint32_t seed, uint64_t i) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ (uint64_t)seed * 0xD1B54A32D192ED03ull;
    x ^= x >> 29;
    return (uint8_t)(x ^ (x >> 17));
}

static void fill(uint8_t *p, uint64_t off, uint64_t len, uint32_t seed) {
    for (uint64_t i = 0; i < len; i++) p[i] = pat(seed, off + i);
}

/* First mismatch, or -1. */
static long long mismatch(const uint8_t *p, uint64_t off, uint64_t len, uint32_t seed) {
    for (uint64_t i = 0; i < len; i++)
        if (p[i] != pat(seed, off + i)) return (long long)i;
    return -1;
}

#define POOL_SEED 7u /* the child's pool starts with this pattern */

/* ------------------------------------------------------------------ child (target) */

static int child_main(int cmd_fd, int reply_fd) {
    role = "child";
    FILE *in = fdopen(cmd_fd, "r"), *out = fdopen(reply_fd, "w");
    setvbuf(out, NULL, _IOLBF, 0);
    transfer_engine_t e = createTransferEngine("P2PHANDSHAKE", "127.0.0.1", "", 0, 1);
    if (!e) {
        fprintf(out, "ERR create %s\n", pw_last_error());
        return 1;
    }
    uint8_t *pool = aligned_alloc(4096, POOL_BYTES);
    fill(pool, 0, POOL_BYTES, POOL_SEED);
    if (registerLocalMemory(e, pool, POOL_BYTES, "cpu:0", 1) != 0) {
        fprintf(out, "ERR register %s\n", pw_last_error());
        return 1;
    }
    char name[64];
    if (getLocalIpAndPort(e, name, sizeof name) != 0) return 1;
    fprintf(out, "READY %s %" PRIu64 " %u\n", name, (uint64_t)(uintptr_t)pool, POOL_BYTES);

    char line[512];
    while (fgets(line, sizeof line, in)) {
        uint64_t off, len;
        unsigned seed;
        char want_name[128], want_msg[256];
        uint64_t src_off;
        if (sscanf(line, "VERIFY %" SCNu64 " %" SCNu64 " %u %" SCNu64, &off, &len, &seed,
                   &src_off) == 4) {
            /* pool[off..off+len] must hold the writer's pattern from its offset src_off. */
            long long m = -1;
            for (uint64_t i = 0; i < len && m < 0; i++)
                if (pool[off + i] != pat(seed, src_off + i)) m = (long long)i;
            fprintf(out, m < 0 ? "OK\n" : "BAD %lld\n", m);
        } else if (sscanf(line, "UNTOUCHED %" SCNu64 " %" SCNu64, &off, &len) == 2) {
            long long m = mismatch(pool + off, off, len, POOL_SEED);
            fprintf(out, m < 0 ? "OK\n" : "BAD %lld\n", m);
        } else if (sscanf(line, "RESTORE %" SCNu64 " %" SCNu64, &off, &len) == 2) {
            fill(pool + off, off, len, POOL_SEED);
            fprintf(out, "OK\n");
        } else if (sscanf(line, "NOTIFY %127s %255s", want_name, want_msg) == 2) {
            /* Wait up to 5 s for exactly this notification. */
            int found = 0;
            double until = now_s() + 5;
            char got[512] = "none";
            while (!found && now_s() < until) {
                int n = -1;
                notify_msg_t *m = getNotifsFromEngine(e, &n);
                for (int i = 0; i < n; i++) {
                    snprintf(got, sizeof got, "%s|%s", m[i].name, m[i].msg);
                    if (!strcmp(m[i].name, want_name) && !strcmp(m[i].msg, want_msg)) found = 1;
                }
                if (freeNotifsMsgBuf(m, n) != 0) found = -1;
                if (!found) usleep(1000);
            }
            fprintf(out, found == 1 ? "OK\n" : "BAD %s\n", got);
        } else if (!strncmp(line, "EXIT", 4)) {
            break;
        } else {
            fprintf(out, "BAD unknown command %s", line);
        }
    }
    destroyTransferEngine(e);
    /* A destroyed engine is an error, not a crash. */
    int rc = registerLocalMemory(e, pool, 4096, "*", 1) == -1 ? 0 : 1;
    free(pool);
    return rc;
}

/* ------------------------------------------------------------------ parent (initiator) */

static FILE *cmd, *reply;

static void ask(const char *what, const char *fmt, ...) {
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vfprintf(cmd, fmt, ap);
    va_end(ap);
    fflush(cmd);
    if (!fgets(line, sizeof line, reply)) {
        fail(__FILE__, __LINE__, "%s: child did not answer", what);
        return;
    }
    if (strncmp(line, "OK", 2)) {
        line[strcspn(line, "\n")] = 0;
        fail(__FILE__, __LINE__, "%s: child says %s", what, line);
    }
}

/* Polls every task of a batch until none is pending (5 s at most); returns how many
 * ended COMPLETED. */
static int wait_tasks(transfer_engine_t e, batch_id_t b, size_t n, int want) {
    int completed = 0;
    double until = now_s() + 5;
    for (size_t t = 0; t < n; t++) {
        struct transfer_status st = {.status = -1};
        for (;;) {
            int rc = getTransferStatus(e, b, t, &st);
            if (rc != 0) {
                fail(__FILE__, __LINE__, "getTransferStatus(task %zu) = %d", t, rc);
                return completed;
            }
            if (st.status != STATUS_WAITING && st.status != STATUS_PENDING) break;
            if (now_s() > until) {
                fail(__FILE__, __LINE__, "task %zu still pending after 5 s", t);
                return completed;
            }
        }
        if (st.status == STATUS_COMPLETED) completed++;
        if (want >= 0) CHECK_EQ(st.status, want, "task status");
    }
    return completed;
}

int main(void) {
    int to_child[2], to_parent[2];
    if (pipe(to_child) || pipe(to_parent)) return 2;
    pid_t pid = fork();
    if (pid < 0) return 2;
    if (pid == 0) {
        close(to_child[1]);
        close(to_parent[0]);
        _exit(child_main(to_child[0], to_parent[1]));
    }
    close(to_child[0]);
    close(to_parent[1]);
    cmd = fdopen(to_child[1], "w");
    reply = fdopen(to_parent[0], "r");
    double t0 = now_s();

    char line[256], seg_name[64];
    uint64_t pool_addr = 0, pool_len = 0;
    if (!fgets(line, sizeof line, reply) ||
        sscanf(line, "READY %63s %" SCNu64 " %" SCNu64, seg_name, &pool_addr, &pool_len) != 3) {
        fprintf(stderr, "child did not start: %s\n", line);
        kill(pid, SIGKILL);
        return 1;
    }

    /* --- use before creation / null handles: errors, no crash */
    CHECK(createTransferEngine(NULL, "127.0.0.1", "", 0, 1) == NULL, "create(NULL meta)");
    CHECK(createTransferEngine("P2PHANDSHAKE", NULL, "", 0, 1) == NULL, "create(NULL name)");
    CHECK(createTransferEngine("etcd://127.0.0.1:2379", "127.0.0.1", "", 0, 1) == NULL,
          "create(etcd)");
    CHECK(createTransferEngine("bogus://x", "127.0.0.1", "", 0, 1) == NULL, "create(bogus)");
    CHECK_EQ(registerLocalMemory(NULL, line, 16, "*", 1), -1, "register on NULL engine");
    CHECK_EQ(openSegment(NULL, seg_name), -1, "openSegment on NULL engine");
    CHECK(allocateBatchID(NULL, 4) == INVALID_BATCH, "allocateBatchID on NULL engine");
    struct transfer_status st;
    CHECK_EQ(getTransferStatus(NULL, 1, 0, &st), 1, "getTransferStatus on NULL engine");
    CHECK_EQ(freeBatchID(NULL, 1), 1, "freeBatchID on NULL engine");
    CHECK_EQ(getLocalIpAndPort(NULL, line, sizeof line), -1, "getLocalIpAndPort on NULL");
    CHECK_EQ(submitTransfer((transfer_engine_t)0x1234, 1, NULL, 0), 1, "made-up engine");
    int nn = 5;
    CHECK(getNotifsFromEngine(NULL, &nn) == NULL && nn == 0, "getNotifs on NULL engine");
    destroyTransferEngine(NULL);
    destroyTransferEngine((transfer_engine_t)0x1234);

    transfer_engine_t e = createTransferEngine("P2PHANDSHAKE", "127.0.0.1", "", 0, 1);
    if (!e) {
        fprintf(stderr, "createTransferEngine failed: %s\n", pw_last_error());
        kill(pid, SIGKILL);
        return 1;
    }
    CHECK_EQ(discoverTopology(e), 0, "discoverTopology");
    {
        /* Which backend runs ("local <name> backend <kind>"): the caller checks it. */
        char links[256];
        CHECK_EQ(showLinks(e, links, sizeof links, 0), 0, "showLinks");
        links[strcspn(links, "\n")] = 0;
        printf("te_two_process: %s\n", links);
    }
    char my_name[64], tiny[4];
    CHECK_EQ(getLocalIpAndPort(e, my_name, sizeof my_name), 0, "getLocalIpAndPort");
    CHECK(!strncmp(my_name, "127.0.0.1:", 10), "segment name %s", my_name);
    CHECK_EQ(getLocalIpAndPort(e, tiny, sizeof tiny), -1, "getLocalIpAndPort truncated");
    CHECK(tiny[3] == 0, "truncated name is terminated");
    CHECK_EQ(getLocalIpAndPort(e, NULL, 64), -1, "getLocalIpAndPort(NULL buf)");

    uint8_t *local = aligned_alloc(4096, LOCAL_BYTES);
    uint8_t *unregistered = malloc(1 << 16);
    memset(local, 0, LOCAL_BYTES);
    memset(unregistered, 0xAB, 1 << 16);
    CHECK_EQ(registerLocalMemory(e, local, LOCAL_BYTES, "*", 0), 0, "register local");
    /* Registration edge cases (Mooncake's codes). */
    CHECK_EQ(registerLocalMemory(e, local, LOCAL_BYTES, "*", 0), -7, "register twice");
    CHECK_EQ(registerLocalMemory(e, local + 4096, 4096, "*", 0), -7, "register inside");
    CHECK_EQ(registerLocalMemory(e, local + LOCAL_BYTES - 1, 2, "*", 0), -7, "overlap end");
    CHECK_EQ(registerLocalMemory(e, unregistered, 0, "*", 0), -1, "zero length");
    CHECK_EQ(registerLocalMemory(e, NULL, 4096, "*", 0), -1, "NULL addr");
    CHECK_EQ(registerLocalMemory(e, (void *)(uintptr_t)0x1000, 4096, "*", 0) < 0, 1,
             "unmapped memory refused");
    CHECK_EQ(unregisterLocalMemory(e, unregistered), -3, "unregister unknown");
    CHECK_EQ(unregisterLocalMemory(e, local + 4096), -3, "unregister not the start");
    {
        uint8_t *a = malloc(8192), *b = malloc(8192);
        buffer_entry_t list[2] = {{a, 8192}, {b, 8192}};
        void *addrs[2] = {a, b};
        CHECK_EQ(registerLocalMemoryBatch(e, list, 2, "*"), 0, "register batch");
        CHECK_EQ(unregisterLocalMemoryBatch(e, addrs, 2), 0, "unregister batch");
        list[1].addr = local; /* overlaps: whole call refused and rolled back */
        CHECK_EQ(registerLocalMemoryBatch(e, list, 2, "*"), -7, "register batch overlap");
        CHECK_EQ(unregisterLocalMemory(e, a), -3, "batch rolled back");
        CHECK_EQ(registerLocalMemoryBatch(e, NULL, 2, "*"), -1, "register batch NULL");
        free(a);
        free(b);
    }

    /* --- segments */
    CHECK_EQ(openSegment(e, NULL), -1, "openSegment(NULL)");
    CHECK_EQ(openSegment(e, "no-port"), -1, "openSegment without port");
    double t_unreach = now_s();
    CHECK_EQ(openSegment(e, "127.0.0.1:1"), -102, "openSegment unreachable");
    CHECK(now_s() - t_unreach < 6, "unreachable took %.1f s", now_s() - t_unreach);
    segment_id_t seg = openSegment(e, seg_name);
    CHECK(seg > 0, "openSegment(%s) = %d", seg_name, seg);
    CHECK_EQ(openSegment(e, seg_name), seg, "same name, same id");
    CHECK_EQ(openSegmentNoCache(e, seg_name), seg, "openSegmentNoCache");
    CHECK_EQ(openSegment(e, my_name), LOCAL_SEGMENT, "own name is LOCAL_SEGMENT");
    CHECK_EQ(closeSegment(e, 9999), -1, "closeSegment unknown");
    CHECK_EQ(syncSegmentCache(e), 0, "syncSegmentCache");
    CHECK(installTransport(e, "nosuch", NULL) == NULL, "installTransport(nosuch)");
    CHECK_EQ(warmupEfaSegment(e, seg_name), 0, "warmupEfaSegment");
    CHECK_EQ(removeLocalSegment(e, my_name), 0, "removeLocalSegment");
    {
        size_t cnt = 4;
        nic_load_stat_t stats[4];
        CHECK_EQ(getNicLoadStats(e, stats, &cnt), 0, "getNicLoadStats");
        CHECK_EQ(cnt, 0, "no NIC stats");
        CHECK_EQ(getNicLoadStats(e, NULL, &cnt), -1, "getNicLoadStats(NULL)");
        char links[1024];
        CHECK_EQ(showLinks(e, links, sizeof links, 1), 0, "showLinks json");
        CHECK(strstr(links, seg_name) != NULL, "showLinks lists the segment: %s", links);
        CHECK_EQ(showLinks(e, NULL, 0, 0), -1, "showLinks(NULL)");
        enableGracefulShutdown(e);
    }

    /* --- WRITEs of many sizes in one batch; the child verifies the bytes */
    static const uint64_t sizes[] = {1, 2, 3, 7, 8, 63, 64, 65, 511, 4095, 4096, 4097,
                                     65536, 65537, 262144, 1 << 20, (1 << 20) + 3,
                                     (3 << 20) / 2};
    const size_t nsizes = sizeof sizes / sizeof sizes[0];
    {
        uint32_t seed = 101;
        fill(local, 0, LOCAL_BYTES, seed);
        struct transfer_request req[32];
        uint64_t src = 0, dst = 12345; /* odd remote offsets on purpose */
        for (size_t i = 0; i < nsizes; i++) {
            req[i] = (struct transfer_request){OPCODE_WRITE, local + src, seg, pool_addr + dst,
                                               sizes[i]};
            src += sizes[i] + 17;
            dst += sizes[i] + 29;
        }
        batch_id_t b = allocateBatchID(e, nsizes);
        CHECK(b != INVALID_BATCH, "allocateBatchID");
        CHECK_EQ(submitTransfer(e, b, req, nsizes), 0, "submit writes");
        CHECK_EQ(wait_tasks(e, b, nsizes, STATUS_COMPLETED), nsizes, "writes completed");
        CHECK_EQ(getTransferStatus(e, b, nsizes, &st), 1, "task id out of range");
        CHECK_EQ(getTransferStatus(e, b, 0, &st), 0, "status again");
        CHECK_EQ(st.transferred_bytes, sizes[0], "transferred bytes");
        CHECK_EQ(submitTransfer(e, b, req, 1), 2, "over capacity");
        CHECK_EQ(freeBatchID(e, b), 0, "freeBatchID");
        for (size_t i = 0; i < nsizes; i++)
            ask("verify write", "VERIFY %" PRIu64 " %" PRIu64 " %u %" PRIu64 "\n",
                (uint64_t)req[i].target_offset - pool_addr, sizes[i], seed,
                (uint64_t)((uint8_t *)req[i].source - local));
        /* Around the written ranges the pool is untouched. */
        ask("untouched before", "UNTOUCHED 0 12345\n");
        ask("untouched after", "UNTOUCHED %" PRIu64 " %" PRIu64 "\n", dst,
            (uint64_t)POOL_BYTES - dst);
        ask("restore", "RESTORE 0 %u\n", POOL_BYTES);
    }

    /* --- READs of many sizes, one batch per size; verified here, the reading side */
    {
        memset(local, 0, LOCAL_BYTES);
        uint64_t src = 777;
        for (size_t i = 0; i < nsizes; i++) {
            struct transfer_request r = {OPCODE_READ, local + 64, seg, pool_addr + src, sizes[i]};
            batch_id_t b = allocateBatchID(e, 1);
            CHECK_EQ(submitTransfer(e, b, &r, 1), 0, "submit read");
            CHECK_EQ(wait_tasks(e, b, 1, STATUS_COMPLETED), 1, "read completed");
            CHECK_EQ(freeBatchID(e, b), 0, "free read batch");
            long long m = mismatch(local + 64, src, sizes[i], POOL_SEED);
            CHECK(m < 0, "read of %" PRIu64 " bytes differs at %lld", sizes[i], m);
            src += sizes[i] / 3 + 1;
        }
    }

    /* --- notifications: with a batch (after its data), and alone */
    {
        uint32_t seed = 202;
        fill(local, 0, 4096, seed);
        struct transfer_request r = {OPCODE_WRITE, local, seg, pool_addr + 100, 4096};
        notify_msg_t note = {"parent-agent", "kv-ready:42"};
        batch_id_t b = allocateBatchID(e, 4);
        CHECK_EQ(submitTransferWithNotify(e, b, &r, 1, note), 0, "submit with notify");
        CHECK_EQ(wait_tasks(e, b, 1, STATUS_COMPLETED), 1, "notified write completed");
        ask("notification", "NOTIFY parent-agent kv-ready:42\n");
        ask("notified data", "VERIFY 100 4096 %u 0\n", seed);
        CHECK_EQ(freeBatchID(e, b), 0, "free");
    }

    /* --- bad inputs on transfers: each gets its code, and the child's pool is untouched */
    {
        ask("restore", "RESTORE 0 %u\n", POOL_BYTES);
        fill(local, 0, 65536, 303);
        batch_id_t b = allocateBatchID(e, 8);
        struct transfer_request good = {OPCODE_WRITE, local, seg, pool_addr + 4096, 4096};
        struct transfer_request r;

        CHECK_EQ(submitTransfer(e, INVALID_BATCH, &good, 1), 1, "submit INVALID_BATCH");
        CHECK_EQ(submitTransfer(e, 0x12345678, &good, 1), 1, "submit unknown batch");
        CHECK_EQ(submitTransfer(e, b, NULL, 1), 1, "submit NULL entries");
        CHECK_EQ(getTransferStatus(e, INVALID_BATCH, 0, &st), 1, "status INVALID_BATCH");
        CHECK_EQ(getTransferStatus(e, 0x12345678, 0, &st), 1, "status unknown batch");
        CHECK_EQ(getTransferStatus(e, b, 0, NULL), 1, "status NULL out");
        CHECK_EQ(getTransferStatus(e, b, 0, &st), 1, "status of a task never submitted");
        CHECK_EQ(freeBatchID(e, INVALID_BATCH), 1, "free INVALID_BATCH");
        CHECK(allocateBatchID(e, 0) == INVALID_BATCH, "allocateBatchID(0)");

        r = good;
        r.opcode = 7;
        CHECK_EQ(submitTransfer(e, b, &r, 1), 1, "bad opcode");
        r = good;
        r.target_id = 4242;
        CHECK_EQ(submitTransfer(e, b, &r, 1), 1, "unknown segment");
        r = good;
        r.source = NULL;
        CHECK_EQ(submitTransfer(e, b, &r, 1), 1, "NULL source");
        r = good;
        r.source = unregistered;
        CHECK_EQ(submitTransfer(e, b, &r, 1), 3, "unregistered local source");
        r = good;
        r.source = local + LOCAL_BYTES - 100; /* straddles the end of the local buffer */
        CHECK_EQ(submitTransfer(e, b, &r, 1), 3, "local range past its buffer");
        r = good;
        r.target_offset = pool_addr + POOL_BYTES + 4096;
        CHECK_EQ(submitTransfer(e, b, &r, 1), 3, "remote outside the pool");
        r = good;
        r.target_offset = pool_addr + POOL_BYTES - 100; /* straddles the pool end */
        CHECK_EQ(submitTransfer(e, b, &r, 1), 3, "remote straddling the pool end");
        r = good;
        r.target_offset = 8; /* near address 0 */
        CHECK_EQ(submitTransfer(e, b, &r, 1), 3, "remote near 0");
        r = good;
        r.target_offset = UINT64_MAX - 10;
        CHECK_EQ(submitTransfer(e, b, &r, 1), 1, "remote overflow");
        r = good;
        r.opcode = OPCODE_READ;
        r.target_offset = pool_addr - 4096;
        CHECK_EQ(submitTransfer(e, b, &r, 1), 3, "read before the pool");
        /* One good and one bad entry: the whole submit is refused, the good half too. */
        struct transfer_request pair[2] = {good, good};
        pair[1].target_offset = pool_addr + POOL_BYTES;
        CHECK_EQ(submitTransfer(e, b, pair, 2), 3, "half-bad batch");
        pair[1] = good;
        pair[1].source = unregistered;
        CHECK_EQ(submitTransfer(e, b, pair, 2), 3, "half-bad batch (local)");
        /* Notifications across two segments are refused. */
        pair[1] = good;
        pair[1].target_id = LOCAL_SEGMENT;
        notify_msg_t note = {"n", "m"};
        CHECK_EQ(submitTransferWithNotify(e, b, pair, 2, note), 1, "notify to two segments");
        notify_msg_t null_note = {NULL, "m"};
        CHECK_EQ(submitTransferWithNotify(e, b, &good, 1, null_note), 1, "notify NULL name");
        CHECK_EQ(genNotifyInEngine(e, 4242, note), -1, "notify unknown segment");
        CHECK_EQ(genNotifyInEngine(e, 1ull << 40, note), -1, "notify huge segment id");
        CHECK_EQ(freeNotifsMsgBuf(NULL, 0), 0, "freeNotifsMsgBuf(NULL)");
        CHECK_EQ(freeNotifsMsgBuf(NULL, -1), -1, "freeNotifsMsgBuf(size -1)");
        /* None of those moved a byte, and the batch still has no task. */
        CHECK_EQ(getTransferStatus(e, b, 0, &st), 1, "refused submits add no task");
        ask("nothing written by bad inputs", "UNTOUCHED 0 %u\n", POOL_BYTES);

        /* A freed batch id is dead. */
        CHECK_EQ(submitTransfer(e, b, &good, 1), 0, "good submit");
        wait_tasks(e, b, 1, STATUS_COMPLETED);
        CHECK_EQ(freeBatchID(e, b), 0, "free");
        CHECK_EQ(freeBatchID(e, b), 1, "double free");
        CHECK_EQ(getTransferStatus(e, b, 0, &st), 1, "status of a freed batch");
        CHECK_EQ(submitTransfer(e, b, &good, 1), 1, "submit to a freed batch");
        ask("good write landed", "VERIFY 4096 4096 303 0\n");
        ask("restore", "RESTORE 0 %u\n", POOL_BYTES);
    }

    /* --- the engine's own segment (LOCAL_SEGMENT) works like any other */
    {
        uint8_t *mine = aligned_alloc(4096, 1 << 16);
        memset(mine, 0, 1 << 16);
        CHECK_EQ(registerLocalMemory(e, mine, 1 << 16, "*", 1), 0, "register exposed");
        fill(local, 0, 1000, 404);
        struct transfer_request r = {OPCODE_WRITE, local, LOCAL_SEGMENT,
                                     (uint64_t)(uintptr_t)mine + 10, 1000};
        batch_id_t b = allocateBatchID(e, 1);
        CHECK_EQ(submitTransfer(e, b, &r, 1), 0, "write to LOCAL_SEGMENT");
        CHECK_EQ(wait_tasks(e, b, 1, STATUS_COMPLETED), 1, "local write completed");
        CHECK_EQ(freeBatchID(e, b), 0, "free");
        CHECK(mismatch(mine + 10, 0, 1000, 404) < 0, "local write landed");
        CHECK_EQ(unregisterLocalMemory(e, mine), 0, "unregister exposed");
        free(mine);
    }

    /* --- a standalone notification */
    {
        notify_msg_t note = {"parent-agent", "standalone"};
        CHECK_EQ(genNotifyInEngine(e, (uint64_t)seg, note), 0, "genNotifyInEngine");
        ask("standalone notification", "NOTIFY parent-agent standalone\n");
    }

    CHECK_EQ(closeSegment(e, seg), 0, "closeSegment");
    CHECK_EQ(closeSegment(e, seg), -1, "closeSegment twice");
    CHECK_EQ(unregisterLocalMemory(e, local), 0, "unregister local");
    destroyTransferEngine(e);
    destroyTransferEngine(e); /* twice: a no-op */
    CHECK(allocateBatchID(e, 1) == INVALID_BATCH, "use after destroy");
    CHECK_EQ(openSegment(e, seg_name), -1, "openSegment after destroy");

    fprintf(cmd, "EXIT\n");
    fflush(cmd);
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child exit status %d", status);
    free(local);
    free(unregistered);
    printf("te_two_process: %s, %d failure(s), %.2f s\n", failures ? "FAILED" : "ok", failures,
           now_s() - t0);
    return failures ? 1 : 0;
}
