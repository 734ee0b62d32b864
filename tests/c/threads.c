/* One handle, several threads: each grant goes to exactly one caller, the
 * handle's count of tokens stays exact under concurrent releases, and
 * never more tokens are in use than the pool has.
 *
 * Run under `herdless run -j 3 --no-classic` (two shared tokens).
 * Phase 1: four threads each take and give back a token ROUNDS times, with
 * blocking, non-blocking and timed calls; at most POOL are held at once.
 * Phase 2: the same while a stray thread keeps releasing tokens it never
 * took. Each stray release that succeeds gives back a worker's token, so
 * that worker's own release is refused; a release beyond the count would
 * reach the broker, which closes the connection for it. So: stray
 * successes equal worker refusals, and at the end both tokens are free.
 * Prints "threads: ok". */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>

#include "check.h"

#define THREADS 4
#define ROUNDS 200
#define POOL 2

static herdless_client *client;
static atomic_int in_use, most, taken, refused, stray_ok, stray_done;
static int phase2;

static int take(int how) {
    int r;
    switch (how % 3) {
    case 0:
        return herdless_acquire(client, HERDLESS_WAIT_FOREVER);
    case 1:
        r = herdless_try_acquire(client);
        return r == -EAGAIN ? herdless_acquire(client, HERDLESS_WAIT_FOREVER)
                            : r;
    default:
        return herdless_acquire(client, 1000 * 1000);
    }
}

static void *worker(void *arg) {
    int id = (int)(long)arg;
    for (int i = 0; i < ROUNDS; i++) {
        int r = take(i + id);
        if (r != 0) {
            CHECK_EQ(r, 0);
            break;
        }
        atomic_fetch_add(&taken, 1);
        if (!phase2) {
            int now = atomic_fetch_add(&in_use, 1) + 1;
            int seen = atomic_load(&most);
            while (now > seen &&
                   !atomic_compare_exchange_weak(&most, &seen, now)) {
            }
            atomic_fetch_sub(&in_use, 1);
        }
        r = herdless_release(client);
        if (r == -EINVAL && phase2) {
            atomic_fetch_add(&refused, 1);
        } else {
            CHECK_EQ(r, 0);
        }
    }
    return NULL;
}

static void *stray(void *arg) {
    (void)arg;
    while (!atomic_load(&stray_done)) {
        int r = herdless_release(client);
        if (r == 0) {
            atomic_fetch_add(&stray_ok, 1);
        } else {
            CHECK_EQ(r, -EINVAL);
        }
    }
    return NULL;
}

static void workers(void) {
    pthread_t t[THREADS];
    for (long i = 0; i < THREADS; i++) {
        REQUIRE(pthread_create(&t[i], NULL, worker, (void *)i) == 0);
    }
    for (int i = 0; i < THREADS; i++) pthread_join(t[i], NULL);
}

/* Nothing held, and exactly the pool's tokens are free. */
static void all_free(void) {
    CHECK_EQ(herdless_release(client), -EINVAL);
    for (int i = 0; i < POOL; i++) CHECK_EQ(herdless_try_acquire(client), 0);
    CHECK_EQ(herdless_try_acquire(client), -EAGAIN);
    for (int i = 0; i < POOL; i++) CHECK_EQ(herdless_release(client), 0);
    CHECK_EQ(herdless_release(client), -EINVAL);
}

int main(void) {
    client = herdless_client_from_env();
    REQUIRE(client != NULL);

    workers();
    CHECK_EQ(atomic_load(&taken), THREADS * ROUNDS);
    CHECK(atomic_load(&most) >= 1 && atomic_load(&most) <= POOL);
    all_free();

    phase2 = 1;
    atomic_store(&taken, 0);
    pthread_t s;
    REQUIRE(pthread_create(&s, NULL, stray, NULL) == 0);
    workers();
    atomic_store(&stray_done, 1);
    pthread_join(s, NULL);
    CHECK_EQ(atomic_load(&taken), THREADS * ROUNDS);
    CHECK_EQ(atomic_load(&stray_ok), atomic_load(&refused));
    CHECK_EQ(herdless_aborted(client), 0);
    all_free();

    herdless_client_free(client);
    printf("threads: stray releases %d\n", atomic_load(&stray_ok));
    return check_done("threads");
}
