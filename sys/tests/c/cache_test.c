/* The KV-cache protocol through the C ABI: two context ranks (TP 2) send
 * a request's blocks to one generation rank (TP 1) in one process; every
 * element lands where the layout says, and bad calls get typed errors.
 * Built and run by sys/tests/c_programs.rs. */
#include "check.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { LAYERS = 2, KV = 2, HEADS = 4, TOKENS = 4, DIM = 8, BLOCKS = 4 };

/* The value of element (layer, kv, model head, token, dim). */
static uint32_t value(uint32_t l, uint32_t kv, uint32_t h, uint32_t t, uint32_t d) {
  return 1 + l * 100000u + kv * 10000u + h * 1000u + t * 10u + d;
}

/* Index in a block of a rank holding `heads` heads: [layer][kv][head][token][dim]. */
static size_t at(uint32_t heads, uint32_t l, uint32_t kv, uint32_t h, uint32_t t, uint32_t d) {
  return ((((size_t)l * KV + kv) * heads + h) * TOKENS + t) * DIM + d;
}

static kvxfer_cache_state layout(uint32_t heads_per_rank, uint32_t tp) {
  kvxfer_cache_state s;
  memset(&s, 0, sizeof s);
  s.layers = LAYERS;
  s.kv_heads_per_rank = heads_per_rank;
  s.head_size = DIM;
  s.tokens_per_block = TOKENS;
  s.dtype = KVXFER_DTYPE_F32;
  s.tp = tp;
  s.pp = 1;
  return s;
}

