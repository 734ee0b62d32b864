/* What every call says once the broker is gone: takes one token and waits
 * on another in a poll loop, says "holding 1", and when the test has
 * stopped the broker (the descriptor turns readable: end of file), checks
 * the codes. Prints "broker_gone: ok". */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <poll.h>

#include "check.h"

int main(void) {
    herdless_client *c = herdless_client_from_env();
    REQUIRE(c != NULL);
    /* -j 2: the one shared token, then a request that stays queued. */
    CHECK_EQ(herdless_acquire(c, HERDLESS_WAIT_FOREVER), 0);
    CHECK_EQ(herdless_take_grant(c), -EAGAIN);
    printf("holding 1\n");
    fflush(stdout);

    struct pollfd p = {herdless_fd(c), POLLIN, 0};
    int n;
    while ((n = poll(&p, 1, -1)) < 0 && errno == EINTR) {
    }
    CHECK_EQ(n, 1);

    CHECK_EQ(herdless_take_grant(c), -ECONNRESET);
    CHECK_EQ(herdless_acquire(c, HERDLESS_WAIT_FOREVER), -ECONNRESET);
    CHECK_EQ(herdless_try_acquire(c), -ECONNRESET);
    /* The broker took the token back; the handle counts it as returned. */
    CHECK_EQ(herdless_release(c), -ECONNRESET);
    CHECK_EQ(herdless_release(c), -EINVAL);
    CHECK_EQ(herdless_abort(c, 'E'), -ECONNRESET);
    CHECK_EQ(herdless_aborted(c), 0);
    CHECK(herdless_fd(c) >= 0);
    herdless_client_free(c);
    return check_done("broker_gone");
}
