/* GPU memory through the C ABI: device memory (allocated with the CUDA
 * driver, found with dlopen) registered as KVXFER_MEM_VRAM and written and
 * read over TCP from host memory; host memory presented as VRAM refused
 * with KVXFER_ERR_GPU. Built and run by sys/tests/c_programs.rs against
 * the stand-in driver of tests/gpu/fakecuda.c (preloaded), or a real one. */
#define _POSIX_C_SOURCE 200809L
#include "check.h"

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { N = 1 << 20 };

typedef int (*cu_init_fn)(unsigned);
typedef int (*cu_retain_fn)(void **, int);
typedef int (*cu_set_fn)(void *);
typedef int (*cu_alloc_fn)(unsigned long long *, size_t);
typedef int (*cu_free_fn)(unsigned long long);
typedef int (*cu_stream_fn)(void **, unsigned);
typedef int (*cu_copy_fn)(unsigned long long, unsigned long long, size_t, void *);
typedef int (*cu_sync_fn)(void *);

static void *sym(void *lib, const char *name) {
  void *p = dlsym(lib, name);
  if (p == NULL) {
    fprintf(stderr, "no %s in the CUDA driver\n", name);
    exit(1);
  }
  return p;
}

int main(void) {
  void *cu = dlopen("libcuda.so", RTLD_NOW | RTLD_GLOBAL);
  if (cu == NULL) {
    fprintf(stderr, "no CUDA driver: %s\n", dlerror());
    return 1;
  }
  cu_copy_fn copy = (cu_copy_fn)sym(cu, "cuMemcpyAsync");
  cu_sync_fn sync = (cu_sync_fn)sym(cu, "cuStreamSynchronize");
  void *ctx = NULL, *stream = NULL;
  unsigned long long dev = 0;
  EXPECT(((cu_init_fn)sym(cu, "cuInit"))(0) == 0);
  EXPECT(((cu_retain_fn)sym(cu, "cuDevicePrimaryCtxRetain"))(&ctx, 0) == 0);
  EXPECT(((cu_set_fn)sym(cu, "cuCtxSetCurrent"))(ctx) == 0);
  EXPECT(((cu_stream_fn)sym(cu, "cuStreamCreate"))(&stream, 1) == 0);
  EXPECT(((cu_alloc_fn)sym(cu, "cuMemAlloc_v2"))(&dev, N) == 0);

  kvxfer_agent *a = NULL, *b = NULL;
  CHECK(kvxfer_agent_new("c-gpu-a", "tcp", NULL, &a));
  CHECK(kvxfer_agent_new("c-gpu-b", "tcp", NULL, &b));
  uint8_t *src = malloc(N), *back = calloc(1, N);
  EXPECT(src != NULL && back != NULL);
  for (size_t i = 0; i < N; i++) src[i] = (uint8_t)(i * 29u + 5u);
  kvxfer_mem_desc s = {(uint64_t)(uintptr_t)src, N, 0}, g = {dev, N, 0};
  CHECK(kvxfer_agent_register_memory(a, KVXFER_MEM_DRAM, &s, 1));
  /* Host memory is not GPU memory: refused, typed. */
  EXPECT_ERR(kvxfer_agent_register_memory(b, KVXFER_MEM_VRAM, &s, 1), KVXFER_ERR_GPU, "not GPU device memory");
  /* Nor is a GPU range on another device than the one it names. */
  kvxfer_mem_desc wrong = {dev, N, 1};
  EXPECT_ERR(kvxfer_agent_register_memory(b, KVXFER_MEM_VRAM, &wrong, 1), KVXFER_ERR_GPU, "names device 1");
  CHECK(kvxfer_agent_register_memory(b, KVXFER_MEM_VRAM, &g, 1));
  char conn[256], name[256];
  CHECK(kvxfer_agent_connection_info(b, conn, sizeof conn, NULL));
  CHECK(kvxfer_agent_load_remote_by_connection(a, conn, name, sizeof name, NULL));
  kvxfer_request req = {
      .op = KVXFER_OP_WRITE,
      .local_type = KVXFER_MEM_DRAM, .local = &s, .local_count = 1,
      .remote_type = KVXFER_MEM_VRAM, .remote = &g, .remote_count = 1,
      .remote_agent = name,
  };
  kvxfer_status *st = NULL;
  CHECK(kvxfer_agent_submit(a, &req, &st));
  CHECK(kvxfer_status_wait(st, 30000));
  CHECK(kvxfer_status_free(st));
  EXPECT(copy((unsigned long long)(uintptr_t)back, dev, N, stream) == 0 && sync(stream) == 0);
  EXPECT(memcmp(back, src, N) == 0);
  CHECK(kvxfer_agent_deregister_memory(b, KVXFER_MEM_VRAM, &g, 1));
  CHECK(kvxfer_agent_deregister_memory(a, KVXFER_MEM_DRAM, &s, 1));
  CHECK(kvxfer_agent_free(a));
  CHECK(kvxfer_agent_free(b));
  EXPECT(((cu_free_fn)sym(cu, "cuMemFree_v2"))(dev) == 0);
  free(src);
  free(back);
  printf("gpu_test: %d checks passed\n", checks);
  return 0;
}