int main(void) {
  const size_t ctx_block = (size_t)LAYERS * KV * (HEADS / 2) * TOKENS * DIM;
  const size_t gen_block = (size_t)LAYERS * KV * HEADS * TOKENS * DIM;
  kvxfer_cache_state ctx_state = layout(HEADS / 2, 2), gen_state = layout(HEADS, 1);

  kvxfer_agent *ctx[2], *gen = NULL;
  uint32_t *ctx_pool[2];
  char conn[2][128];
  for (int r = 0; r < 2; r++) {
    char name[16];
    snprintf(name, sizeof name, "ctx-%d", r);
    CHECK(kvxfer_agent_new(name, "tcp", NULL, &ctx[r]));
    ctx_pool[r] = calloc(BLOCKS * ctx_block, sizeof(uint32_t));
    /* Block b of the pool holds the request's block b - 1 (block 0 unused). */
    for (uint32_t b = 1; b < BLOCKS; b++)
      for (uint32_t l = 0; l < LAYERS; l++)
        for (uint32_t kv = 0; kv < KV; kv++)
          for (uint32_t h = 0; h < HEADS / 2; h++)
            for (uint32_t t = 0; t < TOKENS; t++)
              for (uint32_t d = 0; d < DIM; d++)
                ctx_pool[r][b * ctx_block + at(HEADS / 2, l, kv, h, t, d)] =
                    value(l, kv, r * (HEADS / 2) + h, t + b * TOKENS, d);
    kvxfer_mem_desc reg = {(uint64_t)(uintptr_t)ctx_pool[r], BLOCKS * ctx_block * sizeof(uint32_t), 0};
    CHECK(kvxfer_agent_register_memory(ctx[r], KVXFER_MEM_DRAM, &reg, 1));
    CHECK(kvxfer_agent_connection_info(ctx[r], conn[r], sizeof conn[r], NULL));
  }
  CHECK(kvxfer_agent_new("gen-0", "tcp", NULL, &gen));
  uint32_t *gen_pool = calloc(BLOCKS * gen_block, sizeof(uint32_t));
  kvxfer_mem_desc greg = {(uint64_t)(uintptr_t)gen_pool, BLOCKS * gen_block * sizeof(uint32_t), 0};
  CHECK(kvxfer_agent_register_memory(gen, KVXFER_MEM_DRAM, &greg, 1));

  kvxfer_cache_sender *snd[2];
  for (int r = 0; r < 2; r++) CHECK(kvxfer_cache_sender_new(ctx[r], &ctx_state, (uint32_t)r, 30000, &snd[r]));
  const char *conns[2] = {conn[0], conn[1]};
  kvxfer_cache_receiver *rcv = NULL;
  /* With end-to-end integrity: every write checked where it lands. */
  kvxfer_cache_receiver_options ropts = {.timeout_ms = 30000, .settle_timeout_ms = -1, .integrity = 1};
  CHECK(kvxfer_cache_receiver_new_with(gen, &gen_state, 0, &ctx_state, conns, 2, &ropts, &rcv));

  /* Request 7: three blocks, into generation blocks 3, 0, 2 (scattered). */
  uint64_t gen_blocks[3], ctx_blocks[2][3];
  const uint32_t dst[3] = {3, 0, 2};
  for (int i = 0; i < 3; i++) {
    gen_blocks[i] = (uint64_t)(uintptr_t)(gen_pool + dst[i] * gen_block);
    for (int r = 0; r < 2; r++) ctx_blocks[r][i] = (uint64_t)(uintptr_t)(ctx_pool[r] + (1 + i) * ctx_block);
  }
  kvxfer_cache_handle *rh = NULL, *sh[2];
  CHECK(kvxfer_cache_receiver_request(rcv, 7, 0, gen_blocks, 3, &rh));
  for (int r = 0; r < 2; r++) CHECK(kvxfer_cache_sender_send(snd[r], 7, ctx_blocks[r], 3, &sh[r]));
  kvxfer_cache_stats st;
  uint64_t sent = 0;
  for (int r = 0; r < 2; r++) {
    CHECK(kvxfer_cache_wait(sh[r], -1, &st));
    sent += st.bytes;
    CHECK(kvxfer_cache_handle_free(sh[r]));
  }
  CHECK(kvxfer_cache_wait(rh, 30000, &st));
  EXPECT(st.bytes == 3 * gen_block * sizeof(uint32_t) && st.bytes == sent);
  EXPECT(st.fragments > 0 && st.fragments_coalesced > 0);
  /* Completed: nothing more can land, the blocks are settled. */
  CHECK(kvxfer_cache_wait_settled(rh, 0));
  CHECK(kvxfer_cache_handle_free(rh));
  /* Every element, in the generation layout. */
  for (uint32_t i = 0; i < 3; i++)
    for (uint32_t l = 0; l < LAYERS; l++)
      for (uint32_t kv = 0; kv < KV; kv++)
        for (uint32_t h = 0; h < HEADS; h++)
          for (uint32_t t = 0; t < TOKENS; t++)
            for (uint32_t d = 0; d < DIM; d++) {
              uint32_t got = gen_pool[dst[i] * gen_block + at(HEADS, l, kv, h, t, d)];
              if (got != value(l, kv, h, t + (i + 1) * TOKENS, d)) {
                fprintf(stderr, "block %u l%u kv%u h%u t%u d%u: %u\n", i, l, kv, h, t, d, got);
                exit(1);
              }
            }
  checks++;
  /* Generation block 1 was not asked for: untouched. */
  size_t touched = 0;
  for (size_t k = 0; k < gen_block; k++) touched += gen_pool[gen_block + k] != 0;
  EXPECT(touched == 0);

  /* Request 10, layer by layer, the last layer first: each lands before
   * the next is ready. */
  memset(gen_pool, 0, BLOCKS * gen_block * sizeof(uint32_t));
  CHECK(kvxfer_cache_receiver_request(rcv, 10, 0, gen_blocks, 3, &rh));
  for (int r = 0; r < 2; r++) CHECK(kvxfer_cache_sender_begin(snd[r], 10, ctx_blocks[r], 3, &sh[r]));
  uint32_t landed = 99;
  CHECK(kvxfer_cache_layers_landed(rh, 0, LAYERS, &landed));
  EXPECT(landed == 0);
  EXPECT(kvxfer_cache_wait_layers(rh, 0, LAYERS, 50) == KVXFER_ERR_TIMEOUT);
  EXPECT(kvxfer_cache_sender_layers_ready(snd[0], 10, LAYERS, 1) == KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT(kvxfer_cache_sender_layers_ready(snd[0], 10, 0, 0) == KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT(kvxfer_cache_sender_layers_ready(snd[0], 11, 0, 1) == KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT(kvxfer_cache_wait_layers(sh[0], 0, 1, 0) == KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT(kvxfer_cache_wait_settled(sh[0], 0) == KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT(kvxfer_cache_wait_layers(rh, LAYERS, 1, 0) == KVXFER_ERR_INVALID_ARGUMENT);
  for (int l = LAYERS - 1; l >= 0; l--) {
    for (int r = 0; r < 2; r++) CHECK(kvxfer_cache_sender_layers_ready(snd[r], 10, (uint32_t)l, 1));
    CHECK(kvxfer_cache_wait_layers(rh, (uint32_t)l, 1, 30000));
    CHECK(kvxfer_cache_layers_landed(rh, 0, LAYERS, &landed));
    EXPECT(landed == (uint32_t)(LAYERS - l));
    /* The layer's elements are in place, the layers not ready are not. */
    for (uint32_t ll = 0; ll < LAYERS; ll++) {
      uint32_t got = gen_pool[dst[0] * gen_block + at(HEADS, ll, 1, 3, 2, 5)];
      uint32_t want = ll >= (uint32_t)l ? value(ll, 1, 3, 2 + TOKENS, 5) : 0;
      EXPECT(got == want);
    }
  }
  for (int r = 0; r < 2; r++) {
    CHECK(kvxfer_cache_wait(sh[r], 30000, NULL));
    CHECK(kvxfer_cache_handle_free(sh[r]));
  }
  CHECK(kvxfer_cache_wait(rh, 30000, &st));
  EXPECT(st.bytes == 3 * gen_block * sizeof(uint32_t));
  CHECK(kvxfer_cache_handle_free(rh));

  /* Bad calls. */
  kvxfer_cache_state bad = layout(HEADS, 3);
  kvxfer_cache_sender *none = NULL;
  EXPECT(kvxfer_cache_sender_new(ctx[0], &bad, 0, -1, &none) == KVXFER_ERR_INVALID_ARGUMENT && none == NULL);
  EXPECT(kvxfer_cache_sender_new(ctx[0], &ctx_state, 5, -1, &none) == KVXFER_ERR_INVALID_ARGUMENT);
  kvxfer_cache_receiver *nr = NULL;
  EXPECT(kvxfer_cache_receiver_new(gen, &gen_state, 0, &ctx_state, conns, 1, -1, &nr) ==
         KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT(kvxfer_cache_receiver_cancel(rcv, 12345) == KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT(kvxfer_cache_receiver_request(rcv, 8, 0, gen_blocks, 0, &rh) == KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT(kvxfer_cache_wait(NULL, 0, NULL) == KVXFER_ERR_NULL_ARGUMENT);
  EXPECT(kvxfer_cache_handle_free(rh) == KVXFER_ERR_INVALID_HANDLE);
  /* A request the context side never sends: cancelled by the receiver. */
  CHECK(kvxfer_cache_receiver_request(rcv, 9, 0, gen_blocks, 1, &rh));
  EXPECT(kvxfer_cache_wait(rh, 50, NULL) == KVXFER_ERR_TIMEOUT);
  EXPECT(kvxfer_cache_wait_settled(rh, 50) == KVXFER_ERR_TIMEOUT);
  CHECK(kvxfer_cache_receiver_cancel(rcv, 9));
  EXPECT(kvxfer_cache_wait(rh, 30000, NULL) == KVXFER_ERR_CANCELLED);
  /* The ranks confirmed the cancel: the blocks may be reused. */
  CHECK(kvxfer_cache_wait_settled(rh, 0));
  CHECK(kvxfer_cache_handle_free(rh));

  CHECK(kvxfer_cache_receiver_free(rcv));
  for (int r = 0; r < 2; r++) CHECK(kvxfer_cache_sender_free(snd[r]));
  CHECK(kvxfer_agent_free(gen));
  for (int r = 0; r < 2; r++) {
    CHECK(kvxfer_agent_free(ctx[r]));
    free(ctx_pool[r]);
  }
  free(gen_pool);
  printf("%d checks passed\n", checks);
  return 0;
}
