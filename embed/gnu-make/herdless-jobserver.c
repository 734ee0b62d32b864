/* GNU make 4.4.1's jobserver on herdless.
 *
 * GNU make reaches its jobserver only through the jobserver_* functions
 * declared in src/os.h (defined in src/posixos.c). This file is linked
 * with `-Wl,--wrap=jobserver_<name>` for each of them, so every call from
 * make's other files lands here; the stock functions stay reachable as
 * __real_jobserver_<name>. make's own sources are not changed.
 *
 * Modes (the environment variable HERDLESS_MAKE):
 *   unset or "auto"  a sub-make whose environment names a broker
 *                    (HERDLESS_SOCKET) takes its tokens from it, unless
 *                    the jobserver in its MAKEFLAGS is not the broker's
 *                    own (HERDLESS_CLASSIC): a stock make's -jN group lies
 *                    between, whose limit it keeps to; a make
 *                    started with -jN (a new jobserver group, the top of a
 *                    tree) starts a broker inside this process, with a
 *                    classic FIFO for stock sub-makes, cargo and gcc;
 *                    anything else is stock.
 *   "client"         as auto, but never starts a broker: a top-level -jN
 *                    makes the stock pipe or FIFO.
 *   "stock"          never herdless: the stock jobserver throughout.
 * `--jobserver-style=pipe` (for stock clients that read only a pipe:
 * GNU make before 4.4, gcc before 13's lto-wrapper) gives the broker a
 * classic pipe instead of its FIFO, handed to the recursive recipes only,
 * with `-2,-2` in the others' MAKEFLAGS, as stock make's pipe is.
 *
 * Either way the classic side stays stock-compatible: stock sub-makes get
 * --jobserver-auth in MAKEFLAGS as before (the broker's FIFO for a group
 * this make started, or the one this make was given), and their tokens
 * come from the same pool.
 *
 * The implicit token stays make's own (a make is a job runner): GNU make
 * never asks for a token
 * while no job of its runs (jobserver_tokens == 0), and gives one back
 * only when the job that ends is not its last. That maps one to one onto
 * herdless_request_grant / herdless_release, which deal in shared tokens
 * only. Its jobs get HERDLESS_SLOT (herdless_slot_env), so that a
 * `herdless exec` in a recipe borrows this make's slot.
 *
 * HERDLESS_MAKE_STATS=FILE: a make that started a broker appends one line
 * to FILE when it stops it: "jobs J native_grants G classic_offered C
 * max_in_use M reclaimed R lost L woken W broker_vcsw V moved X
 * no_room Y" (W: grants to a make that waited for them; V: the broker
 * thread's own wake-ups, -1 where not counted; X: waits moved from the
 * shared table to the broker's queue; Y: sub-makes turned away to keep
 * this make's descriptors, which ran on the classic FIFO). For tests and
 * benchmarks.
 */

#include "makeint.h"
#include "os.h"
#include "variable.h"
#include "debug.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/select.h>
#include <unistd.h>

#include "herdless.h"

/* The stock functions, reached through the linker's --wrap. */
unsigned int __real_jobserver_enabled (void);
unsigned int __real_jobserver_setup (int slots, const char *style);
unsigned int __real_jobserver_parse_auth (const char *auth);
char *__real_jobserver_get_auth (void);
const char *__real_jobserver_get_invalid_auth (void);
void __real_jobserver_clear (void);
unsigned int __real_jobserver_acquire_all (void);
void __real_jobserver_release (int is_fatal);
void __real_jobserver_signal (void);
void __real_jobserver_pre_child (int recursive);
void __real_jobserver_post_child (int recursive);
void __real_jobserver_pre_acquire (void);
unsigned int __real_jobserver_acquire (int timeout);
void __real_reap_children (int block, int err);

