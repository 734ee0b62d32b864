/* Assertions for the C tests: each failed check prints where and what,
 * and the program exits non-zero at the end (check_done). */
#ifndef HERDLESS_TEST_CHECK_H
#define HERDLESS_TEST_CHECK_H

#include <stdio.h>
#include <stdlib.h>

#include "herdless.h"

static int check_failures;

static inline void check_int(const char *file, int line, const char *expr, long got,
                      long want) {
    if (got != want) {
        fprintf(stderr, "%s:%d: %s is %ld (%s), want %ld (%s)\n", file, line,
                expr, got, herdless_strerror((int)got), want,
                herdless_strerror((int)want));
        check_failures++;
    }
}

static inline void check_true(const char *file, int line, const char *expr, int ok) {
    if (!ok) {
        fprintf(stderr, "%s:%d: not true: %s\n", file, line, expr);
        check_failures++;
    }
}

/* CHECK_EQ(expr, want): expr, an int or long, equals want. */
#define CHECK_EQ(expr, want) \
    check_int(__FILE__, __LINE__, #expr, (long)(expr), (long)(want))
/* CHECK(cond): cond holds. */
#define CHECK(cond) check_true(__FILE__, __LINE__, #cond, (cond) != 0)

/* Fails at once: later steps make no sense without this one. */
#define REQUIRE(cond)                                                    \
    do {                                                                 \
        if (!(cond)) {                                                   \
            fprintf(stderr, "%s:%d: required: %s\n", __FILE__, __LINE__, \
                    #cond);                                              \
            exit(3);                                                     \
        }                                                                \
    } while (0)

/* Exits 0 when every check passed; prints "NAME: ok" for the test. */
static inline int check_done(const char *name) {
    if (check_failures) {
        fprintf(stderr, "%s: %d check(s) failed\n", name, check_failures);
        return 1;
    }
    printf("%s: ok\n", name);
    return 0;
}

#endif
