/* A miniature make: runs JOBS jobs (argv[1], default 40), as many at once
 * as its job slots allow, the way a sub-make under a jobserver does.
 *
 * Slots: its own implicit one, which never goes to the broker, plus one
 * herdless token per further job. It waits in one poll() on herdless_fd
 * and on a pipe from each running job (each job writes a line and exits;
 * end-of-file on its pipe means it is done), never in a blocking acquire:
 * a token is taken with herdless_take_grant when the fd is readable.
 * When a job that ran on a token ends, the token goes back at once, as
 * GNU make does; when the implicit job ends, the slot is free again.
 *
 * Prints "minimake: jobs N max M tokens T" on stdout: N jobs finished,
 * at most M ran at once, T tokens taken from the broker. */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <poll.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"

#define MAX_JOBS 1000

struct job {
    pid_t pid;
    int fd;        /* read end of the job's output pipe; -1 when done */
    int on_token;  /* 1: runs on a herdless token; 0: on the implicit slot */
};

static struct job jobs[MAX_JOBS];

static void die(const char *what, int code) {
    fprintf(stderr, "minimake: %s: %s\n", what,
            code < 0 ? herdless_strerror(code) : strerror(code));
    exit(2);
}

/* The job itself: a child that works a little and reports on its pipe. */
static void run_job(int n, int out) {
    struct timespec work = {0, 100 * 1000 * 1000};
    while (nanosleep(&work, &work) != 0 && errno == EINTR) {
    }
    char line[32];
    int len = snprintf(line, sizeof line, "job %d done\n", n);
    if (write(out, line, (size_t)len) != len) _exit(1);
    _exit(0);
}

static void start_job(int n, int on_token) {
    int p[2];
    if (pipe(p) != 0) die("pipe", errno);
    pid_t pid = fork();
    if (pid < 0) die("fork", errno);
    if (pid == 0) {
        /* The child never touches the parent's herdless handle. */
        close(p[0]);
        run_job(n, p[1]);
    }
    close(p[1]);
    jobs[n].pid = pid;
    jobs[n].fd = p[0];
    jobs[n].on_token = on_token;
}

/* Reads from a job's pipe; returns 1 when the job has finished. */
static int job_output(int n) {
    char buf[64];
    ssize_t got = read(jobs[n].fd, buf, sizeof buf);
    if (got < 0 && errno == EINTR) return 0;
    if (got < 0) die("read", errno);
    if (got > 0) return 0;
    close(jobs[n].fd);
    jobs[n].fd = -1;
    int status;
    while (waitpid(jobs[n].pid, &status, 0) < 0) {
        if (errno != EINTR) die("waitpid", errno);
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "minimake: job %d failed\n", n);
        exit(2);
    }
    return 1;
}

int main(int argc, char **argv) {
    int total = argc > 1 ? atoi(argv[1]) : 40;
    REQUIRE(total > 0 && total <= MAX_JOBS);

    herdless_client *c = herdless_client_from_env();
    if (c == NULL) die("herdless_client_from_env", errno);
    int hfd = herdless_fd(c);
    if (hfd < 0) die("herdless_fd", hfd);

    int started = 0, finished = 0, running = 0, most = 0, taken = 0;
    int implicit_free = 1, held = 0, waiting_for_grant = 0;
    static struct pollfd fds[MAX_JOBS + 1];
    static int fd_job[MAX_JOBS + 1];

    while (finished < total) {
        /* Start every job the slots allow. */
        while (started < total) {
            int on_token;
            if (implicit_free) {
                implicit_free = 0;
                on_token = 0;
            } else {
                int r = herdless_take_grant(c);
                if (r == -EAGAIN) {
                    waiting_for_grant = 1; /* hfd turns readable */
                    break;
                }
                if (r != 0) die("herdless_take_grant", r);
                waiting_for_grant = 0;
                on_token = 1;
                held++;
                taken++;
            }
            start_job(started++, on_token);
            running++;
            if (running > most) most = running;
            /* Never more jobs than slots. */
            CHECK_EQ(running, held + !implicit_free);
        }
        if (started == total && waiting_for_grant) {
            /* Nothing left to start: the queued request would only keep a
             * token idle here. */
            int r = herdless_cancel(c);
            if (r < 0) die("herdless_cancel", r);
            if (r == 1) CHECK_EQ(herdless_release(c), 0);
            waiting_for_grant = 0;
        }

        int n = 0;
        if (waiting_for_grant) {
            fds[n].fd = hfd;
            fds[n].events = POLLIN;
            fd_job[n++] = -1;
        }
        for (int j = 0; j < started; j++) {
            if (jobs[j].fd < 0) continue;
            fds[n].fd = jobs[j].fd;
            fds[n].events = POLLIN;
            fd_job[n++] = j;
        }
        REQUIRE(n > 0);
        if (poll(fds, (nfds_t)n, -1) < 0) {
            if (errno == EINTR) continue;
            die("poll", errno);
        }
        for (int i = 0; i < n; i++) {
            int j = fd_job[i];
            if (j < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) {
                continue; /* a grant is taken at the top of the loop */
            }
            if (!job_output(j)) continue;
            finished++;
            running--;
            if (jobs[j].on_token) {
                CHECK_EQ(herdless_release(c), 0);
                held--;
            } else {
                implicit_free = 1;
            }
        }
    }

    CHECK_EQ(held, 0);
    CHECK_EQ(herdless_release(c), -EINVAL); /* nothing left to give back */
    CHECK_EQ(herdless_aborted(c), 0);
    herdless_client_free(c);
    printf("minimake: jobs %d max %d tokens %d\n", finished, most, taken);
    return check_done("minimake");
}