/* Non-NULL: this make takes its tokens from herdless. */
static herdless_client *hl;
/* The process that connected hl (not a forked child). */
static pid_t hl_pid;
/* The broker this make started for its group, if any. */
static herdless_broker *broker;
/* The pool's size when this make started the broker. */
static unsigned int broker_slots;
/* The process that owns the broker (not a forked child). */
static pid_t broker_pid;
/* The broker's classic pipe (`--jobserver-style=pipe`), R and W; -1
   with its FIFO. As stock make's own pipe, close-on-exec but for the
   recipes make knows to be recursive. */
static int broker_pipe[2] = { -1, -1 };

static const char *
mode (void)
{
  const char *m = getenv ("HERDLESS_MAKE");
  return m && *m ? m : "auto";
}

static int
mode_is (const char *m)
{
  return strcmp (mode (), m) == 0;
}

/* Exports NAME=VALUE to every command this make runs: make builds its
   children's environment from its variables, read at start-up. */
static void
export_variable (const char *name, const char *value)
{
  struct variable *v = define_variable_global (name, strlen (name), value,
                                               o_env, 0, NILF);
  if (v)
    v->export = v_export;
}

/* This make is a job runner: it names its slot in HERDLESS_SLOT, at its
   own MAKELEVEL (make raises the variable only in its children's
   environment). Its recipes run one level below: a `herdless exec` in
   one, or a sub-make beside others, shares that recipe's slot, the token
   this make took for it. It names itself in HERDLESS_RUNNER
   (herdless_runner_env), so that its recipes' jobs know it for a make
   whatever its file is called. */
static void
export_slot (void)
{
  const char *slot = herdless_slot_env (hl);
  const char *eq = slot ? strchr (slot, '=') : NULL;
  const char *runner = herdless_runner_env (hl);
  const char *req = runner ? strchr (runner, '=') : NULL;
  if (eq)
    export_variable ("HERDLESS_SLOT", eq + 1);
  if (req)
    export_variable ("HERDLESS_RUNNER", req + 1);
}

/* This make now takes its tokens from herdless: its jobs learn its slot,
   and its poll loop (pselect in jobserver_acquire) waits for tokens in the
   broker's shared table where it can, woken by the giver's SIGURG. */
static void end_at_exit (void);

static void
connected (herdless_client *c)
{
  static int registered;
  int r;
  hl = c;
  hl_pid = getpid ();
  if (!registered)
    registered = !atexit (end_at_exit);
  export_slot ();
  r = herdless_poll_handoff (hl);
  if (r < 0)
    DB (DB_JOBS, ("herdless: waits over the socket only (%s)\n",
                  herdless_strerror (r)));
  else
    DB (DB_JOBS, ("herdless: waits %s\n",
                  r ? "in the shared table" : "over the socket only"));
}

static void
report (const herdless_broker_report *r)
{
  const char *file = getenv ("HERDLESS_MAKE_STATS");
  FILE *f;
  if (!file || !*file)
    return;
  f = fopen (file, "a");
  if (!f)
    return;
  fprintf (f, "jobs %u native_grants %llu classic_offered %llu "
           "max_in_use %u reclaimed %llu lost %lld woken %llu "
           "broker_vcsw %lld moved %llu no_room %llu\n", r->jobs,
           (unsigned long long) r->native_grants,
           (unsigned long long) r->classic_offered, r->max_in_use,
           (unsigned long long) r->reclaimed, (long long) r->lost,
           (unsigned long long) r->woken, (long long) r->broker_vcsw,
           (unsigned long long) r->moved, (unsigned long long) r->no_room);
  fclose (f);
}

/* Stops the broker while no fatal signal can reach its handle: the
   fatal-signal handler (jobserver_clear) removes the broker's files
   through `broker`, which must not name a handle being freed. A signal
   that comes meanwhile is handled once the broker has removed them. */
static int
stop_quietly (herdless_broker_report *r)
{
  herdless_broker *b = broker;
  sigset_t all, before;
  int lost;
  sigfillset (&all);
  sigprocmask (SIG_BLOCK, &all, &before);
  broker = NULL;
  broker_pipe[0] = broker_pipe[1] = -1;
  lost = herdless_broker_stop (b, r);
  sigprocmask (SIG_SETMASK, &before, NULL);
  return lost;
}

