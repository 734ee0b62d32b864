/* Takes N tokens (argv[1]) with blocking acquires, each waiting at most
 * TIMEOUT_MS (argv[2], default: for ever), says "holding N" on stdout, and
 * holds them until its standard input ends; then gives them back and exits
 * 0. With a third argument "free" it leaves that to herdless_client_free.
 * The crash test kills it with SIGKILL instead. */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <string.h>
#include <unistd.h>

#include "check.h"

int main(int argc, char **argv) {
    REQUIRE(argc >= 2);
    int want = atoi(argv[1]);
    int timeout_ms = argc > 2 ? atoi(argv[2]) : HERDLESS_WAIT_FOREVER;

    herdless_client *c = herdless_client_from_env();
    if (c == NULL) {
        fprintf(stderr, "holder: %s\n", herdless_strerror(-errno));
        return 2;
    }
    for (int i = 0; i < want; i++) {
        int r = herdless_acquire(c, timeout_ms);
        if (r != 0) {
            fprintf(stderr, "holder: token %d of %d: %s\n", i + 1, want,
                    herdless_strerror(r));
            return 2;
        }
    }
    printf("holding %d\n", want);
    fflush(stdout);

    char buf[64];
    for (;;) {
        ssize_t n = read(STDIN_FILENO, buf, sizeof buf);
        if (n == 0 || (n < 0 && errno != EINTR)) break;
    }
    if (argc <= 3 || strcmp(argv[3], "free") != 0) {
        for (int i = 0; i < want; i++) CHECK_EQ(herdless_release(c), 0);
        CHECK_EQ(herdless_release(c), -EINVAL);
    }
    herdless_client_free(c);
    return check_done("holder");
}
