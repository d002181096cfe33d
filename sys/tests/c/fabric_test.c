/* Two agents on the libfabric transport through the C ABI (provider from
 * KVXFER_FABRIC_PROVIDER, `tcp;ofi_rxm` as sys/tests/c_programs.rs runs
 * it): a WRITE whose sync message arrives after its data, a READ back,
 * the transport named `fabric`. The C library loads libfabric when the
 * first fabric agent opens. */
#define _POSIX_C_SOURCE 200809L
#include "check.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { N = 1 << 20 };

int main(void) {
  kvxfer_agent *target = NULL, *init = NULL;
  CHECK(kvxfer_agent_new("c-fab-target", "fabric", NULL, &target));
  CHECK(kvxfer_agent_new("c-fab-init", "fabric", NULL, &init));
  uint8_t *dst = calloc(N, 1), *src = malloc(N), *back = calloc(N, 1);
  for (size_t i = 0; i < N; i++) src[i] = (uint8_t)(i * 131u + 5);
  kvxfer_mem_desc dreg = {(uint64_t)(uintptr_t)dst, N, 0};
  kvxfer_mem_desc sreg = {(uint64_t)(uintptr_t)src, N, 0};
  kvxfer_mem_desc breg = {(uint64_t)(uintptr_t)back, N, 0};
  CHECK(kvxfer_agent_register_memory(target, KVXFER_MEM_DRAM, &dreg, 1));
  CHECK(kvxfer_agent_register_memory(init, KVXFER_MEM_DRAM, &sreg, 1));
  CHECK(kvxfer_agent_register_memory(init, KVXFER_MEM_DRAM, &breg, 1));
  char conn[128], name[64];
  CHECK(kvxfer_agent_connection_info(target, conn, sizeof conn, NULL));
  CHECK(kvxfer_agent_load_remote_by_connection(init, conn, name, sizeof name, NULL));

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
  req.sync_message = (const uint8_t *)"landed";
  req.sync_message_len = 6;
  kvxfer_status *st = NULL;
  CHECK(kvxfer_agent_submit(init, &req, &st));
  kvxfer_messages *msgs = NULL;
  CHECK(kvxfer_agent_wait_messages(target, 30000, &msgs));
  size_t count = 0;
  CHECK(kvxfer_messages_count(msgs, &count));
  EXPECT(count == 1);
  const char *from;
  const uint8_t *data;
  size_t len;
  CHECK(kvxfer_messages_get(msgs, 0, &from, &data, &len));
  EXPECT(strcmp(from, "c-fab-init") == 0 && len == 6 && memcmp(data, "landed", 6) == 0);
  /* Checked the moment the message is seen: every byte is already there. */
  EXPECT(memcmp(dst, src, N) == 0);
  CHECK(kvxfer_messages_free(msgs));
  CHECK(kvxfer_status_wait(st, 30000));
  const char *transport = NULL;
  CHECK(kvxfer_status_transport(st, &transport));
  EXPECT(transport != NULL && strcmp(transport, "fabric") == 0);
  CHECK(kvxfer_status_free(st));

  req.op = KVXFER_OP_READ;
  req.local = &breg;
  req.sync_message = NULL;
  req.sync_message_len = 0;
  CHECK(kvxfer_agent_submit(init, &req, &st));
  CHECK(kvxfer_status_wait(st, 30000));
  CHECK(kvxfer_status_free(st));
  EXPECT(memcmp(back, src, N) == 0);

  CHECK(kvxfer_agent_free(init));
  CHECK(kvxfer_agent_free(target));
  free(src);
  free(dst);
  free(back);
  printf("fabric_test: %d checks passed\n", checks);
  return 0;
}
