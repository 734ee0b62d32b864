/* Feeds every function of the C ABI bad arguments and checks the codes:
 * NULL handles, bad socket paths, no jobserver in the environment, double
 * release, release without a token, bad timeouts and abort reasons, and
 * what every call says after an abort.
 *
 * Run under `herdless run -j 2` (one shared token). Prints "errors: ok". */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"

/* The signatures, exactly as the API was specified: a mismatch in the
 * header is a compile error here (-Werror). */
static herdless_client *(*const sig_from_env)(void) = herdless_client_from_env;
static herdless_client *(*const sig_connect)(const char *) =
    herdless_client_connect;
static int (*const sig_acquire)(herdless_client *, int) = herdless_acquire;
static int (*const sig_try_acquire)(herdless_client *) = herdless_try_acquire;
static int (*const sig_release)(herdless_client *) = herdless_release;
static int (*const sig_fd)(const herdless_client *) = herdless_fd;
static int (*const sig_take_grant)(herdless_client *) = herdless_take_grant;
static int (*const sig_abort)(herdless_client *, char) = herdless_abort;
static int (*const sig_aborted)(const herdless_client *) = herdless_aborted;
static void (*const sig_free)(herdless_client *) = herdless_client_free;
static const char *(*const sig_strerror)(int) = herdless_strerror;
static int (*const sig_cancel)(herdless_client *) = herdless_cancel;

static void signatures(void) {
    CHECK(sig_from_env && sig_connect && sig_acquire && sig_try_acquire &&
          sig_release && sig_fd && sig_take_grant && sig_abort &&
          sig_aborted && sig_free && sig_strerror && sig_cancel);
    CHECK_EQ(HERDLESS_WAIT_FOREVER, -1);
}

static void null_handles(void) {
    CHECK_EQ(herdless_acquire(NULL, -1), -EINVAL);
    CHECK_EQ(herdless_acquire(NULL, 0), -EINVAL);
    CHECK_EQ(herdless_try_acquire(NULL), -EINVAL);
    CHECK_EQ(herdless_release(NULL), -EINVAL);
    CHECK_EQ(herdless_fd(NULL), -EINVAL);
    CHECK_EQ(herdless_take_grant(NULL), -EINVAL);
    CHECK_EQ(herdless_cancel(NULL), -EINVAL);
    CHECK_EQ(herdless_abort(NULL, 'E'), -EINVAL);
    CHECK_EQ(herdless_aborted(NULL), -EINVAL);
    CHECK_EQ(herdless_implicit_token(NULL), -EINVAL);
    herdless_client_free(NULL);
}

static void strerror_always_answers(void) {
    static const int codes[] = {0,          -EINVAL,   -ETIMEDOUT, -EAGAIN,
                                -EINTR,     -ECONNRESET, -ECANCELED, -ENOENT,
                                EINVAL,     -9999,     INT_MAX,    INT_MIN,
                                -ENOTRECOVERABLE};
    for (size_t i = 0; i < sizeof codes / sizeof codes[0]; i++) {
        const char *s = herdless_strerror(codes[i]);
        CHECK(s != NULL && s[0] != '\0');
    }
    CHECK(strcmp(herdless_strerror(-EINVAL), herdless_strerror(EINVAL)) == 0);
    CHECK(strstr(herdless_strerror(-ECANCELED), "abort") != NULL);
}

/* A constructor that must fail: NULL, and errno is want. */
#define CHECK_NO_CLIENT(call, want)          \
    do {                                     \
        errno = 0;                           \
        herdless_client *c_ = (call);        \
        CHECK(c_ == NULL);                   \
        CHECK_EQ(errno, (want));             \
        herdless_client_free(c_);            \
    } while (0)

