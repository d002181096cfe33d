/* Peers by name through the C ABI: two agents published in an etcd the
 * harness started (its endpoint in KVXFER_TEST_ETCD), one loaded by name
 * from the other and written to; a live name refused; a closed peer's
 * requests fail with KVXFER_ERR_PEER_GONE. Built and run by
 * sys/tests/c_programs.rs. */
#define _POSIX_C_SOURCE 200809L
#include "check.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { N = 1 << 16 };

static void sleep_ms(long ms) {
  struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&t, NULL);
}

int main(void) {
  const char *endpoint = getenv("KVXFER_TEST_ETCD");
  EXPECT(endpoint != NULL);
  char prefix[64];
  snprintf(prefix, sizeof prefix, "/c-test-%ld", (long)time(NULL));
  kvxfer_options o;
  memset(&o, 0, sizeof o);
  o.struct_size = sizeof o;
  o.etcd_endpoints = endpoint;
  o.etcd_prefix = prefix;
  o.etcd_lease_ttl_s = 3;
  kvxfer_agent *target = NULL, *init = NULL, *twin = NULL;
  CHECK(kvxfer_agent_new("c-ctx", "tcp", &o, &target));
  CHECK(kvxfer_agent_new("c-gen", "tcp", &o, &init));
  EXPECT_ERR(kvxfer_agent_new("c-ctx", "tcp", &o, &twin), KVXFER_ERR_NAME_TAKEN, "taken");
  EXPECT(twin == NULL);
  uint8_t *src = malloc(N), *dst = calloc(1, N);
  EXPECT(src != NULL && dst != NULL);
  memset(src, 0x6b, N);
  kvxfer_mem_desc s = {(uint64_t)(uintptr_t)src, N, 0}, d = {(uint64_t)(uintptr_t)dst, N, 0};
  CHECK(kvxfer_agent_register_memory(target, KVXFER_MEM_DRAM, &d, 1));
  CHECK(kvxfer_agent_register_memory(init, KVXFER_MEM_DRAM, &s, 1));
  EXPECT_ERR(kvxfer_agent_load_remote_by_name(init, "nobody"), KVXFER_ERR_UNKNOWN_AGENT, "nobody");
  CHECK(kvxfer_agent_load_remote_by_name(init, "c-ctx"));
  kvxfer_request req = {
      .op = KVXFER_OP_WRITE,
      .local_type = KVXFER_MEM_DRAM, .local = &s, .local_count = 1,
      .remote_type = KVXFER_MEM_DRAM, .remote = &d, .remote_count = 1,
      .remote_agent = "c-ctx",
  };
  kvxfer_status *st = NULL;
  CHECK(kvxfer_agent_submit(init, &req, &st));
  CHECK(kvxfer_status_wait(st, 30000));
  CHECK(kvxfer_status_free(st));
  EXPECT(memcmp(src, dst, N) == 0);
  /* The target closes: the initiator finds it gone (within 30 s). */
  CHECK(kvxfer_agent_deregister_memory(target, KVXFER_MEM_DRAM, &d, 1));
  CHECK(kvxfer_agent_free(target));
  kvxfer_result r = KVXFER_OK;
  for (int i = 0; i < 300; i++) {
    st = NULL;
    r = kvxfer_agent_submit(init, &req, &st);
    if (r == KVXFER_OK) {
      r = kvxfer_status_wait(st, 30000);
      kvxfer_status_free(st);
    }
    if (r == KVXFER_ERR_PEER_GONE) break;
    sleep_ms(100);
  }
  EXPECT(r == KVXFER_ERR_PEER_GONE);
  checks++;
  CHECK(kvxfer_agent_free(init));
  free(src);
  free(dst);
  printf("%d checks passed\n", checks);
  return 0;
}