/* Stops the broker this make started; returns the tokens it lost. */
static int
stop_broker (void)
{
  herdless_broker_report r;
  int lost;
  if (!broker || getpid () != broker_pid)
    return 0;
  if (hl)
    {
      herdless_client_free (hl);
      hl = NULL;
    }
  memset (&r, 0, sizeof r);
  lost = stop_quietly (&r);
  if (lost < 0)
    {
      OS (error, NILF, "herdless: the jobserver's broker failed: %s",
          herdless_strerror (lost));
      return 0;
    }
  report (&r);
  return lost;
}

/* Stops this make's broker and closes the connection on purpose (from
   jobserver_clear, and at exit). Freeing the handle settles a withdrawal
   still unanswered and gives back what came for it, so the broker takes
   nothing back from a make that ended normally. Nothing in a forked
   child: the broker and the connection are the parent's. */
static void
end_herdless (void)
{
  stop_broker ();
  if (hl && getpid () == hl_pid)
    {
      herdless_client_free (hl);
      hl = NULL;
    }
}

/* A sub-make leaves jobserver_clear uncalled as it ends, and may still
   owe the broker the answer to a withdrawal (reap_children's): a grant
   that overtook it would be in the socket, unread. Not from a
   fatal-signal handler: the main flow may hold the handle's locks. */
static void
end_at_exit (void)
{
  if (!handling_fatal_signal)
    end_herdless ();
}

/* The descriptors this make may still open with SLOTS more jobs than its
   own: one per job (an --output-sync temporary file) and a few of its
   own. A broker in its process leaves them free. */
static unsigned int
keep_fds (int slots)
{
  return (unsigned int) slots + 1 + 8;
}

/* The stock jobserver for the group this make starts with -jN. A broker
   named in HERDLESS_SOCKET belongs to an outer group (`herdless run`, a
   make above): this group's herdless sub-makes and `herdless exec`s must
   not take their tokens there, past this make's -j, so its jobs do not
   learn of it. HERDLESS_MAKE=stock keeps the environment as stock make
   does. */
static unsigned int
stock_setup (int slots, const char *style)
{
  if (!mode_is ("stock"))
    {
      struct variable *v = lookup_variable ("HERDLESS_SOCKET", 15);
      if (v)
        v->export = v_noexport;
      unsetenv ("HERDLESS_SOCKET");
    }
  return __real_jobserver_setup (slots, style);
}

/* A signal whose default ends the process and that make leaves to it
   (SIGALRM, SIGUSR2, SIGVTALRM, SIGPROF; make's own handler covers
   SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE, SIGXCPU, SIGXFSZ) removes
   the broker's files (async-signal-safe calls only), then ends the make
   as before, where a stock make leaves nothing of its pipe behind. */
static void
die_of (int sig)
{
  struct sigaction dfl;
  if (broker && getpid () == broker_pid)
    (void) herdless_broker_unlink (broker);
  memset (&dfl, 0, sizeof dfl);
  dfl.sa_handler = SIG_DFL;
  sigemptyset (&dfl.sa_mask);
  (void) sigaction (sig, &dfl, NULL);
  (void) raise (sig);
}

/* Installs die_of where those signals are left to their default (never
   where they are ignored or handled). */
static void
catch_the_rest (void)
{
  static const int sigs[] = { SIGALRM, SIGUSR2, SIGVTALRM, SIGPROF };
  struct sigaction act, old;
  size_t i;
  memset (&act, 0, sizeof act);
  act.sa_handler = die_of;
  sigemptyset (&act.sa_mask);
  for (i = 0; i < sizeof sigs / sizeof sigs[0]; i++)
    if (sigaction (sigs[i], NULL, &old) == 0 && old.sa_handler == SIG_DFL)
      (void) sigaction (sigs[i], &act, NULL);
}

