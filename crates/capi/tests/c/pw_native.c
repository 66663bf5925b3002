/*
 * pagewire.h end to end in one process: two engines (backend from PAGEWIRE_TRANSPORT),
 * registration, connect/accept, WRITE with a notification, READ back, a layout-planned
 * page transfer, and the error paths (bad handles, null pointers, ranges outside
 * registered or exposed memory, a too-small output buffer). Exit status 0 = all passed.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pagewire.h"

static int failures;

#define CHECK(cond, ...)                                                        \
    do {                                                                        \
        if (!(cond)) {                                                          \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);                \
            fprintf(stderr, __VA_ARGS__);                                       \
            fprintf(stderr, " (last error: %s)\n",                              \
                    pw_last_error() ? pw_last_error() : "none");                \
            failures++;                                                         \
        }                                                                       \
    } while (0)
#define CHECK_ST(call, want)                                                    \
    do {                                                                        \
        pw_status s_ = (call);                                                  \
        CHECK(s_ == (want), "%s = %d (%s), want %s", #call, (int)s_,            \
              pw_status_str(s_), #want);                                        \
    } while (0)

static uint8_t pat(uint32_t seed, uint64_t i) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ (uint64_t)seed * 0xD1B54A32D192ED03ull;
    x ^= x >> 29;
    return (uint8_t)(x ^ (x >> 17));
}

#define BUF (1u << 20)

int main(void) {
    pw_engine *a = NULL, *b = NULL;
    CHECK_ST(pw_engine_new(NULL, "127.0.0.1:0", &a), PW_OK);
    CHECK_ST(pw_engine_new(NULL, "127.0.0.1:0", &b), PW_OK);
    if (!a || !b) return 1;

    /* Bad handles and null pointers. */
    CHECK_ST(pw_engine_free(NULL), PW_ERR_BAD_HANDLE);
    CHECK(pw_last_error() != NULL, "a failure leaves a message");
    char addr[64];
    CHECK_ST(pw_engine_local_addr((pw_engine *)0x1234, addr, sizeof addr), PW_ERR_BAD_HANDLE);
    CHECK_ST(pw_engine_new("carrier-pigeon", NULL, &a), PW_ERR_CONFIG);
    CHECK_ST(pw_engine_new(NULL, "not-an-address", &a), PW_ERR_INVALID_ARGUMENT);
    CHECK_ST(pw_engine_new(NULL, "127.0.0.1:0", NULL), PW_ERR_INVALID_ARGUMENT);
    CHECK_ST(pw_engine_local_addr(b, addr, 3), PW_ERR_BUFFER_TOO_SMALL);
    CHECK_ST(pw_engine_local_addr(b, addr, sizeof addr), PW_OK);
    CHECK(pw_last_error() == NULL, "success clears the message");
    char backend[16];
    CHECK_ST(pw_engine_backend(a, backend, sizeof backend), PW_OK);
    CHECK(strcmp(pw_status_str((pw_status)999), "unknown status") == 0, "pw_status_str(999)");
    CHECK(strlen(pw_version()) > 0, "version");

    uint8_t *src = aligned_alloc(4096, BUF), *dst = aligned_alloc(4096, BUF);
    for (uint32_t i = 0; i < BUF; i++) src[i] = pat(1, i);
    memset(dst, 0, BUF);
    pw_region *rs = NULL, *rd = NULL, *tmp = NULL;
    CHECK_ST(pw_region_register(a, src, BUF, PW_ACCESS_LOCAL_WRITE, &rs), PW_OK);
    CHECK_ST(pw_region_register(b, dst, BUF, PW_ACCESS_ALL, &rd), PW_OK);
    CHECK_ST(pw_region_register(b, dst + 4096, BUF, PW_ACCESS_ALL, &tmp), PW_ERR_REGION_OVERLAP);
    CHECK_ST(pw_region_register(a, src, BUF, 8, &tmp), PW_ERR_INVALID_ARGUMENT);
    CHECK_ST(pw_region_register(a, NULL, BUF, 1, &tmp), PW_ERR_INVALID_RANGE);
    CHECK_ST(pw_region_register(a, src, 0, 1, &tmp), PW_ERR_INVALID_RANGE);
    CHECK_ST(pw_region_register((pw_engine *)rs, src, 4096, 1, &tmp), PW_ERR_BAD_HANDLE);

    pw_peer *pa = NULL, *pb = NULL, *none = NULL;
    CHECK_ST(pw_peer_connect(a, "127.0.0.1:1", &none), PW_ERR_CONNECT);
    CHECK_ST(pw_peer_connect(a, "no-port", &none), PW_ERR_INVALID_ARGUMENT);
    CHECK_ST(pw_peer_connect(a, NULL, &none), PW_ERR_INVALID_ARGUMENT);
    CHECK_ST(pw_peer_connect(a, addr, &pa), PW_OK);
    CHECK_ST(pw_peer_accept(b, 5000, &pb), PW_OK);
    CHECK_ST(pw_peer_accept(b, 10, &none), PW_ERR_TIMEOUT);

    /* WRITE with a notification; the receiver checks tag, sender and bytes. */
    pw_batch *bt = NULL;
    CHECK_ST(pw_batch_new(&bt), PW_OK);
    CHECK_ST(pw_batch_status(bt), PW_ERR_INVALID_ARGUMENT); /* not submitted */
    CHECK_ST(pw_batch_submit(bt, pa), PW_ERR_EMPTY_BATCH);
    CHECK_ST(pw_batch_add(bt, 9, 0, 0, 1), PW_ERR_INVALID_ARGUMENT);
    CHECK_ST(pw_batch_add(bt, PW_OP_WRITE, (uint64_t)(uintptr_t)src + 10,
                          (uint64_t)(uintptr_t)dst + 20, 100000),
             PW_OK);
    CHECK_ST(pw_batch_add(bt, PW_OP_WRITE, (uint64_t)(uintptr_t)src, (uint64_t)(uintptr_t)dst + 500000,
                          1),
             PW_OK);
    CHECK_ST(pw_batch_set_notify(bt, 77), PW_OK);
    CHECK_ST(pw_batch_set_timeout(bt, 5000), PW_OK);
    CHECK_ST(pw_batch_submit(bt, pa), PW_OK);
    CHECK_ST(pw_batch_wait(bt, 5000), PW_OK);
    CHECK_ST(pw_batch_status(bt), PW_OK);
    uint64_t done = 0, from = 0, want_from = 1;
    uint32_t tag = 0;
    CHECK_ST(pw_batch_bytes_done(bt, &done), PW_OK);
    CHECK(done == 100001, "bytes done %llu", (unsigned long long)done);
    CHECK_ST(pw_engine_poll_notification(b, 5000, &from, &tag), PW_OK);
    CHECK_ST(pw_peer_id(pb, &want_from), PW_OK);
    CHECK(tag == 77 && from == want_from, "notification tag %u from %llu", tag,
          (unsigned long long)from);
    CHECK_ST(pw_engine_poll_notification(b, 10, &from, &tag), PW_ERR_TIMEOUT);
    for (uint32_t i = 0; i < 100000; i++)
        if (dst[20 + i] != pat(1, 10 + i)) {
            CHECK(0, "dst[%u] differs", 20 + i);
            break;
        }
    CHECK(dst[500000] == pat(1, 0) && dst[19] == 0 && dst[20 + 100000] == 0, "edges");

    /* READ back what landed, into another part of src. */
    CHECK_ST(pw_batch_reset(bt), PW_OK);
    CHECK_ST(pw_batch_add(bt, PW_OP_READ, (uint64_t)(uintptr_t)src + 600000,
                          (uint64_t)(uintptr_t)dst + 20, 100000),
             PW_OK);
    CHECK_ST(pw_batch_submit(bt, pa), PW_OK);
    CHECK_ST(pw_batch_wait(bt, 5000), PW_OK);
    CHECK(memcmp(src + 600000, src + 10, 100000) == 0, "read back");

    /* Refused batches move nothing. */
    memset(dst, 0, BUF);
    CHECK_ST(pw_batch_reset(bt), PW_OK);
    CHECK_ST(pw_batch_add(bt, PW_OP_WRITE, (uint64_t)(uintptr_t)src, (uint64_t)(uintptr_t)dst, 64),
             PW_OK);
    CHECK_ST(pw_batch_add(bt, PW_OP_WRITE, (uint64_t)(uintptr_t)src,
                          (uint64_t)(uintptr_t)dst + BUF - 10, 64),
             PW_OK);
    CHECK_ST(pw_batch_submit(bt, pa), PW_ERR_REMOTE_OUT_OF_BOUNDS);
    CHECK_ST(pw_batch_reset(bt), PW_OK);
    uint8_t stray[64];
    CHECK_ST(pw_batch_add(bt, PW_OP_WRITE, (uint64_t)(uintptr_t)stray, (uint64_t)(uintptr_t)dst, 64),
             PW_OK);
    CHECK_ST(pw_batch_submit(bt, pa), PW_ERR_UNREGISTERED);
    CHECK_ST(pw_batch_submit(bt, (pw_peer *)bt), PW_ERR_BAD_HANDLE);
    int untouched = 1;
    for (uint32_t i = 0; i < BUF; i++) untouched &= dst[i] == 0;
    CHECK(untouched, "refused batches wrote nothing");

    /* Layout: SGLang's get_page_buffer_meta for an MHA page_first pool. */
    pw_pool_desc pool = {
        .kind = PW_POOL_MHA, .layout = PW_LAYOUT_PAGE_FIRST, .layers = 2, .page_size = 4,
        .heads = 2, .head_dim = 3, .dtype_bytes = 2, .capacity = 32, .base = 0x1000};
    uint64_t idx[8] = {8, 9, 10, 11, 12, 13, 14, 15}, ptrs[8], lens[8];
    size_t n = 0;
    CHECK_ST(pw_page_meta(&pool, idx, 8, ptrs, lens, 8, &n), PW_OK);
    CHECK(n == 4 && ptrs[0] == 0x10C0 && ptrs[1] == 0x13C0 && ptrs[2] == 0x1120 &&
              ptrs[3] == 0x1420 && lens[0] == 96 && lens[3] == 96,
          "page_meta: n=%zu ptrs %llx %llx", n, (unsigned long long)ptrs[0],
          (unsigned long long)ptrs[1]);
    CHECK_ST(pw_page_meta(&pool, idx, 8, ptrs, lens, 2, &n), PW_ERR_BUFFER_TOO_SMALL);
    CHECK(n == 4, "needed entries %zu", n);
    uint64_t misaligned[4] = {9, 10, 11, 12};
    CHECK_ST(pw_page_meta(&pool, misaligned, 4, ptrs, lens, 8, &n), PW_ERR_LAYOUT);
    CHECK(pw_last_error() && strlen(pw_last_error()) > 0, "layout error text");
    pw_pool_desc bad = pool;
    bad.layout = 9;
    CHECK_ST(pw_page_meta(&bad, idx, 8, ptrs, lens, 8, &n), PW_ERR_INVALID_ARGUMENT);
    CHECK_ST(pw_page_meta(NULL, idx, 8, ptrs, lens, 8, &n), PW_ERR_INVALID_ARGUMENT);

    /* A planned page transfer between two real pools (pages 0,2 of src -> 1,3 of dst). */
    pw_pool_desc ps = pool, pd = pool;
    ps.base = (uint64_t)(uintptr_t)src;
    pd.base = (uint64_t)(uintptr_t)dst;
    ps.capacity = pd.capacity = 4096; /* 1024 pages of 96 B per K and V: 192 KiB */
    uint64_t sp[2] = {0, 2}, dp[2] = {1, 3}, s[16], d[16], l[16];
    CHECK_ST(pw_plan(&ps, &pd, sp, dp, 2, s, d, l, 16, &n), PW_OK);
    CHECK_ST(pw_batch_reset(bt), PW_OK);
    CHECK_ST(pw_batch_add_plan(bt, PW_OP_WRITE, s, d, l, n), PW_OK);
    CHECK_ST(pw_batch_submit(bt, pa), PW_OK);
    CHECK_ST(pw_batch_wait(bt, 5000), PW_OK);
    uint64_t mp[8], ml[8], mq[8], mr[8];
    size_t n1 = 0, n2 = 0;
    CHECK_ST(pw_page_meta_for_pages(&ps, sp, 2, mp, ml, 8, &n1), PW_OK);
    CHECK_ST(pw_page_meta_for_pages(&pd, dp, 2, mq, mr, 8, &n2), PW_OK);
    CHECK(n1 == n2 && n1 == 4, "meta entries %zu %zu", n1, n2);
    for (size_t i = 0; i < n1 && i < 8; i++)
        CHECK(ml[i] == mr[i] && memcmp((void *)(uintptr_t)mp[i], (void *)(uintptr_t)mq[i], ml[i]) == 0,
              "page segment %zu", i);

    /* Teardown; handles die with their objects. */
    CHECK_ST(pw_batch_free(bt), PW_OK);
    CHECK_ST(pw_batch_free(bt), PW_ERR_BAD_HANDLE);
    CHECK_ST(pw_region_deregister(rs, 1000), PW_OK);
    CHECK_ST(pw_region_deregister(rs, 1000), PW_ERR_BAD_HANDLE);
    CHECK_ST(pw_engine_free(a), PW_OK);
    CHECK_ST(pw_peer_refresh(pa), PW_ERR_SHUTDOWN);
    CHECK_ST(pw_peer_close(pa), PW_OK);
    CHECK_ST(pw_peer_close(pb), PW_OK);
    CHECK_ST(pw_region_deregister(rd, 1000), PW_OK);
    CHECK_ST(pw_engine_free(b), PW_OK);
    CHECK_ST(pw_engine_free(b), PW_ERR_BAD_HANDLE);
    free(src);
    free(dst);
    printf("pw_native: %s, %d failure(s)\n", failures ? "FAILED" : "ok", failures);
    return failures ? 1 : 0;
}
