/* Preloaded into the makes of a test (LD_PRELOAD): the process whose
 * main thread makes its SIGNAL_IN_SEND-th send(2) (herdless sends every
 * request to its broker with it; a broker thread's sends are not counted)
 * sends SIGINT to its
 * whole process group from inside that send, before the bytes go out, as a
 * terminal's ^C would if it came at that instant, and appends its pid to
 * the file SIGNAL_IN_SEND_MARK names. The make's fatal-signal handler then
 * runs while its main flow is in the middle of a herdless call; the other
 * makes of the tree take the signal wherever they are. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/types.h>
#include <unistd.h>

ssize_t send(int fd, const void *buf, size_t len, int flags)
{
    static ssize_t (*real)(int, const void *, size_t, int);
    static int target = -1, seen;

    if (real == NULL)
        real = (ssize_t (*)(int, const void *, size_t, int))dlsym(RTLD_NEXT, "send");
    if (target < 0) {
        const char *n = getenv("SIGNAL_IN_SEND");
        target = n != NULL ? atoi(n) : 0;
    }
    if (target > 0 && gettid() == getpid() && seen < target && ++seen == target) {
        const char *mark = getenv("SIGNAL_IN_SEND_MARK");
        if (mark != NULL) {
            char line[32];
            int n = snprintf(line, sizeof line, "%d\n", (int)getpid());
            int out = open(mark, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
            if (out >= 0) {
                (void)write(out, line, (size_t)n);
                (void)close(out);
            }
        }
        (void)kill(0, SIGINT);
    }
    return real(fd, buf, len, flags);
}