unsigned int
__wrap_jobserver_setup (int slots, const char *style)
{
  herdless_client *c;
  sigset_t all, before;
  int start_errno;

  int pipe_style = style && strcmp (style, "pipe") == 0;

  /* The broker's descriptors come out of this make's table, which must
     keep room for its own: short of that, the stock jobserver (which
     also rejects a style it does not know). */
  if (!mode_is ("auto") || (style && !pipe_style && strcmp (style, "fifo") != 0)
      || !herdless_fds_free (keep_fds (slots) + HERDLESS_BROKER_FDS))
    return stock_setup (slots, style);

  /* In make's own temporary directory (MAKE_TMPDIR, TMPDIR), where the
     stock jobserver would put its FIFO. A fatal signal waits until the
     fatal-signal handler can find the broker to remove its files: one
     that came while they were being made would leave them behind. */
  sigfillset (&all);
  sigprocmask (SIG_BLOCK, &all, &before);
  broker = herdless_broker_start ((unsigned int) slots + 1,
                                  pipe_style ? HERDLESS_BROKER_CLASSIC_PIPE
                                             : HERDLESS_BROKER_CLASSIC_FIFO,
                                  get_tmpdir ());
  if (broker)
    {
      broker_pid = getpid ();
      catch_the_rest ();
      if (pipe_style
          && sscanf (herdless_broker_classic_auth (broker), "%d,%d",
                     &broker_pipe[0], &broker_pipe[1]) == 2)
        {
          /* Inherited only by recursive recipes (jobserver_pre_child):
             any other child of make finds -2,-2 in MAKEFLAGS and no
             descriptor to misuse, as under stock make. */
          fd_noinherit (broker_pipe[0]);
          fd_noinherit (broker_pipe[1]);
        }
      else
        broker_pipe[0] = broker_pipe[1] = -1;
    }
  start_errno = errno;
  sigprocmask (SIG_SETMASK, &before, NULL);
  if (!broker)
    {
      errno = start_errno;
      /* The stock jobserver reports what is wrong (the same directory) in
         its own words, and copes as it does. */
      DB (DB_JOBS, ("herdless: cannot start a broker (%s): stock jobserver\n",
                    herdless_strerror (-errno)));
      return stock_setup (slots, style);
    }
  broker_slots = (unsigned int) slots;
  /* A sub-make turned away for them uses the classic FIFO. */
  (void) herdless_broker_keep_fds (broker, keep_fds (slots));
  /* By its socket: MAKEFLAGS may still name the jobserver of a make
     above, which a connection through the environment takes for a make
     between this one and the broker. */
  c = herdless_client_connect (herdless_broker_socket (broker));
  if (!c)
    {
      OS (error, NILF, "herdless: cannot connect to this make's broker (%s): "
          "using the stock jobserver", herdless_strerror (-errno));
      stop_broker ();
      /* The broker put HERDLESS_SOCKET back as it was. */
      return stock_setup (slots, style);
    }
  connected (c);
  export_variable ("HERDLESS_SOCKET", herdless_broker_socket (broker));
  /* Which jobserver is the broker's own: a sub-make handed another one
     (a stock make's own -jN group between) keeps to that one. */
  export_variable ("HERDLESS_CLASSIC", getenv ("HERDLESS_CLASSIC")
                                       ? getenv ("HERDLESS_CLASSIC") : "");
  DB (DB_JOBS, ("herdless: broker for -j%d at %s\n", slots + 1,
                herdless_broker_socket (broker)));
  return 1;
}

/* Makes sure the implicit token this sub-make's first job runs on is its
   own (herdless_implicit_token). Returns 0, with the handle freed, when
   it cannot be had (an abort, a broker gone): the make then goes on with
   its stock jobserver. */
static int
take_implicit (herdless_client *c)
{
  int r;

  do
    r = herdless_implicit_token (c);
  while (r == -EINTR);
  if (r < 0)
    {
      DB (DB_JOBS, ("herdless: no share of the recipe's token from the broker (%s): "
                    "stock jobserver\n", herdless_strerror (r)));
      herdless_client_free (c);
      return 0;
    }
  if (r == 1)
    DB (DB_JOBS, ("herdless: this make shares its recipe's token and holds a share\n"));
  return 1;
}

