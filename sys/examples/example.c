/* kvxfer from C: a target and an initiator in one process over TCP.
 * The initiator WRITEs 64 KiB into the target's registered buffer with a
 * sync message; the target takes the message, which arrives after the data.
 *
 *   gcc -std=c11 -I sys/include example.c -L target/release -lkvxfer \
 *       -Wl,-rpath,target/release -o example && ./example
 */
#include <kvxfer.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fail(const char *what, kvxfer_result r) {
  char msg[512];
  kvxfer_last_error(msg, sizeof msg);
  fprintf(stderr, "%s: %s: %s\n", what, kvxfer_result_name(r), msg);
  return 1;
}

int main(void) {
  enum { LEN = 64 * 1024 };
  kvxfer_agent *target = NULL, *initiator = NULL;
  kvxfer_result r;
  if ((r = kvxfer_agent_new("gen-0", "tcp", NULL, &target))) return fail("new target", r);
  if ((r = kvxfer_agent_new("ctx-0", "tcp", NULL, &initiator))) return fail("new initiator", r);

  /* Register one buffer on each side. */
  char *kv_dst = calloc(1, LEN), *kv_src = malloc(LEN);
  memset(kv_src, 'k', LEN);
  kvxfer_mem_desc dst = {(uint64_t)(uintptr_t)kv_dst, LEN, 0};
  kvxfer_mem_desc src = {(uint64_t)(uintptr_t)kv_src, LEN, 0};
  if ((r = kvxfer_agent_register_memory(target, KVXFER_MEM_DRAM, &dst, 1))) return fail("register", r);
  if ((r = kvxfer_agent_register_memory(initiator, KVXFER_MEM_DRAM, &src, 1))) return fail("register", r);

  /* The initiator fetches the target's descriptor over the side channel. */
  char conn[128], name[256];
  if ((r = kvxfer_agent_connection_info(target, conn, sizeof conn, NULL))) return fail("connection info", r);
  if ((r = kvxfer_agent_load_remote_by_connection(initiator, conn, name, sizeof name, NULL)))
    return fail("load remote", r);

  /* WRITE with a sync message. */
  kvxfer_request req = {0};
  req.op = KVXFER_OP_WRITE;
  req.local_type = KVXFER_MEM_DRAM;
  req.local = &src;
  req.local_count = 1;
  req.remote_type = KVXFER_MEM_DRAM;
  req.remote = &dst;
  req.remote_count = 1;
  req.remote_agent = name;
  req.sync_message = (const uint8_t *)"request 42: blocks ready";
  req.sync_message_len = strlen("request 42: blocks ready");
  kvxfer_status *status = NULL;
  if ((r = kvxfer_agent_submit(initiator, &req, &status))) return fail("submit", r);
  if ((r = kvxfer_status_wait(status, 10000)) != KVXFER_OK) return fail("wait", r);
  kvxfer_status_free(status);

  /* The target side: take the message; the data is already in place. */
  kvxfer_messages *msgs = NULL;
  if ((r = kvxfer_agent_wait_messages(target, 10000, &msgs))) return fail("wait messages", r);
  size_t n = 0;
  kvxfer_messages_count(msgs, &n);
  for (size_t i = 0; i < n; i++) {
    const char *from;
    const uint8_t *data;
    size_t len;
    kvxfer_messages_get(msgs, i, &from, &data, &len);
    printf("received from %s: %.*s (data %s)\n", from, (int)len, (const char *)data,
           memcmp(kv_dst, kv_src, LEN) == 0 ? "in place" : "MISSING");
  }
  kvxfer_messages_free(msgs);

  kvxfer_agent_free(initiator);
  kvxfer_agent_free(target);
  free(kv_src);
  free(kv_dst);
  return 0;
}
