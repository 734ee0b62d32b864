/* A signal ends a blocking herdless_acquire with -EINTR, and no token is
 * lost: the request stays queued, the grant is picked up by the next call,
 * withdrawn by herdless_cancel, or withdrawn and given back when the
 * handle is freed. Also the herdless_fd + herdless_take_grant path, and timeouts.
 *
 * Run under `herdless run -j 2 --stats` (one shared token). Two handles:
 * `owner` holds the token while `waiter` waits for it. Prints
 * "interrupt: ok". */
#define _XOPEN_SOURCE 700

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/time.h>

#include "check.h"

static volatile sig_atomic_t alarms;

static void on_alarm(int sig) {
    (void)sig;
    alarms++;
}

/* Signals keep coming every 10 ms until disarmed, so whenever the wait
 * starts, one arrives during it. */
static void arm(int on) {
    struct itimerval t;
    memset(&t, 0, sizeof t);
    if (on) {
        t.it_value.tv_usec = 10000;
        t.it_interval.tv_usec = 10000;
    }
    REQUIRE(setitimer(ITIMER_REAL, &t, NULL) == 0);
}

/* Waits, in the caller's own poll(), until a grant (or anything else)
 * has arrived for c. */
static void wait_readable(herdless_client *c) {
    struct pollfd p = {herdless_fd(c), POLLIN, 0};
    int n;
    while ((n = poll(&p, 1, -1)) < 0 && errno == EINTR) {
    }
    CHECK_EQ(n, 1);
}

/* herdless_acquire(waiter, -1) while owner holds the only token: -EINTR. */
static void interrupted_wait(herdless_client *waiter, int sa_restart) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_alarm;
    sa.sa_flags = sa_restart ? SA_RESTART : 0;
    sigemptyset(&sa.sa_mask);
    REQUIRE(sigaction(SIGALRM, &sa, NULL) == 0);
    int before = alarms;
    arm(1);
    CHECK_EQ(herdless_acquire(waiter, HERDLESS_WAIT_FOREVER), -EINTR);
    arm(0);
    CHECK(alarms > before);
    /* Still nothing: the token is the owner's. */
    CHECK_EQ(herdless_release(waiter), -EINVAL);
}

int main(void) {
    herdless_client *owner = herdless_client_from_env();
    herdless_client *waiter = herdless_client_from_env();
    REQUIRE(owner != NULL && waiter != NULL);

    /* 1. Interrupted, then the next acquire picks up the grant. */
    CHECK_EQ(herdless_acquire(owner, -1), 0);
    interrupted_wait(waiter, 0);
    CHECK_EQ(herdless_release(owner), 0); /* goes to waiter's request */
    CHECK_EQ(herdless_try_acquire(owner), -EAGAIN);
    CHECK_EQ(herdless_acquire(waiter, -1), 0);
    CHECK_EQ(herdless_release(waiter), 0);
    CHECK_EQ(herdless_release(waiter), -EINVAL);

    /* 2. SA_RESTART changes nothing; the grant, once it has arrived, is
     * picked up by a try (which never asks again while a request is
     * queued). */
    CHECK_EQ(herdless_acquire(owner, -1), 0);
    interrupted_wait(waiter, 1);
    CHECK_EQ(herdless_release(owner), 0);
    wait_readable(waiter);
    CHECK_EQ(herdless_try_acquire(waiter), 0);
    CHECK_EQ(herdless_release(waiter), 0);

    /* 3. Interrupted, then withdrawn: the token stays with the pool. */
    CHECK_EQ(herdless_acquire(owner, -1), 0);
    interrupted_wait(waiter, 0);
    CHECK_EQ(herdless_cancel(waiter), 0);
    CHECK_EQ(herdless_release(owner), 0);
    CHECK_EQ(herdless_try_acquire(owner), 0);
    CHECK_EQ(herdless_release(owner), 0);

    /* 4. Interrupted, and the grant arrives before the cancel: the cancel
     * reports it, and the token is held. */
    CHECK_EQ(herdless_acquire(owner, -1), 0);
    interrupted_wait(waiter, 0);
    CHECK_EQ(herdless_release(owner), 0);
    wait_readable(waiter); /* the grant is there */
    CHECK_EQ(herdless_cancel(waiter), 1);
    CHECK_EQ(herdless_release(waiter), 0);
    CHECK_EQ(herdless_release(waiter), -EINVAL);

    /* 5. A timeout withdraws the request: nothing is owed afterwards. */
    CHECK_EQ(herdless_acquire(owner, -1), 0);
    CHECK_EQ(herdless_acquire(waiter, 20), -ETIMEDOUT);
    CHECK_EQ(herdless_release(owner), 0);
    CHECK_EQ(herdless_try_acquire(owner), 0);
    CHECK_EQ(herdless_release(owner), 0);

    /* 6. The poll-loop path: take_grant queues, the fd turns readable. */
    CHECK_EQ(herdless_acquire(owner, -1), 0);
    CHECK_EQ(herdless_take_grant(waiter), -EAGAIN);
    CHECK_EQ(herdless_take_grant(waiter), -EAGAIN); /* one request only */
    CHECK_EQ(herdless_release(owner), 0);
    wait_readable(waiter);
    CHECK_EQ(herdless_take_grant(waiter), 0);
    CHECK_EQ(herdless_try_acquire(owner), -EAGAIN);
    CHECK_EQ(herdless_release(waiter), 0);

    /* 7. Interrupted, the grant arrives (or is on its way), and the handle
     * is freed without taking it: the free withdraws the request, takes the
     * grant that answered it and gives it back, so the broker has nothing
     * to take back from the closed connection. */
    CHECK_EQ(herdless_acquire(owner, -1), 0);
    interrupted_wait(waiter, 0);
    CHECK_EQ(herdless_release(owner), 0);
    herdless_client_free(waiter);
    CHECK_EQ(herdless_acquire(owner, -1), 0);
    CHECK_EQ(herdless_release(owner), 0);

    herdless_client_free(owner);
    return check_done("interrupt");
}