static void bad_connections(const char *regular_file) {
    char long_path[300];
    memset(long_path, 'x', sizeof long_path - 1);
    long_path[0] = '/';
    long_path[sizeof long_path - 1] = '\0';

    CHECK_NO_CLIENT(herdless_client_connect(NULL), EINVAL);
    CHECK_NO_CLIENT(herdless_client_connect(""), EINVAL);
    CHECK_NO_CLIENT(herdless_client_connect("/nonexistent/herdless/socket"),
                    ENOENT);
    CHECK_NO_CLIENT(herdless_client_connect(long_path), ENAMETOOLONG);
    /* Exists, but nobody listens: not a socket at all. */
    CHECK_NO_CLIENT(herdless_client_connect(regular_file), ECONNREFUSED);

    /* No jobserver in the environment: neither a broker nor a classic
     * jobserver (herdless run may name its classic bridge too). */
    const char *saved = getenv("HERDLESS_SOCKET");
    REQUIRE(saved != NULL);
    char *socket = strdup(saved);
    REQUIRE(socket != NULL);
    static const char *const classic[] = {"MAKEFLAGS", "MFLAGS",
                                          "CARGO_MAKEFLAGS"};
    char *classic_saved[3];
    for (int i = 0; i < 3; i++) {
        const char *v = getenv(classic[i]);
        classic_saved[i] = v ? strdup(v) : NULL;
        REQUIRE(unsetenv(classic[i]) == 0);
    }
    REQUIRE(unsetenv("HERDLESS_SOCKET") == 0);
    CHECK_NO_CLIENT(herdless_client_from_env(), ENOENT);
    REQUIRE(setenv("HERDLESS_SOCKET", "", 1) == 0);
    CHECK_NO_CLIENT(herdless_client_from_env(), ENOENT);
    REQUIRE(setenv("HERDLESS_SOCKET", "/nonexistent/herdless/socket", 1) == 0);
    CHECK_NO_CLIENT(herdless_client_from_env(), ENOENT);
    REQUIRE(setenv("HERDLESS_SOCKET", socket, 1) == 0);
    for (int i = 0; i < 3; i++) {
        if (classic_saved[i]) {
            REQUIRE(setenv(classic[i], classic_saved[i], 1) == 0);
            free(classic_saved[i]);
        }
    }

    /* The real socket works by path too. */
    herdless_client *c = herdless_client_connect(socket);
    CHECK(c != NULL);
    herdless_client_free(c);
    free(socket);

    /* Connect flags: an unknown bit is refused. With no make above
     * (MAKELEVEL unset), a sub-make's connection owns its implicit token
     * outright: there is nothing to borrow, and nothing is held. */
    CHECK_NO_CLIENT(herdless_client_native_from_env_as(2), EINVAL);
    errno = 0;
    CHECK(herdless_connect_begin_as(~0u) == NULL);
    CHECK_EQ(errno, EINVAL);
    const char *level = getenv("MAKELEVEL");
    char *level_saved = level ? strdup(level) : NULL;
    REQUIRE(unsetenv("MAKELEVEL") == 0);
    c = herdless_client_native_from_env_as(HERDLESS_AS_SUB_MAKE);
    REQUIRE(c != NULL);
    CHECK_EQ(herdless_implicit_token(c), 0);
    CHECK_EQ(herdless_implicit_token(c), 0);
    CHECK_EQ(herdless_release(c), -EINVAL);
    herdless_client_free(c);
    herdless_connecting *p = herdless_connect_begin_as(HERDLESS_AS_SUB_MAKE);
    REQUIRE(p != NULL);
    c = herdless_connect_finish(p);
    REQUIRE(c != NULL);
    CHECK_EQ(herdless_implicit_token(c), 0);
    herdless_client_free(c);
    if (level_saved) {
        REQUIRE(setenv("MAKELEVEL", level_saved, 1) == 0);
        free(level_saved);
    }
}

static void token_misuse(herdless_client *c) {
    CHECK(herdless_fd(c) >= 0);
    CHECK_EQ(herdless_aborted(c), 0);

    /* Release without a token: refused, and the connection still works. */
    CHECK_EQ(herdless_release(c), -EINVAL);
    CHECK_EQ(herdless_release(c), -EINVAL);

    CHECK_EQ(herdless_acquire(c, -2), -EINVAL);
    CHECK_EQ(herdless_acquire(c, INT_MIN), -EINVAL);

    CHECK_EQ(herdless_acquire(c, HERDLESS_WAIT_FOREVER), 0);
    CHECK_EQ(herdless_release(c), 0);
    CHECK_EQ(herdless_release(c), -EINVAL); /* double release */

    /* -j 2: one shared token. */
    CHECK_EQ(herdless_try_acquire(c), 0);
    CHECK_EQ(herdless_try_acquire(c), -EAGAIN);
    CHECK_EQ(herdless_acquire(c, 0), -ETIMEDOUT);
    CHECK_EQ(herdless_acquire(c, 1), -ETIMEDOUT);
    CHECK_EQ(herdless_cancel(c), 0); /* nothing pending */
    CHECK_EQ(herdless_release(c), 0);
    CHECK_EQ(herdless_release(c), -EINVAL);

    /* The timed-out requests were withdrawn: the token is free. */
    CHECK_EQ(herdless_try_acquire(c), 0);
    CHECK_EQ(herdless_release(c), 0);

    /* A second handle counts its own tokens. */
    herdless_client *d = herdless_client_from_env();
    REQUIRE(d != NULL);
    CHECK_EQ(herdless_acquire(c, -1), 0);
    CHECK_EQ(herdless_release(d), -EINVAL);
    CHECK_EQ(herdless_release(c), 0);
    herdless_client_free(d);

    CHECK_EQ(herdless_abort(c, 'X'), -EINVAL);
    CHECK_EQ(herdless_abort(c, 'e'), -EINVAL);
    CHECK_EQ(herdless_abort(c, 0), -EINVAL);
    CHECK_EQ(herdless_abort(c, (char)0xC5), -EINVAL);
    CHECK_EQ(herdless_aborted(c), 0);
}

