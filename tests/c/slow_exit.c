/* Preloaded into the makes of a test (LD_PRELOAD): a make process waits
 * SLOW_EXIT_US microseconds as it exits, after everything of its own is
 * done, so that whatever it still owes the broker (a wait for a token it
 * no longer wants, a withdrawal not answered yet) has time to be handed a
 * token before its connection closes. Processes whose name has no "make"
 * in it (the jobs) are left alone.
 *
 * SLOW_SEND_US: each send(2) of a make's main thread (herdless sends every
 * request, release and withdrawal to its broker with it) waits that long
 * before the bytes go out, so that a grant the broker sends meanwhile
 * races the message: a withdrawal overtaken by a grant, above all. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

static int is_make(void)
{
    static int known = -1;
    char comm[64] = "";
    FILE *f;

    if (known >= 0)
        return known;
    f = fopen("/proc/self/comm", "r");
    if (f == NULL)
        return 0;
    if (fgets(comm, sizeof comm, f) == NULL)
        comm[0] = 0;
    fclose(f);
    known = strstr(comm, "make") != NULL;
    return known;
}

ssize_t send(int fd, const void *buf, size_t len, int flags)
{
    static ssize_t (*real)(int, const void *, size_t, int);
    static int us = -1;

    if (real == NULL)
        real = (ssize_t (*)(int, const void *, size_t, int))dlsym(RTLD_NEXT, "send");
    if (us < 0) {
        const char *v = getenv("SLOW_SEND_US");
        us = v != NULL ? atoi(v) : 0;
    }
    if (us > 0 && gettid() == getpid() && is_make())
        usleep((useconds_t)us);
    return real(fd, buf, len, flags);
}

__attribute__((destructor)) static void slow_exit(void)
{
    const char *us = getenv("SLOW_EXIT_US");

    if (us != NULL && is_make())
        usleep((useconds_t)atoi(us));
}
