/* What a make that embeds herdless links: every call of the C ABI, used
 * the way a make's token loop uses them. tests/ffi.rs links it the way
 * docs/EMBEDDING.md says (and the naive way) to measure what an embedder
 * carries: its size and the symbols it exports. It also runs, so a link
 * that dropped something needed shows.
 *
 * Run under `herdless run -j 3 --no-classic` (two shared tokens). Prints
 * "embed: ok". Every function but main is static: under -rdynamic the
 * program itself then exports only main. */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <poll.h>
#include <stdlib.h>

#include "check.h"

/* Takes one token the way a make's pselect loop does. */
static int take_token(herdless_client *c) {
    for (;;) {
        int r = herdless_take_grant(c);
        if (r != -EAGAIN) return r;
        struct pollfd p = {.fd = herdless_fd(c), .events = POLLIN};
        if (poll(&p, 1, -1) < 0 && errno != EINTR) return -errno;
    }
}

int main(void) {
    herdless_client *c = herdless_client_from_env();
    REQUIRE(c != NULL);
    CHECK(herdless_fd(c) >= 0);
    CHECK_EQ(herdless_acquire(c, HERDLESS_WAIT_FOREVER), 0);
    CHECK_EQ(take_token(c), 0);
    CHECK_EQ(herdless_try_acquire(c), -EAGAIN);
    CHECK_EQ(herdless_release(c), 0);
    CHECK_EQ(herdless_try_acquire(c), 0);
    CHECK_EQ(herdless_release(c), 0);
    CHECK_EQ(herdless_release(c), 0);
    CHECK_EQ(herdless_release(c), -EINVAL);
    CHECK_EQ(herdless_cancel(c), 0);
    CHECK_EQ(herdless_aborted(c), 0);
    CHECK(herdless_strerror(-EAGAIN)[0] != '\0');

    /* A second handle, by path, posts an abort that the first one sees. */
    herdless_client *d = herdless_client_connect(getenv("HERDLESS_SOCKET"));
    REQUIRE(d != NULL);
    CHECK_EQ(herdless_abort(d, 'E'), 0);
    herdless_client_free(d);
    CHECK_EQ(herdless_acquire(c, HERDLESS_WAIT_FOREVER), -ECANCELED);
    CHECK_EQ(herdless_aborted(c), 'E');
    herdless_client_free(c);
    return check_done("embed");
}