static void after_abort(herdless_client *c) {
    herdless_client *other = herdless_client_from_env();
    REQUIRE(other != NULL);
    CHECK_EQ(herdless_acquire(c, -1), 0); /* held across the abort */

    CHECK_EQ(herdless_abort(c, 'I'), 0);
    /* The abort reaches every client; a wait ends with it. */
    CHECK_EQ(herdless_acquire(other, -1), -ECANCELED);
    CHECK_EQ(herdless_aborted(other), 'I');
    CHECK_EQ(herdless_acquire(c, -1), -ECANCELED);
    CHECK_EQ(herdless_aborted(c), 'I');
    CHECK_EQ(herdless_try_acquire(c), -ECANCELED);
    CHECK_EQ(herdless_take_grant(c), -ECANCELED);
    /* The first reason wins. */
    CHECK_EQ(herdless_abort(other, 'E'), 0);
    CHECK_EQ(herdless_aborted(c), 'I');
    /* The token held before the abort can still be given back, once. */
    CHECK_EQ(herdless_release(c), 0);
    CHECK_EQ(herdless_release(c), -EINVAL);
    herdless_client_free(other);
}

/* With one descriptor free: herdless_fds_free counts it, and the native
 * connects refuse with EMFILE, leaving it to the program. */
static void short_of_descriptors(void) {
    struct rlimit saved, tight;
    int lowest = open("/dev/null", O_RDONLY);
    REQUIRE(lowest >= 0);
    close(lowest);
    REQUIRE(getrlimit(RLIMIT_NOFILE, &saved) == 0);
    tight = saved;
    tight.rlim_cur = (rlim_t)lowest + 1;
    REQUIRE(setrlimit(RLIMIT_NOFILE, &tight) == 0);
    int one = herdless_fds_free(1), two = herdless_fds_free(2);
    errno = 0;
    herdless_client *c = herdless_client_native_from_env();
    int native_errno = errno;
    errno = 0;
    herdless_connecting *begun = herdless_connect_begin();
    int begin_errno = errno;
    REQUIRE(setrlimit(RLIMIT_NOFILE, &saved) == 0);
    CHECK_EQ(one, 1);
    CHECK_EQ(two, 0);
    CHECK(c == NULL);
    CHECK_EQ(native_errno, EMFILE);
    CHECK(begun == NULL);
    CHECK_EQ(begin_errno, EMFILE);
    herdless_client_free(c);
    herdless_connect_abandon(begun);
    CHECK(strstr(herdless_strerror(-EMFILE), "descriptors") != NULL);
    /* With room, they connect. */
    CHECK_EQ(herdless_fds_free(HERDLESS_FD_HEADROOM), 1);
    c = herdless_client_native_from_env();
    CHECK(c != NULL);
    herdless_client_free(c);
}

/* Started with stdin and stderr closed, a process connects: the
 * connection must not take descriptor 0 or 2 (its stderr messages would
 * go to the broker), which now hold /dev/null. In a child, whose checks
 * come back as its exit status (its stderr is gone). */
static int closed_streams_child(void) {
    struct stat null_st, st;
    if (close(0) != 0 || close(2) != 0)
        return 10;
    herdless_client *c = herdless_client_from_env();
    if (c == NULL)
        return 11;
    if (herdless_fd(c) <= 2)
        return 12;
    if (stat("/dev/null", &null_st) != 0)
        return 13;
    for (int fd = 0; fd <= 2; fd += 2) {
        if (fstat(fd, &st) != 0)
            return 14;
        if (st.st_rdev != null_st.st_rdev || !S_ISCHR(st.st_mode))
            return 15;
    }
    herdless_client_free(c);
    return herdless_open_standard_fds() == 0 ? 0 : 16;
}

static void closed_standard_streams(void) {
    CHECK_EQ(herdless_open_standard_fds(), 0);
    fflush(NULL);
    pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0)
        _exit(closed_streams_child());
    int status;
    REQUIRE(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status));
    CHECK_EQ(WEXITSTATUS(status), 0);
}

int main(int argc, char **argv) {
    (void)argc;
    signatures();
    null_handles();
    strerror_always_answers();
    bad_connections(argv[0]);
    short_of_descriptors();
    closed_standard_streams();

    herdless_client *c = herdless_client_from_env();
    REQUIRE(c != NULL);
    token_misuse(c);
    after_abort(c);
    herdless_client_free(c);
    return check_done("errors");
}
