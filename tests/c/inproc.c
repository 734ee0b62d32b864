/* An in-process broker, as a top-level make starts one, and the calls a
 * make's poll loop leans on: capacity, status, take_grant handing over a
 * free token at once, pending, the non-blocking cancel (with a grant
 * racing it), nothing handed out after an abort, and a connect that never
 * falls back to a classic jobserver, the broker's files removed from a
 * signal handler, and a drain that serves until no make is connected.
 * Runs with no jobserver in its environment. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#ifdef __linux__
#include <dirent.h>
#endif

#include "check.h"

/* For unlink_on_signal: the broker, and what the call returned. */
static herdless_broker *doomed;
static volatile sig_atomic_t unlinked = 1;

/* A fatal-signal handler's cleanup, as a make's. */
static void unlink_on_signal(int sig) {
    (void)sig;
    unlinked = herdless_broker_unlink(doomed);
}

/* Waits (no timeout: the test's harness has one) until c's descriptor is
 * readable, then takes the grant. */
static int wait_grant(herdless_client *c) {
    for (;;) {
        int r = herdless_take_grant(c);
        if (r != -EAGAIN) return r;
        struct pollfd p = {.fd = herdless_fd(c), .events = POLLIN};
        if (poll(&p, 1, -1) < 0 && errno != EINTR) return -errno;
    }
}

/* wait_grant(d), in a poll loop that also watches c, which withdrew a
 * request without waiting for the answer: a grant that raced that
 * withdrawal sits unread in c's socket until c's next call, which c's
 * loop makes when its descriptor turns readable (herdless_pending reads
 * it, and gives such a grant back). */
static int wait_grant_serving(herdless_client *d, herdless_client *c) {
    for (;;) {
        int r = herdless_take_grant(d);
        if (r != -EAGAIN) return r;
        struct pollfd p[2] = {{.fd = herdless_fd(d), .events = POLLIN},
                              {.fd = herdless_fd(c), .events = POLLIN}};
        if (poll(p, 2, -1) < 0 && errno != EINTR) return -errno;
        if (p[1].revents != 0 && herdless_pending(c) < 0) return -EIO;
    }
}

/* The broker's "free" figure, from its status report. */
static long status_field(herdless_client *c, const char *name) {
    char buf[8192];
    int n = herdless_status(c, buf, sizeof buf);
    REQUIRE(n > 0 && (size_t)n < sizeof buf);
    char key[64];
    snprintf(key, sizeof key, "\"%s\":", name);
    const char *at = strstr(buf, key);
    REQUIRE(at != NULL);
    return strtol(at + strlen(key), NULL, 10);
}

/* The threads of this process other than the main one (whose id is the
 * process id; main() calls this), and how many
 * of them block every one of SIGURG, SIGCHLD, SIGINT and SIGTERM (Linux:
 * the SigBlk line of /proc/self/task/TID/status), in *quiet. -1 where
 * /proc cannot be read. */
static int other_threads(int *quiet) {
#ifdef __linux__
    char path[300], line[256];
    int n = 0;
    const unsigned long long want = (1ULL << (SIGURG - 1)) | (1ULL << (SIGCHLD - 1)) |
                                    (1ULL << (SIGINT - 1)) | (1ULL << (SIGTERM - 1));
    DIR *d = opendir("/proc/self/task");
    if (d == NULL) return -1;
    *quiet = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        if (e->d_name[0] == '.' || atoi(e->d_name) == (int)getpid()) continue;
        snprintf(path, sizeof path, "/proc/self/task/%s/status", e->d_name);
        FILE *f = fopen(path, "r");
        if (f == NULL) continue;
        n++;
        while (fgets(line, sizeof line, f) != NULL) {
            if (strncmp(line, "SigBlk:", 7) == 0 &&
                (strtoull(line + 7, NULL, 16) & want) == want)
                (*quiet)++;
        }
        fclose(f);
    }
    closedir(d);
    return n;
