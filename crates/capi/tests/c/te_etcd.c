/*
 * Mooncake's C API with an etcd metadata server: segments opened by the names engines
 * registered in etcd, across two processes.
 *
 * TE_ETCD_URL names the etcd ("etcd://127.0.0.1:P"). The parent forks a child (target)
 * that creates an engine named "te-child", registers a pool for remote access and then
 * answers commands over a pipe (verify a range, fill the pool, exit). The parent opens
 * "te-child" by name, writes and reads with checked bytes, and checks the codes: an
 * unknown name is -1, a destroyed engine's name is gone, an unreachable etcd makes
 * createTransferEngine return NULL within its deadline. Exit status 0: every check passed.
 */
#define _GNU_SOURCE
#include <inttypes.h>
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

#define POOL_BYTES (1u << 20)
#define XFER (64u << 10)

static int failures;
static const char *role = "parent";

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void fail(int line, const char *fmt, ...) {
    va_list ap;
    fprintf(stderr, "[%s] FAIL te_etcd.c:%d: ", role, line);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, " (last error: %s)\n", pw_last_error() ? pw_last_error() : "none");
    failures++;
}

#define CHECK(cond, ...) \
    do {                 \
        if (!(cond)) fail(__LINE__, __VA_ARGS__); \
    } while (0)
#define CHECK_EQ(got, want, what)                                              \
    do {                                                                       \
        long long g_ = (long long)(got), w_ = (long long)(want);               \
        if (g_ != w_) fail(__LINE__, "%s: got %lld, want %lld", what, g_, w_); \
    } while (0)

static uint8_t pat(uint32_t seed, uint64_t i) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ (uint64_t)seed * 0xD1B54A32D192ED03ull;
    x ^= x >> 29;
    return (uint8_t)(x ^ (x >> 17));
}

static int child_main(const char *url, int cmd_fd, int reply_fd) {
    role = "child";
    FILE *in = fdopen(cmd_fd, "r"), *out = fdopen(reply_fd, "w");
    setvbuf(out, NULL, _IOLBF, 0);
    transfer_engine_t e = createTransferEngine(url, "te-child", "", 0, 1);
    if (!e) {
        fprintf(out, "ERR create %s\n", pw_last_error());
        return 1;
    }
    uint8_t *pool = aligned_alloc(4096, POOL_BYTES);
    memset(pool, 0, POOL_BYTES);
    if (registerLocalMemory(e, pool, POOL_BYTES, "cpu:0", 1) != 0) {
        fprintf(out, "ERR register %s\n", pw_last_error());
        return 1;
    }
    fprintf(out, "READY %" PRIu64 "\n", (uint64_t)(uintptr_t)pool);
    char line[256];
    while (fgets(line, sizeof line, in)) {
        uint64_t off, len;
        unsigned seed;
        if (sscanf(line, "VERIFY %" SCNu64 " %" SCNu64 " %u", &off, &len, &seed) == 3) {
            long long m = -1;
            for (uint64_t i = 0; i < len && m < 0; i++)
                if (pool[off + i] != pat(seed, i)) m = (long long)i;
            fprintf(out, m < 0 ? "OK\n" : "BAD %lld\n", m);
        } else if (sscanf(line, "FILL %u", &seed) == 1) {
            for (uint64_t i = 0; i < POOL_BYTES; i++) pool[i] = pat(seed, i);
            fprintf(out, "OK\n");
        } else if (!strncmp(line, "EXIT", 4)) {
            destroyTransferEngine(e);
            fprintf(out, "OK\n");
            return 0;
        }
    }
    return 1;
}

/* Runs one request and waits for its end; the final status. */
static int one(transfer_engine_t e, int opcode, void *local, segment_id_t seg, uint64_t remote,
               uint64_t len) {
    batch_id_t b = allocateBatchID(e, 1);
    transfer_request_t r = {opcode, local, seg, remote, len};
    if (submitTransfer(e, b, &r, 1) != 0) return -1;
    transfer_status_t st = {0, 0};
    double until = now_s() + 20;
    while (getTransferStatus(e, b, 0, &st) == 0 &&
           (st.status == STATUS_WAITING || st.status == STATUS_PENDING) && now_s() < until)
        usleep(100);
    freeBatchID(e, b);
    return st.status;
}

static void ask(FILE *to, FILE *from, const char *cmd, const char *what) {
    char line[128] = "";
    fprintf(to, "%s\n", cmd);
    fflush(to);
    if (!fgets(line, sizeof line, from)) line[0] = 0;
    CHECK(!strncmp(line, "OK", 2), "%s: child says %s", what, line);
}

