/* Check macros shared by the C tests: a failed call or expectation prints
 * where and why (with kvxfer_last_error) and exits 1; `checks` counts the
 * ones that passed. */
#ifndef KVXFER_TEST_CHECK_H
#define KVXFER_TEST_CHECK_H

#include <kvxfer.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int checks = 0;

#define CHECK(call)                                                          \
  do {                                                                       \
    kvxfer_result r_ = (call);                                               \
    if (r_ != KVXFER_OK) {                                                   \
      char m_[512];                                                          \
      kvxfer_last_error(m_, sizeof m_);                                      \
      fprintf(stderr, "%s:%d: %s -> %s: %s\n", __FILE__, __LINE__, #call,    \
              kvxfer_result_name(r_), m_);                                   \
      exit(1);                                                               \
    }                                                                        \
    checks++;                                                                \
  } while (0)

#define EXPECT(cond)                                                         \
  do {                                                                       \
    if (!(cond)) {                                                           \
      fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #cond);    \
      exit(1);                                                               \
    }                                                                        \
    checks++;                                                                \
  } while (0)

/* A call must fail with `code`, with a message that contains `needle`. */
#define EXPECT_ERR(call, code, needle)                                       \
  do {                                                                       \
    kvxfer_result r_ = (call);                                               \
    char m_[512];                                                            \
    kvxfer_last_error(m_, sizeof m_);                                        \
    if (r_ != (code) || strstr(m_, (needle)) == NULL) {                      \
      fprintf(stderr, "%s:%d: %s -> %s (%s), expected %s with \"%s\"\n",     \
              __FILE__, __LINE__, #call, kvxfer_result_name(r_), m_,         \
              kvxfer_result_name(code), (needle));                           \
      exit(1);                                                               \
    }                                                                        \
    checks++;                                                                \
  } while (0)

#endif