#else
    *quiet = 0;
    return -1;
#endif
}

int main(void) {
    /* Bad arguments. */
    errno = 0;
    CHECK(herdless_broker_start(0, 0, NULL) == NULL);
    CHECK_EQ(errno, EINVAL);
    errno = 0;
    CHECK(herdless_broker_start(65537, 0, NULL) == NULL);
    CHECK_EQ(errno, EINVAL);
    errno = 0;
    CHECK(herdless_broker_start(4000000000u, 0, NULL) == NULL);
    CHECK_EQ(errno, EINVAL);
    errno = 0;
    CHECK(herdless_broker_start(4, 64, NULL) == NULL);
    CHECK_EQ(errno, EINVAL);
    errno = 0;
    CHECK(herdless_broker_start(4, 0, "/nonexistent/dir") == NULL);
    CHECK_EQ(errno, ENOENT);
    /* An empty directory name is the default, as NULL: not the current
     * directory. The brokers' private directories share a parent. */
    {
        herdless_broker *e = herdless_broker_start(2, 0, "");
        herdless_broker *n = herdless_broker_start(2, 0, NULL);
        REQUIRE(e != NULL && n != NULL);
        char pe[PATH_MAX], pn[PATH_MAX];
        snprintf(pe, sizeof pe, "%s", herdless_broker_socket(e));
        snprintf(pn, sizeof pn, "%s", herdless_broker_socket(n));
        for (int up = 0; up < 2; up++) {
            char *se = strrchr(pe, '/'), *sn = strrchr(pn, '/');
            REQUIRE(se != NULL && sn != NULL);
            *se = '\0';
            *sn = '\0';
        }
        CHECK(pe[0] == '/');
        CHECK(strcmp(pe, pn) == 0);
        CHECK_EQ(herdless_broker_stop(n, NULL), 0);
        CHECK_EQ(herdless_broker_stop(e, NULL), 0);
    }
    CHECK_EQ(herdless_broker_stop(NULL, NULL), -EINVAL);
    CHECK(herdless_broker_socket(NULL) == NULL);
    CHECK_EQ(herdless_capacity(NULL), -EINVAL);
    CHECK_EQ(herdless_pending(NULL), -EINVAL);
    CHECK_EQ(herdless_cancel_nowait(NULL), -EINVAL);
    CHECK_EQ(herdless_status(NULL, NULL, 0), -EINVAL);

    /* Without a broker, the native-only connect finds nothing, even with
     * a classic jobserver in MAKEFLAGS (which the other connect takes). */
    int fds[2];
    REQUIRE(pipe(fds) == 0);
    char flags[64];
    snprintf(flags, sizeof flags, " -j2 --jobserver-auth=%d,%d", fds[0], fds[1]);
    setenv("MAKEFLAGS", flags, 1);
    errno = 0;
    CHECK(herdless_client_native_from_env() == NULL);
    CHECK_EQ(errno, ENOENT);
    herdless_client *classic = herdless_client_from_env();
    CHECK(classic != NULL);
    CHECK_EQ(herdless_capacity(classic), 1);
    CHECK_EQ(herdless_pending(classic), 0);
    CHECK_EQ(herdless_cancel_nowait(classic), 0);
    char small[8];
    CHECK_EQ(herdless_status(classic, small, sizeof small), -ENOTSUP);
    herdless_client_free(classic);

    /* -j 4 with a classic FIFO for stock makes. */
    herdless_broker *b = herdless_broker_start(4, HERDLESS_BROKER_CLASSIC_FIFO, NULL);
    REQUIRE(b != NULL);
    const char *sock = herdless_broker_socket(b);
    REQUIRE(sock != NULL && getenv("HERDLESS_SOCKET") != NULL);
    CHECK(strcmp(getenv("HERDLESS_SOCKET"), sock) == 0);
    const char *auth = herdless_broker_classic_auth(b);
    REQUIRE(auth != NULL);
    CHECK(strncmp(auth, "fifo:", 5) == 0);
    struct stat st;
    CHECK(stat(auth + 5, &st) == 0 && S_ISFIFO(st.st_mode));
    /* HERDLESS_CLASSIC names that FIFO, so that a sub-make handed another
     * jobserver knows a make lies between. */
    {
        char id[64];
        snprintf(id, sizeof id, "%llu:%llu", (unsigned long long)st.st_dev,
                 (unsigned long long)st.st_ino);
        REQUIRE(getenv("HERDLESS_CLASSIC") != NULL);
        CHECK(strcmp(getenv("HERDLESS_CLASSIC"), id) == 0);
    }
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", herdless_broker_dir(b));

    /* MAKEFLAGS still names the pipe above, not the broker's FIFO: the
     * process that started the broker connects all the same (a child
     * handed that pipe would not: tests/real_make.rs). */
    herdless_client *c = herdless_client_native_from_env();
    REQUIRE(c != NULL);
    CHECK_EQ(herdless_capacity(c), 3);
    /* The broker's threads (its event loop, the death guard of its shared
     * table) take none of the make's signals: a child's SIGCHLD, a
     * hand-off's SIGURG, a SIGINT must run the make's handlers on the
     * make's own thread, and must not wake a thread of the broker. */
    {
        int quiet = 0;
        int threads = other_threads(&quiet);
        if (threads >= 0) {
            CHECK(threads >= 1);
            CHECK_EQ(quiet, threads);
        }
    }
    CHECK_EQ(status_field(c, "jobs"), 4);
    /* Left idle, the broker's thread sleeps in its loop: it has at least
     * that one wake-up to report below. */
    (void)poll(NULL, 0, 50);
    /* Free tokens come at once, with no pass through a poll loop (the
     * bridge had parked them in the FIFO: they are taken back). */
    CHECK_EQ(herdless_take_grant(c), 0);
    CHECK_EQ(herdless_take_grant(c), 0);
    CHECK_EQ(herdless_take_grant(c), 0);
    for (int i = 0; i < 3; i++) CHECK_EQ(herdless_release(c), 0);
    herdless_client_free(c);
    herdless_broker_report rep;
    memset(&rep, 0xff, sizeof rep);
    CHECK_EQ(herdless_broker_stop(b, &rep), 0);
    CHECK_EQ(rep.jobs, 4);
    CHECK_EQ(rep.lost, 0);
    CHECK_EQ(rep.max_in_use, 3);
    CHECK_EQ(rep.aborted, 0);
    /* Every grant was free when asked for: nobody was woken for one. */
    CHECK_EQ(rep.woken, 0);
#if defined(__linux__) || defined(__FreeBSD__) || defined(__OpenBSD__)
    /* The broker's thread slept in its loop (while idle above), and
     * counts only its own sleeps, not this thread's. */
    {
        struct rusage self;
        CHECK_EQ(getrusage(RUSAGE_SELF, &self), 0);
        CHECK(rep.broker_vcsw >= 1);
        CHECK(rep.broker_vcsw <= (int64_t)self.ru_nvcsw);
    }
#else
    CHECK_EQ(rep.broker_vcsw, -1);
#endif
    /* The socket, FIFO and directory are gone; the variables too. */
    CHECK(access(dir, F_OK) != 0);
    CHECK(getenv("HERDLESS_SOCKET") == NULL);
    CHECK(getenv("HERDLESS_CLASSIC") == NULL);

    /* herdless_broker_unlink, as a fatal-signal handler calls it: a forked
     * child removes nothing (nor does its herdless_broker_stop); the started process's handler removes the
     * socket, both FIFOs of a bmake bridge and the directory; the broker
     * still serves the connection it has, and stops as before. */
    CHECK_EQ(herdless_broker_unlink(NULL), -EINVAL);
    doomed = herdless_broker_start(4, HERDLESS_BROKER_CLASSIC_PIPE | HERDLESS_BROKER_BMAKE, NULL);
    REQUIRE(doomed != NULL);
    snprintf(dir, sizeof dir, "%s", herdless_broker_dir(doomed));
    c = herdless_client_native_from_env();
    REQUIRE(c != NULL);
    {
        int st = 0;
        pid_t child = fork();
        REQUIRE(child >= 0);
        if (child == 0) {
            /* Neither call acts for the parent: its socket stays. */
            int ok = herdless_broker_unlink(doomed) == -EPERM &&
                     herdless_broker_stop(doomed, &rep) == -EPERM;
            _exit(ok ? 0 : 1);
        }
        CHECK_EQ(waitpid(child, &st, 0), child);
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    }
    CHECK_EQ(access(dir, F_OK), 0);
    {
        /* The broker still serves new connections after the fork's calls. */
        herdless_client *d = herdless_client_native_from_env();
        CHECK(d != NULL);
        if (d != NULL) {
            CHECK_EQ(herdless_capacity(d), 3);
            herdless_client_free(d);
        }
    }
    {
        struct sigaction act;
        memset(&act, 0, sizeof act);
        act.sa_handler = unlink_on_signal;
        sigemptyset(&act.sa_mask);
        REQUIRE(sigaction(SIGUSR1, &act, NULL) == 0);
        REQUIRE(raise(SIGUSR1) == 0);
    }
    CHECK_EQ(unlinked, 0);
    CHECK(access(dir, F_OK) != 0);
    CHECK_EQ(herdless_take_grant(c), 0);
    CHECK_EQ(herdless_release(c), 0);
    herdless_client_free(c);
    CHECK_EQ(herdless_broker_stop(doomed, &rep), 0);
    CHECK_EQ(rep.lost, 0);
    CHECK_EQ(rep.native_grants, 1);
    CHECK(getenv("HERDLESS_SOCKET") == NULL);

    /* A connection begun before it is needed, as a sub-make begins one
     * before it reads its makefiles, and finished later. */
    CHECK(herdless_connect_begin() == NULL);
    CHECK_EQ(errno, ENOENT);
    errno = 0;
    CHECK(herdless_connect_finish(NULL) == NULL);
    CHECK_EQ(errno, EINVAL);
    herdless_connect_abandon(NULL);
    b = herdless_broker_start(4, 0, NULL);
    REQUIRE(b != NULL);
    {
        herdless_connecting *p = herdless_connect_begin();
        REQUIRE(p != NULL);
        herdless_client *e = herdless_connect_finish(p);
        REQUIRE(e != NULL);
        CHECK_EQ(herdless_capacity(e), 3);
        CHECK_EQ(herdless_take_grant(e), 0);
        CHECK_EQ(status_field(e, "in_use"), 1);
        CHECK_EQ(herdless_release(e), 0);
        /* Abandoned: the broker forgets it, and it holds nothing. */
        herdless_connecting *q = herdless_connect_begin();
        REQUIRE(q != NULL);
        herdless_connect_abandon(q);
        /* Finished after HERDLESS_SOCKET went away: nothing to use. */
        char *saved = strdup(getenv("HERDLESS_SOCKET"));
        REQUIRE(saved != NULL);
        q = herdless_connect_begin();
        REQUIRE(q != NULL);
        unsetenv("HERDLESS_SOCKET");
        errno = 0;
        CHECK(herdless_connect_finish(q) == NULL);
        CHECK_EQ(errno, ENOENT);
        setenv("HERDLESS_SOCKET", saved, 1);
        free(saved);
        /* Begun, then the broker stops before the answer is read: finish
         * fails and holds nothing. */
        q = herdless_connect_begin();
        REQUIRE(q != NULL);
        CHECK_EQ(herdless_take_grant(e), 0);
        herdless_client_free(e);
        CHECK_EQ(herdless_broker_stop(b, &rep), 0);
        CHECK_EQ(rep.lost, 0);
        CHECK_EQ(rep.native_grants, 2);
        errno = 0;
        CHECK(herdless_connect_finish(q) == NULL);
        CHECK(errno != 0);
    }

    /* The rest, natives only: a classic bridge keeps an offer in its FIFO
     * for classic clients while natives wait, which these exact checks
     * would have to account for. */
    b = herdless_broker_start(4, 0, NULL);
    REQUIRE(b != NULL);
    CHECK(herdless_broker_classic_auth(b) == NULL);
    c = herdless_client_native_from_env();
    herdless_client *d = herdless_client_native_from_env();
    REQUIRE(c != NULL && d != NULL);
    CHECK_EQ(herdless_pending(c), 0);
    CHECK_EQ(herdless_take_grant(c), 0);
    CHECK_EQ(herdless_take_grant(c), 0);
    CHECK_EQ(herdless_take_grant(c), 0);
    CHECK_EQ(herdless_pending(c), 0);
    /* The pool is empty: the next one queues. */
    CHECK_EQ(herdless_take_grant(c), -EAGAIN);
    CHECK_EQ(herdless_pending(c), 1);
    CHECK_EQ(herdless_take_grant(c), -EAGAIN); /* still the same request */
    CHECK_EQ(status_field(c, "waiting"), 1);

    /* Withdrawn without waiting: d queues behind it and gets the next
     * release, which would have gone to c had c's request stayed. */
    CHECK_EQ(herdless_cancel_nowait(c), 0);
    CHECK_EQ(herdless_take_grant(d), -EAGAIN);
    CHECK_EQ(herdless_release(c), 0);
    CHECK_EQ(wait_grant(d), 0);
    CHECK_EQ(herdless_pending(c), 0);

    /* A grant that races the withdrawal goes back at c's next call: c
     * queues, d releases (the grant may be on its way to c), c withdraws
     * at once. d then queues and must get that token back, never stall,
     * while c's loop watches its descriptor (as a make's does). Waiting
     * on d alone stalled about one run in 2,000 under load: the broker
     * had granted c between c's last read and its cancel, and the grant
     * sat in c's socket. */
    CHECK_EQ(herdless_take_grant(c), -EAGAIN);
    CHECK_EQ(herdless_release(d), 0);
    CHECK_EQ(herdless_cancel_nowait(c), 0);
    CHECK_EQ(wait_grant_serving(d, c), 0);
    /* Both ways round: the grant already arrived before the withdrawal. */
    CHECK_EQ(herdless_take_grant(c), -EAGAIN);
    CHECK_EQ(herdless_release(d), 0);
    {
        struct pollfd p = {.fd = herdless_fd(c), .events = POLLIN};
        CHECK_EQ(poll(&p, 1, -1), 1);
    }
    CHECK_EQ(herdless_pending(c), 1);
    CHECK_EQ(herdless_cancel_nowait(c), 0);
    CHECK_EQ(herdless_pending(c), 0);
    CHECK_EQ(wait_grant(d), 0);
    /* c holds 2, d holds 1: nothing idles anywhere. */
    CHECK_EQ(status_field(d, "in_use"), 3);
    CHECK_EQ(status_field(d, "free"), 0);

    /* request_grant never waits for the broker: with a token free it
     * returns -EAGAIN, and the grant makes the descriptor readable; or,
     * once the broker has lent the released token to the shared table, it
     * takes it from there at once. */
    CHECK_EQ(herdless_release(d), 0);
    int requested = herdless_request_grant(d);
    if (requested == -EAGAIN) {
        /* Asked again: still the one request, whose grant may have come
         * in the meantime. */
        int again = herdless_request_grant(d);
        if (again == -EAGAIN) {
            struct pollfd p = {.fd = herdless_fd(d), .events = POLLIN};
            CHECK_EQ(poll(&p, 1, -1), 1);
            CHECK_EQ(herdless_request_grant(d), 0);
        } else {
            CHECK_EQ(again, 0);
        }
    } else {
        CHECK_EQ(requested, 0);
    }
    CHECK_EQ(herdless_pending(d), 0);
    CHECK_EQ(status_field(d, "in_use"), 3);

    /* No grant is handed out after an abort, even one that arrived first:
     * c queues, d releases (the grant reaches c), d aborts. */
    CHECK_EQ(herdless_take_grant(c), -EAGAIN);
    CHECK_EQ(herdless_release(d), 0);
    {
        struct pollfd p = {.fd = herdless_fd(c), .events = POLLIN};
        CHECK_EQ(poll(&p, 1, -1), 1);
    }
    CHECK_EQ(herdless_abort(d, 'E'), 0);
    /* The abort reaches c after the grant: wait for it. */
    while (herdless_aborted(c) == 0) {
        struct pollfd p = {.fd = herdless_fd(c), .events = POLLIN};
        poll(&p, 1, -1);
    }
    CHECK_EQ(herdless_take_grant(c), -ECANCELED);
    CHECK_EQ(herdless_cancel(c), -ECANCELED);
    CHECK_EQ(herdless_try_acquire(c), -ECANCELED);
    CHECK_EQ(herdless_acquire(c, 0), -ECANCELED);
    CHECK_EQ(herdless_pending(c), 0);
    CHECK_EQ(herdless_cancel_nowait(c), 0);
    CHECK_EQ(herdless_release(c), 0);
    CHECK_EQ(herdless_release(c), 0);
    herdless_client_free(c);
    herdless_client_free(d);

    memset(&rep, 0xff, sizeof rep);
    CHECK_EQ(herdless_broker_stop(b, &rep), 0);
    CHECK_EQ(rep.lost, 0);
    CHECK_EQ(rep.max_in_use, 3);
    CHECK(rep.native_grants >= 8);
    CHECK_EQ(rep.classic_offered, 0);
    CHECK_EQ(rep.aborted, 'E');
    /* d waited for its grant above, and c for the one the abort beat. */
    CHECK(rep.woken >= 1);
    CHECK(rep.woken <= rep.native_grants);

    /* A pipe-style bridge for bmakes: R,W open without close-on-exec. */
    b = herdless_broker_start(3, HERDLESS_BROKER_CLASSIC_PIPE | HERDLESS_BROKER_BMAKE, "/tmp");
    REQUIRE(b != NULL);
    int r = -1, w = -1;
    CHECK(strncmp(herdless_broker_dir(b), "/tmp/herdless-", 14) == 0);
    CHECK_EQ(sscanf(herdless_broker_classic_auth(b), "%d,%d", &r, &w), 2);
    CHECK(fcntl(r, F_GETFD) == 0 && fcntl(w, F_GETFD) == 0);
    CHECK_EQ(herdless_broker_stop(b, NULL), 0);
    CHECK(fcntl(r, F_GETFD) < 0 && errno == EBADF);

    /* Descriptors kept for the caller: a new client of another process is
     * turned away at once, once (no retry, with the table or without),
     * with EMFILE, by either connect; the caller's own connection is not.
     * With nothing kept, the same child connects. Keeping as many as the
     * soft limit leaves no room under any limit. */
    CHECK_EQ(herdless_broker_keep_fds(NULL, 1), -EINVAL);
    CHECK(HERDLESS_BROKER_FDS >= 8);
    b = herdless_broker_start(4, HERDLESS_BROKER_CLASSIC_PIPE | HERDLESS_BROKER_BMAKE, NULL);
    REQUIRE(b != NULL);
    struct rlimit nofile;
    REQUIRE(getrlimit(RLIMIT_NOFILE, &nofile) == 0);
    unsigned keep_all = nofile.rlim_cur < UINT_MAX ? (unsigned)nofile.rlim_cur : UINT_MAX;
    CHECK_EQ(herdless_broker_keep_fds(b, keep_all), 0);
    c = herdless_client_native_from_env();
    REQUIRE(c != NULL);
    CHECK_EQ(herdless_take_grant(c), 0);
    for (int kept = 1; kept >= 0; kept--) {
        if (!kept)
            CHECK_EQ(herdless_broker_keep_fds(b, 0), 0);
        int st = 0;
        pid_t child = fork();
        REQUIRE(child >= 0);
        if (child == 0) {
            errno = 0;
            herdless_client *x = herdless_client_native_from_env();
            int e1 = errno;
            /* The broker turns a connection away as it accepts it: when
             * that comes before the hello is sent, herdless_connect_begin
             * reads the reason and fails itself. */
            errno = 0;
            herdless_connecting *p = herdless_connect_begin();
            int e2 = errno;
            herdless_client *y = NULL;
            if (p != NULL) {
                y = herdless_connect_finish(p);
                e2 = errno;
            }
            /* Each condition that fails sets its own bit of the status. */
            if (kept)
                _exit((x == NULL ? 0 : 1) | (e1 == EMFILE ? 0 : 2) | (y == NULL ? 0 : 4) |
                      (e2 == EMFILE ? 0 : 8));
            _exit((x != NULL ? 0 : 16) | (y != NULL ? 0 : 32));
        }
        CHECK_EQ(waitpid(child, &st, 0), child);
        CHECK(WIFEXITED(st));
        CHECK_EQ(WEXITSTATUS(st), 0);
    }
    CHECK_EQ(herdless_release(c), 0);
    herdless_client_free(c);
    memset(&rep, 0xff, sizeof rep);
    CHECK_EQ(herdless_broker_stop(b, &rep), 0);
    CHECK_EQ(rep.no_room, 2);
    CHECK_EQ(rep.lost, 0);

    /* herdless_broker_drain: the broker serves until no job runner is
     * connected. A child connects, asks for a token only after the drain
     * has begun, holds it a while and exits; the drain returns only after
     * that, and the child got its token. */
    CHECK_EQ(herdless_broker_drain(NULL), -EINVAL);
    b = herdless_broker_start(4, 0, NULL);
    REQUIRE(b != NULL);
    {
        int ready[2], leaving[2];
        REQUIRE(pipe(ready) == 0 && pipe(leaving) == 0);
        pid_t child = fork();
        REQUIRE(child >= 0);
        if (child == 0) {
            herdless_client *x = herdless_client_native_from_env();
            char one = 1;
            if (x == NULL || write(ready[1], &one, 1) != 1)
                _exit(1);
            (void)poll(NULL, 0, 200);
            int r = herdless_acquire(x, 5000);
            (void)poll(NULL, 0, 200);
            if (r == 0)
                r = herdless_release(x);
            /* Said before the connection closes. */
            one = r == 0 ? 'y' : 'n';
            if (write(leaving[1], &one, 1) != 1)
                _exit(3);
            herdless_client_free(x);
            _exit(r == 0 ? 0 : 2);
        }
        char one;
        REQUIRE(read(ready[0], &one, 1) == 1);
        CHECK_EQ(herdless_broker_drain(b), 0);
        /* The drain returned only once the child's connection closed, so
         * what it wrote before is there to read without waiting. */
        REQUIRE(fcntl(leaving[0], F_SETFL, O_NONBLOCK) == 0);
        CHECK_EQ(read(leaving[0], &one, 1), 1);
        CHECK_EQ(one, 'y');
        int st = 0;
        CHECK_EQ(waitpid(child, &st, 0), child);
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
        CHECK_EQ(herdless_broker_drain(b), -EALREADY);
        close(ready[0]);
        close(ready[1]);
        close(leaving[0]);
        close(leaving[1]);
    }
    memset(&rep, 0xff, sizeof rep);
    CHECK_EQ(herdless_broker_stop(b, &rep), 0);
    CHECK_EQ(rep.lost, 0);
    CHECK_EQ(rep.native_grants, 1);
    CHECK(getenv("HERDLESS_SOCKET") == NULL);

    return check_done("inproc");
}
