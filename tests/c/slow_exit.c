/* Preloaded into the makes of a test (LD_PRELOAD): a make process waits
 * SLOW_EXIT_US microseconds as it exits, after everything of its own is
 * done, so that whatever it still owes the broker (a wait for a token it
 * no longer wants, a withdrawal not answered yet) has time to be handed a
 * token before its connection closes. Processes whose name has no "make"
 * in it (the jobs) are left alone. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

__attribute__((destructor)) static void slow_exit(void)
{
    const char *us = getenv("SLOW_EXIT_US");
    char comm[64] = "";
    FILE *f;

    if (us == NULL)
        return;
    f = fopen("/proc/self/comm", "r");
    if (f == NULL)
        return;
    if (fgets(comm, sizeof comm, f) == NULL)
        comm[0] = 0;
    fclose(f);
    if (strstr(comm, "make") != NULL)
        usleep((useconds_t)atoi(us));
}
