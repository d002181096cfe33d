/* Shared pools through the C ABI: a target agent registers a pool, an shm
 * initiator in the same process maps it (a second mapping of the memory
 * file, counted in /proc/self/maps) and writes and reads through it;
 * deregistration unmaps it before it returns; bad calls with their error
 * codes. Built and run by sys/tests/c_programs.rs. */
#define _POSIX_C_SOURCE 200809L
#include "check.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { N = 1 << 20 };

/* Mappings of kvxfer pools in this process. */
static int pool_mappings(void) {
  FILE *f = fopen("/proc/self/maps", "r");
  EXPECT(f != NULL);
  char line[512];
  int n = 0;
  while (fgets(line, sizeof line, f))
    if (strstr(line, "memfd:kvxfer-pool")) n++;
  fclose(f);
  return n;
}

int main(void) {
  kvxfer_agent *t = NULL, *i = NULL;
  CHECK(kvxfer_agent_new("c-pool-target", "shm", NULL, &t));
  CHECK(kvxfer_agent_new("c-pool-init", "shm", NULL, &i));
  kvxfer_pool *pool = NULL;
  EXPECT_ERR(kvxfer_pool_new(0, &pool), KVXFER_ERR_INVALID_DESCRIPTOR, "empty");
  EXPECT_ERR(kvxfer_pool_from_fd(-1, &pool), KVXFER_ERR_INVALID_ARGUMENT, "descriptor");
  CHECK(kvxfer_pool_new(N, &pool));
  uint8_t *mem = NULL;
  size_t len = 0;
  CHECK(kvxfer_pool_memory(pool, &mem, &len));
  EXPECT(mem != NULL && len == N);
  EXPECT(pool_mappings() == 1);
  kvxfer_mem_desc region;
  CHECK(kvxfer_agent_register_shared_pool(t, pool, 0, &region));
  EXPECT(region.addr == (uint64_t)(uintptr_t)mem && region.len == N);

  char conn[256], name[64];
  CHECK(kvxfer_agent_connection_info(t, conn, sizeof conn, NULL));
  CHECK(kvxfer_agent_load_remote_by_connection(i, conn, name, sizeof name, NULL));
  uint8_t *src = malloc(N), *back = calloc(1, N);
  EXPECT(src != NULL && back != NULL);
  for (size_t k = 0; k < N; k++) src[k] = (uint8_t)(k * 29u + 3u);
  kvxfer_mem_desc s = {(uint64_t)(uintptr_t)src, N, 0}, b = {(uint64_t)(uintptr_t)back, N, 0};
  CHECK(kvxfer_agent_register_memory(i, KVXFER_MEM_DRAM, &s, 1));
  CHECK(kvxfer_agent_register_memory(i, KVXFER_MEM_DRAM, &b, 1));
  kvxfer_request req = {
      .op = KVXFER_OP_WRITE,
      .local_type = KVXFER_MEM_DRAM, .local = &s, .local_count = 1,
      .remote_type = KVXFER_MEM_DRAM, .remote = &region, .remote_count = 1,
      .remote_agent = name,
  };
  kvxfer_status *st = NULL;
  CHECK(kvxfer_agent_submit(i, &req, &st));
  CHECK(kvxfer_status_wait(st, 10000));
  CHECK(kvxfer_status_free(st));
  EXPECT(memcmp(mem, src, N) == 0);
  EXPECT(pool_mappings() == 2); /* the initiator's mapping beside the pool's */
  req.op = KVXFER_OP_READ;
  req.local = &b;
  CHECK(kvxfer_agent_submit(i, &req, &st));
  CHECK(kvxfer_status_wait(st, 10000));
  CHECK(kvxfer_status_free(st));
  EXPECT(memcmp(back, src, N) == 0);

  /* The handle may go first: the registration holds the memory. */
  CHECK(kvxfer_pool_free(pool));
  EXPECT(pool_mappings() == 2);
  CHECK(kvxfer_agent_deregister_memory(t, KVXFER_MEM_DRAM, &region, 1));
  EXPECT(pool_mappings() == 0); /* revoked, then released */

  CHECK(kvxfer_agent_deregister_memory(i, KVXFER_MEM_DRAM, &s, 1));
  CHECK(kvxfer_agent_deregister_memory(i, KVXFER_MEM_DRAM, &b, 1));
  free(src);
  free(back);
  CHECK(kvxfer_agent_free(i));
  CHECK(kvxfer_agent_free(t));
  printf("%d checks passed\n", checks);
  return 0;
}