int main(void) {
    const char *url = getenv("TE_ETCD_URL");
    if (!url) {
        fprintf(stderr, "TE_ETCD_URL is not set\n");
        return 2;
    }
    /* Nobody listens on port 1: NULL, quickly. */
    double t = now_s();
    CHECK(createTransferEngine("etcd://127.0.0.1:1", "te-x", "", 0, 1) == NULL, "unreachable etcd");
    CHECK(now_s() - t < 6, "unreachable etcd took %.1f s", now_s() - t);
    CHECK(createTransferEngine("etcd://", "te-x", "", 0, 1) == NULL, "etcd:// without host");

    int cmd[2], reply[2];
    if (pipe(cmd) || pipe(reply)) return 2;
    pid_t pid = fork();
    if (pid == 0) {
        close(cmd[1]);
        close(reply[0]);
        _exit(child_main(url, cmd[0], reply[1]));
    }
    close(cmd[0]);
    close(reply[1]);
    FILE *to = fdopen(cmd[1], "w"), *from = fdopen(reply[0], "r");
    char line[256];
    uint64_t pool = 0;
    if (!fgets(line, sizeof line, from) || sscanf(line, "READY %" SCNu64, &pool) != 1) {
        fprintf(stderr, "child did not start: %s\n", line);
        return 1;
    }

    transfer_engine_t e = createTransferEngine(url, "te-parent", "", 0, 1);
    CHECK(e != NULL, "createTransferEngine(etcd)");
    if (!e) return 1;
    char addr[64];
    CHECK_EQ(getLocalIpAndPort(e, addr, sizeof addr), 0, "getLocalIpAndPort");
    CHECK(!strncmp(addr, "127.0.0.1:", 10), "handshake address %s", addr);
    CHECK(createTransferEngine(url, "te-child", "", 0, 1) == NULL, "a live name is taken");

    CHECK_EQ(openSegment(e, "te-nobody"), -1, "unknown name");
    CHECK_EQ(openSegment(e, "te-parent"), LOCAL_SEGMENT, "own name");
    segment_id_t seg = openSegment(e, "te-child");
    CHECK(seg > 0, "openSegment(te-child) = %d", seg);
    CHECK_EQ(openSegment(e, "te-child"), seg, "same name, same id");

    uint8_t *src = aligned_alloc(4096, XFER), *dst = aligned_alloc(4096, XFER);
    for (uint64_t i = 0; i < XFER; i++) src[i] = pat(11, i);
    memset(dst, 0, XFER);
    CHECK_EQ(registerLocalMemory(e, src, XFER, "cpu:0", 0), 0, "register src");
    CHECK_EQ(registerLocalMemory(e, dst, XFER, "cpu:0", 0), 0, "register dst");

    CHECK_EQ(one(e, OPCODE_WRITE, src, seg, pool + 4096, XFER), STATUS_COMPLETED, "write");
    char verify[96];
    snprintf(verify, sizeof verify, "VERIFY 4096 %u 11", XFER);
    ask(to, from, verify, "written bytes on the child");
    ask(to, from, "FILL 13", "fill");
    CHECK_EQ(one(e, OPCODE_READ, dst, seg, pool, XFER), STATUS_COMPLETED, "read");
    long long bad = -1;
    for (uint64_t i = 0; i < XFER && bad < 0; i++)
        if (dst[i] != pat(13, i)) bad = (long long)i;
    CHECK(bad < 0, "read bytes differ at %lld", bad);

    /* The child destroys its engine: its name leaves etcd. */
    ask(to, from, "EXIT", "exit");
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child status %d", status);
    CHECK_EQ(closeSegment(e, seg), 0, "closeSegment");
    CHECK_EQ(openSegment(e, "te-child"), -1, "a destroyed engine's name");

    /* removeLocalSegment withdraws this engine's own name. */
    transfer_engine_t other = createTransferEngine(url, "te-other", "", 0, 1);
    CHECK(other != NULL, "second engine");
    CHECK(openSegment(other, "te-parent") > 0, "te-parent is open to others");
    CHECK_EQ(removeLocalSegment(e, "te-parent"), 0, "removeLocalSegment");
    CHECK_EQ(openSegmentNoCache(other, "te-nobody"), -1, "unknown name, no cache");
    destroyTransferEngine(other);
    other = createTransferEngine(url, "te-other2", "", 0, 1);
    CHECK(other != NULL, "third engine");
    CHECK_EQ(openSegment(other, "te-parent"), -1, "a withdrawn name");
    destroyTransferEngine(other);
    destroyTransferEngine(e);
    free(src);
    free(dst);
    if (failures) {
        fprintf(stderr, "te_etcd: %d failures\n", failures);
        return 1;
    }
    printf("te_etcd: ok\n");
    return 0;
}
