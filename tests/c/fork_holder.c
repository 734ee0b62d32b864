/* A handle used from a fork: takes two tokens (argv[1] "queue": instead
 * leaves one request queued and holds nothing), forks, and the child tries
 * the handle (every call fails with -EPERM and sends nothing), then either
 * frees its copy of the handle (argv[1] "free") or keeps it. The parent
 * says "parent: child PID" and waits to be killed; the child says
 * "child: ok" or lists its failed checks, then waits to be killed. */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#include "check.h"

int main(int argc, char **argv) {
    int free_in_child = argc > 1 && strcmp(argv[1], "free") == 0;
    int queue = argc > 1 && strcmp(argv[1], "queue") == 0;
    herdless_client *c = herdless_client_from_env();
    REQUIRE(c != NULL);
    if (queue) {
        CHECK_EQ(herdless_take_grant(c), -EAGAIN);
    } else {
        CHECK_EQ(herdless_acquire(c, HERDLESS_WAIT_FOREVER), 0);
        CHECK_EQ(herdless_acquire(c, HERDLESS_WAIT_FOREVER), 0);
    }
    /* The slot for the jobs this process would start: HERDLESS_SLOT=ID/LEVEL. */
    const char *slot = herdless_slot_env(c);
    CHECK(slot != NULL && strncmp(slot, "HERDLESS_SLOT=", 14) == 0 &&
          strlen(slot) >= 14 + 17 && slot[14 + 16] == '/');
    CHECK(herdless_slot_env(NULL) == NULL);
    /* This process, for a make's jobs: HERDLESS_RUNNER=PID[:PIDNS]. */
    const char *runner = herdless_runner_env(c);
    char want[64];
    snprintf(want, sizeof want, "HERDLESS_RUNNER=%ld", (long)getpid());
    CHECK(runner != NULL && strncmp(runner, want, strlen(want)) == 0 &&
          (runner[strlen(want)] == '\0' || runner[strlen(want)] == ':'));
    CHECK(herdless_runner_env(NULL) == NULL);
    /* Checks before the fork are counted in the child's report. */
    fflush(stdout);
    pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {
        CHECK_EQ(herdless_acquire(c, 0), -EPERM);
        CHECK_EQ(herdless_try_acquire(c), -EPERM);
        CHECK_EQ(herdless_take_grant(c), -EPERM);
        CHECK_EQ(herdless_request_grant(c), -EPERM);
        CHECK_EQ(herdless_pending(c), -EPERM);
        CHECK_EQ(herdless_cancel_nowait(c), -EPERM);
        CHECK_EQ(herdless_cancel(c), -EPERM);
        CHECK_EQ(herdless_poll_handoff(c), -EPERM);
        /* Nothing held through the handle: -EINVAL before anything else. */
        CHECK_EQ(herdless_release(c), queue ? -EINVAL : -EPERM);
        CHECK_EQ(herdless_abort(c, 'E'), -EPERM);
        CHECK_EQ(herdless_aborted(c), 0);
        if (free_in_child) {
            herdless_client_free(c);
        }
        printf("child: %s\n", check_failures == 0 ? "ok" : "failed");
        fflush(stdout);
        for (;;) {
            pause();
        }
    }
    printf("parent: child %ld\n", (long)child);
    fflush(stdout);
    for (;;) {
        pause();
    }
}