unsigned int
__wrap_jobserver_parse_auth (const char *auth)
{
  herdless_client *c;
  unsigned int classic;

  if (mode_is ("stock") || !getenv ("HERDLESS_SOCKET")
      || !*getenv ("HERDLESS_SOCKET"))
    return __real_jobserver_parse_auth (auth);

  /* Before the FIFO is opened: a make started with 2>&- would have it as
     its stderr, and write its messages into it as tokens (stock make
     does), or, opened later, the connection to the broker. */
  (void) herdless_open_standard_fds ();
  /* The classic jobserver still decides whether this make may run jobs in
     parallel at all (a parent that did not mark the recipe as recursive
     hands down -2,-2), and stays open for stock children. */
  classic = __real_jobserver_parse_auth (auth);
  if (!classic)
    return 0;
  c = herdless_client_native_from_env_as (HERDLESS_AS_SUB_MAKE);
  if (!c)
    {
      DB (DB_JOBS, ("herdless: not using the broker at %s (%s): stock jobserver\n",
                    getenv ("HERDLESS_SOCKET"), herdless_strerror (-errno)));
      return classic;
    }
  /* A recipe that starts this make beside others (xargs -P, `&`) has one
     token for them all: this make runs nothing before it holds its own
     share, the recipe's slot or a shared token. At exit, freeing the
     handle gives it back. */
  if (!take_implicit (c))
    return classic;
  connected (c);
  DB (DB_JOBS, ("herdless: tokens from the broker at %s\n",
                getenv ("HERDLESS_SOCKET")));
  return 1;
}

unsigned int
__wrap_jobserver_enabled (void)
{
  return hl ? 1 : __real_jobserver_enabled ();
}

char *
__wrap_jobserver_get_auth (void)
{
  if (broker)
    return xstrdup (herdless_broker_classic_auth (broker));
  return __real_jobserver_get_auth ();
}

const char *
__wrap_jobserver_get_invalid_auth (void)
{
  /* A FIFO needs no invalidating: children that are not sub-makes cannot
     use it by accident. A pipe does, as stock make's. */
  if (broker)
    return broker_pipe[0] >= 0 ? " --" JOBSERVER_AUTH_OPT "=-2,-2" : NULL;
  return __real_jobserver_get_invalid_auth ();
}

void
__wrap_jobserver_clear (void)
{
  if (handling_fatal_signal)
    {
      /* In a signal handler: remove the broker's files, nothing else. The
         process is about to die, and its broker thread with it. */
      if (broker && getpid () == broker_pid)
        herdless_broker_unlink (broker);
      __real_jobserver_clear ();
      return;
    }
  end_herdless ();
  __real_jobserver_clear ();
}

unsigned int
__wrap_jobserver_acquire_all (void)
{
  int lost;
  if (!broker)
    return __real_jobserver_acquire_all ();
  /* Stock make reads its jobserver back until every sub-make has closed
     it, so that a sub-make it left in the background (`$(MAKE) ... &`)
     has its tokens to the end: the broker serves until no make is
     connected. This make's own connection goes first. */
  if (getpid () == broker_pid)
    {
      int r;
      if (hl)
        {
          herdless_client_free (hl);
          hl = NULL;
        }
      r = herdless_broker_drain (broker);
      if (r < 0)
        DB (DB_JOBS, ("herdless: cannot wait for the sub-makes: %s\n",
                      herdless_strerror (r)));
    }
  /* Every job has ended: the broker's own count says whether every token
     came home, which is what make asks here. */
  lost = stop_broker ();
  __wrap_jobserver_clear ();
  return lost > 0 && (unsigned int) lost < broker_slots
         ? broker_slots - (unsigned int) lost
         : lost > 0 ? 0 : broker_slots;
}

