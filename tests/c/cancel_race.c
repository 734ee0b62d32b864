/* A poll loop that mixes herdless_take_grant and herdless_cancel_nowait
 * on one handle, as a make does, while another client of the same broker
 * takes and gives back tokens as fast as it can: a grant that races a
 * withdrawal the broker has not answered yet is void (the broker takes
 * it back), and a second withdrawal that read it must not give it back
 * as if it were held. That release took one of the holder's own tokens
 * off the broker's books, and two clients then got the tokens it still
 * held: more out than the pool has.
 *
 * The pool: -j3 in-process, two tokens to share. The holder keeps one
 * for the whole run; at the end at most one more can be had, every call
 * on the holder succeeded or said -EAGAIN, and the broker lost nothing.
 * Arguments: the number of rounds (default 100000), the seed of the
 * holder's choices (default 1). */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"

static volatile int stop;

/* Takes and gives back tokens until told to stop. */
static void *contend(void *arg) {
    herdless_client *c = arg;
    struct timespec pause = {0, 20000};
    while (!stop) {
        if (herdless_acquire(c, 5) == 0) {
            nanosleep(&pause, NULL);
            herdless_release(c);
        }
    }
    return NULL;
}

int main(int argc, char **argv) {
    long rounds = argc > 1 ? atol(argv[1]) : 100000;
    herdless_broker *b = herdless_broker_start(3, 0, NULL);
    REQUIRE(b != NULL);
    herdless_client *holder = herdless_client_native_from_env();
    herdless_client *other = herdless_client_native_from_env();
    REQUIRE(holder != NULL && other != NULL);
    REQUIRE(herdless_acquire(holder, -1) == 0);

    pthread_t t;
    REQUIRE(pthread_create(&t, NULL, contend, other) == 0);
    unsigned seed = argc > 2 ? (unsigned)atol(argv[2]) : 1;
    long i;
    int failed = 0;
    for (i = 0; i < rounds && !failed; i++) {
        int r;
        if (rand_r(&seed) % 2 == 0) {
            r = herdless_take_grant(holder);
            if (r == 0) r = herdless_release(holder);
        } else {
            r = herdless_cancel_nowait(holder);
        }
        if (r < 0 && r != -EAGAIN) {
            fprintf(stderr, "round %ld: %d (%s)\n", i, r, herdless_strerror(r));
            failed = 1;
        }
    }
    stop = 1;
    REQUIRE(pthread_join(t, NULL) == 0);
    CHECK(!failed);
    /* Nothing left queued for the holder. */
    int r = herdless_cancel(holder);
    CHECK(r == 0 || r == 1);
    if (r == 1) CHECK_EQ(herdless_release(holder), 0);

    /* The holder still holds its token: one more is free, not two. */
    herdless_client *third = herdless_client_native_from_env();
    REQUIRE(third != NULL);
    int got = (herdless_try_acquire(other) == 0) + (herdless_try_acquire(third) == 0);
    CHECK(got == 1);

    herdless_client_free(third);
    herdless_client_free(other);
    herdless_client_free(holder);
    herdless_broker_report rep;
    memset(&rep, 0, sizeof rep);
    CHECK_EQ(herdless_broker_stop(b, &rep), 0);
    CHECK_EQ(rep.lost, 0);
    CHECK(rep.max_in_use <= 2);
    printf("%ld rounds, %d more taken at the end, max in use %u\n", i, got, rep.max_in_use);
    return check_done("cancel_race");
}
