/* Two agents over TCP through the C ABI: WRITE, READ, sync messages after
 * the data, descriptor exchange, and bad calls with their error codes.
 * Built and run by sys/tests/c_programs.rs. */
#define _POSIX_C_SOURCE 200809L
#include "check.h"

#include <inttypes.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum { N = 1 << 20 };

static void fill(uint8_t *p, size_t n, uint8_t seed) {
  for (size_t i = 0; i < n; i++) p[i] = (uint8_t)(i * 131u + seed);
}

/* A completion callback: records the outcome (it may run on a library
 * thread). */
static atomic_int callback_outcome = -1;
static void on_done(void *user_data, kvxfer_result outcome) {
  atomic_fetch_add((atomic_int *)user_data, 1);
  atomic_store(&callback_outcome, (int)outcome);
}

int main(void) {
  kvxfer_agent *target = NULL, *init = NULL;
  CHECK(kvxfer_agent_new("c-target", "tcp", NULL, &target));
  kvxfer_options opts;
  memset(&opts, 0, sizeof opts);
  opts.struct_size = sizeof opts;
  opts.io_timeout_ms = 5000;
  opts.streams_per_peer = 2;
  /* Out-of-range settings are refused with a typed error. */
  kvxfer_agent *bad = NULL;
  opts.rdma_ack_timeout = 40;
  EXPECT(kvxfer_agent_new("c-bad", "tcp", &opts, &bad) == KVXFER_ERR_INVALID_ARGUMENT && bad == NULL);
  opts.rdma_ack_timeout = 20;
  opts.rdma_qps_per_peer = 17;
  EXPECT(kvxfer_agent_new("c-bad", "tcp", &opts, &bad) == KVXFER_ERR_INVALID_ARGUMENT && bad == NULL);
  opts.rdma_qps_per_peer = 2;
  opts.rdma_no_shared_receive_queue = 1;
  /* Security: a public listener needs a cluster secret or `insecure`; an
   * unreadable secret file is refused; agents with different secrets (or
   * only one with a secret) cannot talk. */
  if (getenv("KVXFER_SECRET") == NULL && getenv("KVXFER_SECRET_FILE") == NULL) {
    kvxfer_options pub;
    memset(&pub, 0, sizeof pub);
    pub.struct_size = sizeof pub;
    pub.listen = "0.0.0.0:0";
    EXPECT_ERR(kvxfer_agent_new("c-pub", "tcp", &pub, &bad), KVXFER_ERR_INVALID_ARGUMENT, "credential");
    pub.insecure = 1;
    CHECK(kvxfer_agent_new("c-pub", "tcp", &pub, &bad));
    CHECK(kvxfer_agent_free(bad));
    bad = NULL;
    char path[] = "/tmp/kvxfer-c-secret-XXXXXX";
    int fd = mkstemp(path);
    EXPECT(fd >= 0);
    EXPECT(write(fd, "c-9e4b17d2f05a63c8e1b97a40\n", 27) == 27);
    close(fd);
    kvxfer_options keyed;
    memset(&keyed, 0, sizeof keyed);
    keyed.struct_size = sizeof keyed;
    keyed.secret_file = path;
    kvxfer_agent *locked = NULL;
    CHECK(kvxfer_agent_new("c-locked", "tcp", &keyed, &locked));
    char lconn[128], lname[64];
    CHECK(kvxfer_agent_connection_info(locked, lconn, sizeof lconn, NULL));
    kvxfer_agent *open_agent = NULL;
    CHECK(kvxfer_agent_new("c-open", "tcp", NULL, &open_agent));
    EXPECT_ERR(kvxfer_agent_load_remote_by_connection(open_agent, lconn, lname, sizeof lname, NULL),
               KVXFER_ERR_AUTH, "credential");
    kvxfer_agent *friend_agent = NULL;
    CHECK(kvxfer_agent_new("c-friend", "tcp", &keyed, &friend_agent));
    CHECK(kvxfer_agent_load_remote_by_connection(friend_agent, lconn, lname, sizeof lname, NULL));
    EXPECT(strcmp(lname, "c-locked") == 0);
    keyed.secret_file = "/nonexistent/kvxfer-secret";
    EXPECT_ERR(kvxfer_agent_new("c-bad", "tcp", &keyed, &bad), KVXFER_ERR_INVALID_ARGUMENT, "secret");
    CHECK(kvxfer_agent_free(friend_agent));
    CHECK(kvxfer_agent_free(open_agent));
    CHECK(kvxfer_agent_free(locked));
    unlink(path);
  }
  CHECK(kvxfer_agent_new("c-init", "tcp", &opts, &init));

  uint8_t *dst = calloc(N, 1), *src = malloc(N);
  fill(src, N, 7);
  kvxfer_mem_desc dreg = {(uint64_t)(uintptr_t)dst, N, 0};
  kvxfer_mem_desc sreg = {(uint64_t)(uintptr_t)src, N, 0};
  CHECK(kvxfer_agent_register_memory(target, KVXFER_MEM_DRAM, &dreg, 1));
  CHECK(kvxfer_agent_register_memory(init, KVXFER_MEM_DRAM, &sreg, 1));

  /* Load the target by connection info. */
  char conn[128], name[64];
  CHECK(kvxfer_agent_connection_info(target, conn, sizeof conn, NULL));
  size_t name_len = 0;
  /* A name buffer too small: told the length, and nothing is loaded. */
  char tiny[2];
  EXPECT_ERR(kvxfer_agent_load_remote_by_connection(init, conn, tiny, sizeof tiny, &name_len),
             KVXFER_ERR_BUFFER_TOO_SMALL, "nothing was loaded");
  EXPECT(name_len == 8);
  EXPECT_ERR(kvxfer_agent_invalidate_remote(init, "c-target"), KVXFER_ERR_UNKNOWN_AGENT, "c-target");
  CHECK(kvxfer_agent_load_remote_by_connection(init, conn, name, sizeof name, &name_len));
  EXPECT(strcmp(name, "c-target") == 0 && name_len == 8);

  /* WRITE with a sync message: the message arrives after the data. */
  kvxfer_request req;
  memset(&req, 0, sizeof req);
  req.op = KVXFER_OP_WRITE;
  req.local_type = KVXFER_MEM_DRAM;
  req.local = &sreg;
  req.local_count = 1;
  req.remote_type = KVXFER_MEM_DRAM;
  req.remote = &dreg;
  req.remote_count = 1;
  req.remote_agent = name;
  req.sync_message = (const uint8_t *)"write done";
  req.sync_message_len = 10;
  kvxfer_status *st = NULL;
  CHECK(kvxfer_agent_submit(init, &req, &st));
  kvxfer_messages *msgs = NULL;
  CHECK(kvxfer_agent_wait_messages(target, 10000, &msgs));
  size_t count = 0;
  CHECK(kvxfer_messages_count(msgs, &count));
  EXPECT(count == 1);
  const char *from;
  const uint8_t *data;
  size_t len;
  CHECK(kvxfer_messages_get(msgs, 0, &from, &data, &len));
  EXPECT(strcmp(from, "c-init") == 0 && len == 10 && memcmp(data, "write done", 10) == 0);
  /* Checked the moment the message is seen: every byte is already there. */
  EXPECT(memcmp(dst, src, N) == 0);
  EXPECT_ERR(kvxfer_messages_get(msgs, 1, &from, &data, &len), KVXFER_ERR_INVALID_ARGUMENT, "out of range");
  CHECK(kvxfer_messages_free(msgs));
  CHECK(kvxfer_status_wait(st, 10000));
  bool done = false;
  CHECK(kvxfer_status_is_completed(st, &done));
  EXPECT(done);
  uint64_t id = 0;
  CHECK(kvxfer_status_id(st, &id));
  EXPECT(id > 0);
  /* The status says what carried it. */
  const char *transport = NULL;
  CHECK(kvxfer_status_transport(st, &transport));
  EXPECT(transport != NULL && strcmp(transport, "tcp") == 0);
  /* A required transport is never silently replaced. */
  {
    kvxfer_options strict_opts;
    memset(&strict_opts, 0, sizeof strict_opts);
    strict_opts.struct_size = sizeof strict_opts;
    strict_opts.require_dram_transport = "rdma";
    kvxfer_agent *strict = NULL;
    CHECK(kvxfer_agent_new("c-strict", "tcp", &strict_opts, &strict));
    CHECK(kvxfer_agent_register_memory(strict, KVXFER_MEM_DRAM, &sreg, 1));
    char sname[64];
    CHECK(kvxfer_agent_load_remote_by_connection(strict, conn, sname, sizeof sname, NULL));
    kvxfer_status *never = NULL;
    EXPECT_ERR(kvxfer_agent_submit(strict, &req, &never), KVXFER_ERR_TRANSPORT_REQUIRED, "must use rdma");
    EXPECT(never == NULL);
    CHECK(kvxfer_agent_free(strict));
    strict_opts.require_dram_transport = "pigeon";
    EXPECT_ERR(kvxfer_agent_new("c-strict", "tcp", &strict_opts, &strict), KVXFER_ERR_INVALID_ARGUMENT, "pigeon");
  }
  /* End-to-end integrity: a checked WRITE lands whole and completes; an
   * unknown flag is refused. */
  {
    memset(dst, 0, N);
    kvxfer_request checked = req;
    checked.sync_message = NULL;
    checked.sync_message_len = 0;
    kvxfer_status *cst = NULL;
    CHECK(kvxfer_agent_submit_flags(init, &checked, KVXFER_SUBMIT_INTEGRITY, &cst));
    CHECK(kvxfer_status_wait(cst, 10000));
    CHECK(kvxfer_status_free(cst));
    EXPECT(memcmp(dst, src, N) == 0);
    kvxfer_status *none = NULL;
    EXPECT_ERR(kvxfer_agent_submit_flags(init, &checked, 4, &none), KVXFER_ERR_INVALID_ARGUMENT, "flags");
    EXPECT(none == NULL);
  }
  /* Aborting a finished transfer: told it was no longer running. */
  bool running = true;
  CHECK(kvxfer_status_abort(st, &running));
  EXPECT(!running);
  CHECK(kvxfer_status_wait(st, 0));
  /* A finished transfer is settled: nothing of it can land any more. */
  bool settled = false;
  CHECK(kvxfer_status_is_settled(st, &settled));
  EXPECT(settled);
  CHECK(kvxfer_status_wait_settled(st, 0));
  EXPECT_ERR(kvxfer_status_wait_settled(st, -1), KVXFER_ERR_INVALID_ARGUMENT, "timeout_ms");
  EXPECT_ERR(kvxfer_status_is_settled(st, NULL), KVXFER_ERR_NULL_ARGUMENT, "out");
  CHECK(kvxfer_status_free(st));

  /* Abort: 64 MiB (the region 64 times over) goes out, and a second such
   * WRITE with a sync message, queued behind it, is aborted at once. It
   * ends KVXFER_ERR_ABORTED with its message withheld — or, were this
   * thread held up for the whole first transfer, KVXFER_OK with the
   * message delivered (the Rust suite checks abort deterministically). */
  {
    enum { REPEAT = 64 };
    kvxfer_mem_desc many_src[REPEAT], many_dst[REPEAT];
    for (int i = 0; i < REPEAT; i++) {
      many_src[i] = sreg;
      many_dst[i] = dreg;
    }
    kvxfer_request big = req;
    big.local = many_src;
    big.local_count = REPEAT;
    big.remote = many_dst;
    big.remote_count = REPEAT;
    big.sync_message = NULL;
    big.sync_message_len = 0;
    kvxfer_status *first = NULL, *second = NULL;
    CHECK(kvxfer_agent_submit(init, &big, &first));
    big.sync_message = (const uint8_t *)"aborted";
    big.sync_message_len = 7;
    CHECK(kvxfer_agent_submit(init, &big, &second));
    running = false;
    CHECK(kvxfer_status_abort(second, &running));
    EXPECT(running);
    CHECK(kvxfer_status_wait(first, 60000));
    kvxfer_result r = kvxfer_status_wait(second, 60000);
    EXPECT(r == KVXFER_ERR_ABORTED || r == KVXFER_OK);
    CHECK(kvxfer_agent_wait_messages(target, r == KVXFER_OK ? 10000 : 200, &msgs));
    CHECK(kvxfer_messages_count(msgs, &count));
    EXPECT(count == (r == KVXFER_OK ? 1u : 0u));
    CHECK(kvxfer_messages_free(msgs));
    EXPECT(strcmp(kvxfer_result_name(KVXFER_ERR_ABORTED), "KVXFER_ERR_ABORTED") == 0);
    printf("abort of a queued 64 MiB WRITE: %s\n", kvxfer_result_name(r));
    CHECK(kvxfer_status_free(first));
    CHECK(kvxfer_status_free(second));
    EXPECT_ERR(kvxfer_status_abort(NULL, NULL), KVXFER_ERR_NULL_ARGUMENT, "status");
  }

  /* READ back into the initiator after the target changes its memory. */
  fill(dst, N, 99);
  memset(src, 0, N);
  req.op = KVXFER_OP_READ;
  req.sync_message = NULL;
  req.sync_message_len = 0;
  CHECK(kvxfer_agent_submit(init, &req, &st));
  CHECK(kvxfer_status_wait(st, -1));
  EXPECT(memcmp(dst, src, N) == 0);
  CHECK(kvxfer_status_free(st));

  /* Completion as events: a queue watching two transfers, its descriptor
   * readable once one is ready (poll, as an event loop would), and a
   * callback on each, run once. */
  {
    kvxfer_cq *cq = NULL;
    CHECK(kvxfer_cq_new(&cq));
    int fd = -1;
    CHECK(kvxfer_cq_fd(cq, &fd));
    EXPECT(fd >= 0);
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    EXPECT(poll(&pfd, 1, 0) == 0);
    atomic_int calls = 0;
    kvxfer_status *a = NULL, *b = NULL;
    req.op = KVXFER_OP_WRITE;
    CHECK(kvxfer_agent_submit(init, &req, &a));
    CHECK(kvxfer_agent_submit(init, &req, &b));
    CHECK(kvxfer_cq_watch(cq, a, 7));
    CHECK(kvxfer_cq_watch(cq, b, 8));
    CHECK(kvxfer_status_on_complete(a, on_done, &calls));
    CHECK(kvxfer_status_on_complete(b, on_done, &calls));
    EXPECT_ERR(kvxfer_status_on_complete(a, NULL, NULL), KVXFER_ERR_NULL_ARGUMENT, "callback");
    kvxfer_completion got[2];
    size_t have = 0, n = 0;
    uint64_t tokens = 0;
    while (have < 2) {
      EXPECT(poll(&pfd, 1, 60000) == 1);
      CHECK(kvxfer_cq_wait(cq, 0, got, 1, &n)); /* one at a time */
      EXPECT(n == 1 && got[0].outcome == KVXFER_OK);
      tokens += got[0].token;
      have += n;
    }
    EXPECT(tokens == 15);
    CHECK(kvxfer_cq_wait(cq, 0, got, 2, &n));
    EXPECT(n == 0 && poll(&pfd, 1, 0) == 0);
    /* No room asked for: the count is still written. */
    n = 99;
    CHECK(kvxfer_cq_wait(cq, 0, NULL, 0, &n));
    EXPECT(n == 0);
    /* Both callbacks ran once (the queue reported after its own). */
    CHECK(kvxfer_status_wait(a, 10000));
    CHECK(kvxfer_status_wait(b, 10000));
    for (int i = 0; i < 6000 && atomic_load(&calls) < 2; i++) {
      struct timespec ms10 = {0, 10000000};
      nanosleep(&ms10, NULL);
    }
    EXPECT(atomic_load(&calls) == 2 && atomic_load(&callback_outcome) == KVXFER_OK);
    /* Added after the outcome: runs at once, on the callback thread. */
    CHECK(kvxfer_status_on_complete(a, on_done, &calls));
    for (int i = 0; i < 6000 && atomic_load(&calls) < 3; i++) {
      struct timespec ms10 = {0, 10000000};
      nanosleep(&ms10, NULL);
    }
    EXPECT(atomic_load(&calls) == 3);
    CHECK(kvxfer_status_free(a));
    CHECK(kvxfer_status_free(b));
    CHECK(kvxfer_cq_free(cq));
    req.op = KVXFER_OP_READ;
  }

  /* A prepared WRITE, resolved once and submitted three times, each time
   * with new source bytes; its local region stays held until freed. */
  req.op = KVXFER_OP_WRITE;
  kvxfer_prepared *prep = NULL;
  CHECK(kvxfer_agent_prepare(init, &req, &prep));
  for (uint8_t round = 1; round <= 3; round++) {
    fill(src, N, (uint8_t)(40 + round));
    CHECK(kvxfer_agent_submit_prepared(init, prep, &st));
    CHECK(kvxfer_status_wait(st, 10000));
    CHECK(kvxfer_status_free(st));
    EXPECT(memcmp(dst, src, N) == 0);
  }
  EXPECT_ERR(kvxfer_agent_deregister_memory(init, KVXFER_MEM_DRAM, &sreg, 1), KVXFER_ERR_REGION_BUSY, "in flight");
  /* Prepared by one agent, submitted by another: refused. */
  EXPECT_ERR(kvxfer_agent_submit_prepared(target, prep, &st), KVXFER_ERR_INVALID_ARGUMENT, "another agent");
  CHECK(kvxfer_prepared_free(prep));
  EXPECT_ERR(kvxfer_agent_submit_prepared(init, prep, &st), KVXFER_ERR_INVALID_HANDLE, "prepared");
  EXPECT_ERR(kvxfer_prepared_free(prep), KVXFER_ERR_INVALID_HANDLE, "prepared");
  CHECK(kvxfer_prepared_free(NULL));

  /* A standalone notification, and its status. */
  CHECK(kvxfer_agent_notify(init, name, (const uint8_t *)"ping", 4, &st));
  CHECK(kvxfer_status_wait(st, 10000));
  CHECK(kvxfer_status_free(st));
  CHECK(kvxfer_agent_notify(init, name, (const uint8_t *)"", 0, NULL));
  CHECK(kvxfer_agent_wait_messages(target, 10000, &msgs));
  CHECK(kvxfer_messages_count(msgs, &count));
  EXPECT(count >= 1);
  CHECK(kvxfer_messages_free(msgs));
  /* A wake with nobody waiting is harmless, and does not cut a later wait
   * short: that one still times out with no message. First every message
   * is taken: "y" is delivered once its status completes, and the empty
   * one sent before it, ordered on the same connection, before it. */
  CHECK(kvxfer_agent_notify(init, name, (const uint8_t *)"y", 1, &st));
  CHECK(kvxfer_status_wait(st, 10000));
  CHECK(kvxfer_status_free(st));
  CHECK(kvxfer_agent_take_messages(target, &msgs));
  CHECK(kvxfer_messages_free(msgs));
  CHECK(kvxfer_agent_wake_waiters(target));
  CHECK(kvxfer_agent_wait_messages(target, 20, &msgs));
  CHECK(kvxfer_messages_count(msgs, &count));
  EXPECT(count == 0);
  CHECK(kvxfer_messages_free(msgs));
  EXPECT_ERR(kvxfer_agent_wake_waiters(NULL), KVXFER_ERR_NULL_ARGUMENT, "agent");

  /* The descriptor as bytes: size query, then load from bytes. */
  size_t desc_len = 0;
  EXPECT_ERR(kvxfer_agent_local_desc(target, NULL, 0, &desc_len), KVXFER_ERR_BUFFER_TOO_SMALL, "needs");
  EXPECT(desc_len > 6);
  uint8_t *desc = malloc(desc_len);
  CHECK(kvxfer_agent_local_desc(target, desc, desc_len, &desc_len));
  kvxfer_agent *other = NULL;
  CHECK(kvxfer_agent_new("c-other", "tcp", NULL, &other));
  CHECK(kvxfer_agent_load_remote(other, desc, desc_len, NULL, 0, &name_len));
  EXPECT(name_len == 8);
  desc[0] ^= 0xff;
  EXPECT_ERR(kvxfer_agent_load_remote(other, desc, desc_len, NULL, 0, NULL), KVXFER_ERR_INVALID_AGENT_DESC, "magic");
  free(desc);

  /* check_remote_descs. */
  bool ok = false;
  CHECK(kvxfer_agent_check_remote_descs(init, name, KVXFER_MEM_DRAM, &dreg, 1, &ok));
  EXPECT(ok);
  kvxfer_mem_desc past = {dreg.addr + 1, N, 0};
  CHECK(kvxfer_agent_check_remote_descs(init, name, KVXFER_MEM_DRAM, &past, 1, &ok));
  EXPECT(!ok);

  /* Bad calls: documented codes and useful messages. */
  EXPECT_ERR(kvxfer_agent_register_memory(NULL, KVXFER_MEM_DRAM, &sreg, 1), KVXFER_ERR_NULL_ARGUMENT, "agent");
  EXPECT_ERR(kvxfer_agent_submit((kvxfer_agent *)(uintptr_t)0x1234, &req, &st), KVXFER_ERR_INVALID_HANDLE, "handle");
  EXPECT_ERR(kvxfer_agent_new("x", "carrier-pigeon", NULL, &other), KVXFER_ERR_INVALID_ARGUMENT, "carrier-pigeon");
  EXPECT_ERR(kvxfer_agent_register_memory(init, 99, &sreg, 1), KVXFER_ERR_INVALID_ARGUMENT, "memory type");
  EXPECT_ERR(kvxfer_agent_register_memory(init, KVXFER_MEM_DRAM, &sreg, 1), KVXFER_ERR_OVERLAP, "overlaps");
  req.remote_agent = "nobody";
  EXPECT_ERR(kvxfer_agent_submit(init, &req, &st), KVXFER_ERR_UNKNOWN_AGENT, "nobody");
  req.remote_agent = name;
  kvxfer_mem_desc too_long = {sreg.addr, (uint64_t)N + 1, 0};
  kvxfer_mem_desc remote_long = {dreg.addr, (uint64_t)N + 1, 0};
  req.local = &too_long;
  req.remote = &remote_long;
  EXPECT_ERR(kvxfer_agent_submit(init, &req, &st), KVXFER_ERR_NOT_REGISTERED, "not inside a registered region");
  req.local = &sreg;
  req.remote = &past;
  EXPECT_ERR(kvxfer_agent_submit(init, &req, &st), KVXFER_ERR_REMOTE_RANGE, "exported no");
  req.remote = &dreg;
  req.op = 7;
  EXPECT_ERR(kvxfer_agent_submit(init, &req, &st), KVXFER_ERR_INVALID_ARGUMENT, "operation");
  req.op = KVXFER_OP_WRITE;
  EXPECT_ERR(kvxfer_agent_invalidate_remote(init, "nobody"), KVXFER_ERR_UNKNOWN_AGENT, "nobody");
  char small[4];
  EXPECT_ERR(kvxfer_agent_connection_info(init, small, sizeof small, NULL), KVXFER_ERR_BUFFER_TOO_SMALL, "needs");

  /* A freed handle is refused, not dereferenced. */
  CHECK(kvxfer_agent_notify(init, name, (const uint8_t *)"x", 1, &st));
  CHECK(kvxfer_status_wait(st, 10000));
  CHECK(kvxfer_status_free(st));
  EXPECT_ERR(kvxfer_status_wait(st, 0), KVXFER_ERR_INVALID_HANDLE, "freed");
  EXPECT_ERR(kvxfer_status_free(st), KVXFER_ERR_INVALID_HANDLE, "freed");
  /* A handle of another kind is refused too. */
  EXPECT_ERR(kvxfer_status_wait((kvxfer_status *)init, 0), KVXFER_ERR_INVALID_HANDLE, "Status");
  CHECK(kvxfer_agent_free(NULL));

  /* Invalidate, then the remote is unknown. */
  CHECK(kvxfer_agent_invalidate_remote(init, name));
  EXPECT_ERR(kvxfer_agent_submit(init, &req, &st), KVXFER_ERR_UNKNOWN_AGENT, "unknown remote agent");

  CHECK(kvxfer_agent_deregister_memory(init, KVXFER_MEM_DRAM, &sreg, 1));
  EXPECT_ERR(kvxfer_agent_deregister_memory(init, KVXFER_MEM_DRAM, &sreg, 1), KVXFER_ERR_NOT_REGISTERED, "not registered");
  CHECK(kvxfer_agent_free(other));
  CHECK(kvxfer_agent_free(init));
  CHECK(kvxfer_agent_free(target));
  free(src);
  free(dst);
  printf("c agent test (kvxfer %s): %d checks passed\n", kvxfer_version(), checks);
  return 0;
}