void
__wrap_jobserver_release (int is_fatal)
{
  int r;
  if (!hl)
    {
      __real_jobserver_release (is_fatal);
      return;
    }
  /* In make's fatal-signal handler the main flow may be in the middle of
     a herdless call, holding its locks: nothing of herdless is called from
     there. The token is not lost: the process is about to die, and the
     broker takes back what a connection holds as it closes (and in the
     make that owns the broker, ends with it). */
  if (handling_fatal_signal)
    return;
  r = herdless_release (hl);
  if (r < 0)
    {
      if (is_fatal)
        OS (fatal, NILF, "herdless: cannot give a token back: %s",
            herdless_strerror (r));
      OS (error, NILF, "herdless: cannot give a token back: %s",
          herdless_strerror (r));
    }
}

void
__wrap_jobserver_signal (void)
{
  __real_jobserver_signal ();
}

void
__wrap_jobserver_pre_child (int recursive)
{
  if (recursive && broker && broker_pipe[0] >= 0)
    {
      fd_inherit (broker_pipe[0]);
      fd_inherit (broker_pipe[1]);
    }
  __real_jobserver_pre_child (recursive);
}

void
__wrap_jobserver_post_child (int recursive)
{
  if (recursive && broker && broker_pipe[0] >= 0)
    {
      fd_noinherit (broker_pipe[0]);
      fd_noinherit (broker_pipe[1]);
    }
  __real_jobserver_post_child (recursive);
}

void
__wrap_jobserver_pre_acquire (void)
{
  if (!hl)
    __real_jobserver_pre_acquire ();
}

/* make calls this with SIGCHLD blocked; it is unblocked only inside
   pselect, so a child that ends is never missed: pselect fails with EINTR
   and make goes to reap it. The request then stays queued (make keeps its
   place) and a later call picks its grant up. A token handed over in the
   shared table comes with a SIGURG, which also ends pselect with EINTR,
   and with herdless_fd readable: the next call takes it. Returns 1 with a
   token, 0 without. */
unsigned int
__wrap_jobserver_acquire (int timeout)
{
  sigset_t empty;
  struct timespec spec;
  struct timespec *specp = NULL;

  if (!hl)
    return __real_jobserver_acquire (timeout);

  sigemptyset (&empty);
  if (timeout)
    {
      /* Jobs wait for the load average to drop: come back in a second. */
      spec.tv_sec = 1;
      spec.tv_nsec = 0;
      specp = &spec;
    }
  while (1)
    {
      fd_set readfds;
      int fd;
      /* At a high -j the pool is usually empty: wait in the shared table
         (no message at all), or queue the request with one message,
         rather than asking first whether a token is free (a second broker
         wake-up per token). A free one is taken from the table, or makes
         the socket readable at once. */
      int r = herdless_request_grant (hl);
      if (r == 0)
        return 1;
      if (r == -ECANCELED)
        O (fatal, NILF,
           "herdless: the build was aborted in another branch of the tree");
      if (r != -EAGAIN)
        OS (fatal, NILF, "herdless: cannot get a job token: %s",
            herdless_strerror (r));
      fd = herdless_fd (hl);
      FD_ZERO (&readfds);
      FD_SET (fd, &readfds);
      r = pselect (fd + 1, &readfds, NULL, NULL, specp, &empty);
      if (r < 0)
        {
          if (errno == EINTR)
            return 0;
          pfatal_with_name ("pselect herdless socket");
        }
      if (r == 0)
        return 0;
      /* Readable: a grant, an abort or the broker's end; take_grant says
         which. */
    }
}

/* Not a jobserver function: make's blocking wait for a child, called from
   remake.c when no other job can start (and while dying). A request left
   queued by jobserver_acquire is not wanted any more then: withdraw it, so
   the token goes to another waiter instead of idling here. While dying
   (make's fatal-signal handler waits for its children here) it is left
   queued, as in jobserver_release: the connection's end withdraws it. */
void
__wrap_reap_children (int block, int err)
{
  if (block && hl && !handling_fatal_signal && herdless_pending (hl) > 0)
    herdless_cancel_nowait (hl);
  __real_reap_children (block, err);
}
