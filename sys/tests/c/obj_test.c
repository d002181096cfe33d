/* Objects through the C ABI: an object of an S3 server (the bucket the
 * Rust harness made, KVXFER_S3_BUCKET, at KVXFER_S3_ENDPOINT; credentials
 * from the AWS environment) written from host memory as a multipart upload,
 * read back, and the typed errors. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#define N ((size_t)9 << 20) /* more than one 8 MiB part: a multipart upload */

int main(void) {
  const char *endpoint = getenv("KVXFER_S3_ENDPOINT"), *bucket = getenv("KVXFER_S3_BUCKET");
  EXPECT(endpoint != NULL && bucket != NULL);
  kvxfer_agent *a = NULL;
  CHECK(kvxfer_agent_new("c-obj", "tcp", NULL, &a));
  uint32_t h = 0, missing = 0;
  EXPECT_ERR(kvxfer_agent_open_object(a, endpoint, bucket, "", &h), KVXFER_ERR_INVALID_ARGUMENT, "object key");
  CHECK(kvxfer_agent_open_object(a, endpoint, bucket, "c/object", &h));
  CHECK(kvxfer_agent_open_object(a, endpoint, bucket, "c/missing", &missing));
  kvxfer_mem_desc region = {0, N, h}, gone = {0, N, missing};
  CHECK(kvxfer_agent_register_memory(a, KVXFER_MEM_OBJ, &region, 1));
  CHECK(kvxfer_agent_register_memory(a, KVXFER_MEM_OBJ, &gone, 1));
  uint8_t *src = malloc(N), *back = calloc(1, N);
  EXPECT(src != NULL && back != NULL);
  for (size_t i = 0; i < N; i++) src[i] = (uint8_t)(i * 131u + 7u);
  kvxfer_mem_desc s = {(uint64_t)(uintptr_t)src, N, 0}, b = {(uint64_t)(uintptr_t)back, N, 0};
  CHECK(kvxfer_agent_register_memory(a, KVXFER_MEM_DRAM, &s, 1));
  CHECK(kvxfer_agent_register_memory(a, KVXFER_MEM_DRAM, &b, 1));
  kvxfer_request req = {
      .op = KVXFER_OP_WRITE,
      .local_type = KVXFER_MEM_DRAM, .local = &s, .local_count = 1,
      .remote_type = KVXFER_MEM_OBJ, .remote = &region, .remote_count = 1,
      .remote_agent = "c-obj",
  };
  kvxfer_status *st = NULL;
  CHECK(kvxfer_agent_submit(a, &req, &st));
  CHECK(kvxfer_status_wait(st, 60000));
  const char *transport = NULL;
  CHECK(kvxfer_status_transport(st, &transport));
  EXPECT(strcmp(transport, "storage") == 0);
  CHECK(kvxfer_status_free(st));
  req.op = KVXFER_OP_READ;
  req.local = &b;
  CHECK(kvxfer_agent_submit(a, &req, &st));
  CHECK(kvxfer_status_wait(st, 60000));
  CHECK(kvxfer_status_free(st));
  EXPECT(memcmp(back, src, N) == 0);
  /* A key that does not exist: a typed failure of the transfer. */
  req.remote = &gone;
  CHECK(kvxfer_agent_submit(a, &req, &st));
  EXPECT_ERR(kvxfer_status_wait(st, 60000), KVXFER_ERR_OBJECT_STORE, "no such key");
  CHECK(kvxfer_status_free(st));
  /* A WRITE not at offset 0: refused before anything is sent. */
  kvxfer_mem_desc inside = {4096, 100, h}, small = {(uint64_t)(uintptr_t)src, 100, 0};
  req.op = KVXFER_OP_WRITE;
  req.local = &small;
  req.remote = &inside;
  EXPECT_ERR(kvxfer_agent_submit(a, &req, &st), KVXFER_ERR_INVALID_DESCRIPTOR, "whole");
  EXPECT_ERR(kvxfer_agent_close_storage(a, h), KVXFER_ERR_INVALID_ARGUMENT, "registered regions");
  CHECK(kvxfer_agent_deregister_memory(a, KVXFER_MEM_OBJ, &region, 1));
  CHECK(kvxfer_agent_deregister_memory(a, KVXFER_MEM_OBJ, &gone, 1));
  CHECK(kvxfer_agent_close_storage(a, h));
  CHECK(kvxfer_agent_close_storage(a, missing));
  CHECK(kvxfer_agent_deregister_memory(a, KVXFER_MEM_DRAM, &s, 1));
  CHECK(kvxfer_agent_deregister_memory(a, KVXFER_MEM_DRAM, &b, 1));
  CHECK(kvxfer_agent_free(a));
  free(src);
  free(back);
  printf("obj_test: %d checks passed\n", checks);
  return 0;
}
