/* Storage through the C ABI: a file opened as storage, a buffer written
 * into it (durably) and read back by requests to the agent itself; bad
 * calls with their error codes. Built and run by sys/tests/c_programs.rs. */
#define _POSIX_C_SOURCE 200809L
#include "check.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { N = 1 << 16, FILE_SIZE = 1 << 20, OFF = 8192 };

int main(void) {
  kvxfer_agent *a = NULL;
  CHECK(kvxfer_agent_new("c-storage", "tcp", NULL, &a));
  char path[] = "/tmp/kvxfer-c-storage-XXXXXX";
  int fd = mkstemp(path);
  EXPECT(fd >= 0);
  close(fd);
  uint32_t h = 0;
  EXPECT_ERR(kvxfer_agent_open_storage(a, path, 7, FILE_SIZE, 0, &h), KVXFER_ERR_INVALID_ARGUMENT, "storage kind");
  CHECK(kvxfer_agent_open_storage(a, path, KVXFER_STORAGE_FILE, FILE_SIZE, 0, &h));
  kvxfer_mem_desc region = {0, FILE_SIZE, h};
  CHECK(kvxfer_agent_register_memory(a, KVXFER_MEM_FILE, &region, 1));
  uint8_t *src = malloc(N), *back = calloc(1, N);
  EXPECT(src != NULL && back != NULL);
  for (size_t i = 0; i < N; i++) src[i] = (uint8_t)(i * 37u + 11u);
  kvxfer_mem_desc s = {(uint64_t)(uintptr_t)src, N, 0}, b = {(uint64_t)(uintptr_t)back, N, 0};
  CHECK(kvxfer_agent_register_memory(a, KVXFER_MEM_DRAM, &s, 1));
  CHECK(kvxfer_agent_register_memory(a, KVXFER_MEM_DRAM, &b, 1));
  kvxfer_mem_desc at = {OFF, N, h};
  kvxfer_request req = {
      .op = KVXFER_OP_WRITE,
      .local_type = KVXFER_MEM_DRAM, .local = &s, .local_count = 1,
      .remote_type = KVXFER_MEM_FILE, .remote = &at, .remote_count = 1,
      .remote_agent = "c-storage",
  };
  kvxfer_status *st = NULL;
  EXPECT_ERR(kvxfer_agent_submit_flags(a, &req, 0x80, &st), KVXFER_ERR_INVALID_ARGUMENT, "flags");
  CHECK(kvxfer_agent_submit_flags(a, &req, KVXFER_SUBMIT_DURABLE, &st));
  CHECK(kvxfer_status_wait(st, 10000));
  const char *transport = NULL;
  CHECK(kvxfer_status_transport(st, &transport));
  EXPECT(strcmp(transport, "storage") == 0);
  CHECK(kvxfer_status_free(st));
  /* The bytes are in the file at the offset. */
  FILE *f = fopen(path, "rb");
  EXPECT(f != NULL);
  uint8_t *disk = malloc(N);
  EXPECT(disk != NULL && fseek(f, OFF, SEEK_SET) == 0 && fread(disk, 1, N, f) == N);
  fclose(f);
  EXPECT(memcmp(disk, src, N) == 0);
  /* And come back. */
  req.op = KVXFER_OP_READ;
  req.local = &b;
  CHECK(kvxfer_agent_submit(a, &req, &st));
  CHECK(kvxfer_status_wait(st, 10000));
  CHECK(kvxfer_status_free(st));
  EXPECT(memcmp(back, src, N) == 0);
  /* A range past the registered one: refused, nothing moves. */
  kvxfer_mem_desc past = {FILE_SIZE - 100, N, h};
  req.op = KVXFER_OP_WRITE;
  req.local = &s;
  req.remote = &past;
  EXPECT_ERR(kvxfer_agent_submit(a, &req, &st), KVXFER_ERR_NOT_REGISTERED, "not inside a registered region");
  /* Storage with registered ranges stays open. */
  EXPECT_ERR(kvxfer_agent_close_storage(a, h), KVXFER_ERR_INVALID_ARGUMENT, "registered regions");
  CHECK(kvxfer_agent_deregister_memory(a, KVXFER_MEM_FILE, &region, 1));
  CHECK(kvxfer_agent_close_storage(a, h));
  CHECK(kvxfer_agent_deregister_memory(a, KVXFER_MEM_DRAM, &s, 1));
  CHECK(kvxfer_agent_deregister_memory(a, KVXFER_MEM_DRAM, &b, 1));
  CHECK(kvxfer_agent_free(a));
  free(src);
  free(back);
  free(disk);
  unlink(path);
  printf("storage_test: %d checks passed\n", checks);
  return 0;
}
