//! The classic jobserver's vocabulary: how it is named in the environment
//! ([`Jobserver::parse`] reads `MAKEFLAGS`, [`Jobserver::makeflags`] writes
//! it, [`without_jobserver`] strips an outer make's flags), whose
//! conventions apply ([`Flavor`]), how its tokens are reached ([`Style`],
//! [`Auth`]), and which programs take part ([`Program`]). The bridge, the
//! client and the command line all use these.
//!
//! Pure parsing and writing: nothing here opens or checks a descriptor
//! (that is the `pipe` module). The forms understood, as the programs write
//! them:
//!
//! | writer                       | example                                          |
//! |------------------------------|--------------------------------------------------|
//! | GNU make 4.2, 4.3            | `MAKEFLAGS=k -j3 --jobserver-auth=3,4 -- FOO=bar` |
//! | GNU make 4.4 and later       | `--jobserver-auth=fifo:/tmp/GMfifo1234`          |
//! | GNU make before 4.2          | `--jobserver-fds=3,4`                            |
//! | the `jobserver` crate, cargo | `CARGO_MAKEFLAGS=-j --jobserver-fds=3,4 --jobserver-auth=3,4` |
//! | bmake (NetBSD make)          | `MAKEFLAGS= -j 4 -J 15,16 .MAKE.LEVEL.ENV=MAKELEVEL` |
//!
//! Words are split at unescaped white space and a backslash escapes the next
//! character (how GNU make and bmake quote MAKEFLAGS). GNU make puts
//! variable definitions after a `--` word; nothing after it is read.

use std::ffi::OsStr;
use std::fmt;
use std::os::fd::RawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::error::{Error, ErrorKind, Result};

/// The variables that may name a jobserver, in order of preference: the
/// first one that names one wins, as in the `jobserver` crate (cargo sets
/// `CARGO_MAKEFLAGS` for the tools it runs, make sets the other two).
pub const VARS: [&str; 3] = ["CARGO_MAKEFLAGS", "MAKEFLAGS", "MFLAGS"];

/// Where a classic jobserver's tokens are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Auth {
    /// Inherited descriptors: `R,W` (GNU make, cargo) or bmake's `-J R,W`.
    Fds {
        /// The read end of the token pipe.
        read: RawFd,
        /// The write end of the token pipe.
        write: RawFd,
    },
    /// A named fifo, `fifo:PATH` (GNU make 4.4 and later by default).
    Fifo(PathBuf),
    /// The parent make turned the jobserver off for this process (negative
    /// descriptors, as in GNU make's `-2,-2`).
    Disabled,
}

/// Which family of make wrote the jobserver option. It decides what the
/// bytes in the pipe mean.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Flavor {
    /// GNU make, cargo and the `jobserver` crate: every byte is a token, and
    /// there is no abort token.
    Gnu,
    /// bmake (`-J`): `+` is a token; `E` (a job failed) and `I` (interrupted)
    /// are abort tokens that stop the whole tree.
    Bmake,
}

impl Flavor {
    /// Every flavour, in the order the command line lists them.
    pub const ALL: [Flavor; 2] = [Flavor::Gnu, Flavor::Bmake];

    /// The flavour's name on the command line and in status: `gnu` or
    /// `bmake`.
    pub const fn name(self) -> &'static str {
        match self {
            Flavor::Gnu => "gnu",
            Flavor::Bmake => "bmake",
        }
    }

    /// bmake's conventions for a command that is a bmake ([`Program`]),
    /// GNU make's otherwise.
    pub fn for_command(program: &OsStr) -> Flavor {
        Program::of(program).map_or(Flavor::Gnu, Program::flavor)
    }

    /// [`for_command`](Self::for_command) for a command line, looking
    /// through a wrapper that runs the rest of its arguments as a command
    /// (`timeout 600 bmake`, `nice -n 5 bmake`, `env X=1 bmake`, `unshare
    /// --pid --fork bmake`): the wrapped command is the first later
    /// argument that names a program [`Program`] knows, or a path, or a
    /// file on `PATH` (then not a make: GNU's flags); the wrapper's options
    /// and their values come before it. A shell run with `-c` (`sh -c 'cd
    /// src && bmake'`, also behind a wrapper) is looked into as far as
    /// [`Flavor::for_script`] goes.
    pub fn for_command_line<S: AsRef<OsStr>>(argv: &[S]) -> Flavor {
        Flavor::of_programs(&Program::run_by_command_line(argv))
    }

    /// The flavour of a shell command string, read the simple way: the
    /// first word of each command (after `;`, `&&`, `||`, `|`, `&`,
    /// parentheses, braces, a newline, `if`, `then`, `do` and the like,
    /// variable assignments, `exec` and the wrappers above) names the
    /// program it runs. bmake's conventions only when a bmake is run and no
    /// other program that reads the jobserver is (GNU make, cargo, ninja,
    /// rustc read GNU's flags, and bmake's would stop them); GNU's
    /// otherwise, and for anything this reading cannot see (a function, a
    /// variable, a command in quotes or in `$(…)`).
    pub fn for_script(script: &str) -> Flavor {
        Flavor::of_programs(&programs_in_script(script))
    }

    /// bmake's conventions when a bmake is among `programs` and nothing
    /// else that reads the jobserver is; GNU's otherwise.
    fn of_programs(programs: &[Program]) -> Flavor {
        let bmake = programs.contains(&Program::Bmake);
        let other = programs
            .iter()
            .any(|p| !matches!(p, Program::Bmake | Program::Herdless));
        if bmake && !other {
            Flavor::Bmake
        } else {
            Flavor::Gnu
        }
    }
}

impl Program {
    /// The programs a command line runs, as far as a simple reading sees
    /// (the one [`Flavor::for_command_line`] goes by): its first word,
    /// past the wrappers (`timeout 600 bmake`), or, for a shell with `-c`,
    /// the first word of each command of its command string
    /// ([`Flavor::for_script`]). Empty when none is one of these programs
    /// or the reading cannot tell (a script file, a variable).
    pub fn run_by_command_line<S: AsRef<OsStr>>(argv: &[S]) -> Vec<Program> {
        let Some(first) = argv.first() else {
            return Vec::new();
        };
        let first = first.as_ref();
        if let Some(program) = Program::of(first) {
            return vec![program];
        }
        if is_named(first, &SHELLS) {
            return programs_in_shell_arguments(&argv[1..]);
        }
        if !is_named(first, &WRAPPERS) {
            return Vec::new();
        }
        let mut wrapper = first;
        let mut values = 0;
        for (i, arg) in argv.iter().enumerate().skip(1) {
            let arg = arg.as_ref();
            if values > 0 {
                // An option's value names no program this line runs
                // (`env -C build-bmake gmake`), except `env -S`'s, which
                // is the command line itself.
                values -= 1;
                if is_named(wrapper, &["env"])
                    && matches!(argv[i - 1].as_ref().to_str(), Some("-S" | "--split-string"))
                {
                    return programs_in_script(&arg.to_string_lossy());
                }
                continue;
            }
            // An assignment's value names no program this line runs
            // (`env BMAKE=/opt/bin/x-bmake gmake`).
            if is_assignment(arg) {
                continue;
            }
            if arg.to_string_lossy().starts_with('-') {
                values = option_values(wrapper, arg);
                continue;
            }
            if let Some(program) = Program::of(arg) {
                return vec![program];
            }
            if is_named(arg, &SHELLS) {
                return programs_in_shell_arguments(&argv[i + 1..]);
            }
            if is_named(arg, &WRAPPERS) {
                // A wrapper in a wrapper (`nice -n 5 timeout 600 bmake`).
                wrapper = arg;
                continue;
            }
            if is_command_word(arg) {
                break;
            }
        }
        Vec::new()
    }
}

/// A shell's arguments (after its name): with `-c` (alone or among other
/// one-letter options), the programs its command string runs
/// ([`programs_in_script`]); a script file is not read.
fn programs_in_shell_arguments<S: AsRef<OsStr>>(args: &[S]) -> Vec<Program> {
    let mut command_string = false;
    let mut skip_value = false;
    for arg in args {
        let arg = arg.as_ref().to_string_lossy();
        if skip_value {
            skip_value = false;
            continue;
        }
        if arg.starts_with("--") {
            // The end of the options, or a long one (`--norc`).
            continue;
        }
        if let Some(letters) = arg.strip_prefix('-').or_else(|| arg.strip_prefix('+')) {
            if !letters.is_empty() && !letters.starts_with('-') {
                command_string |= arg.starts_with('-') && letters.contains('c');
                // `-o pipefail`: the option's name is the next word.
                skip_value = letters.ends_with('o');
                continue;
            }
        }
        return if command_string {
            programs_in_script(&arg)
        } else {
            Vec::new()
        };
    }
    Vec::new()
}

/// The programs a shell command string runs, read as
/// [`Flavor::for_script`] says.
fn programs_in_script(script: &str) -> Vec<Program> {
    const KEYWORDS: [&str; 12] = [
        "if", "then", "else", "elif", "do", "while", "until", "exec", "command", "!", "builtin",
        "{",
    ];
    let mut programs = Vec::new();
    let mut at_command = true;
    let mut in_wrapper: Option<&str> = None;
    let mut values = 0;
    let mut word = String::new();
    let mut words = Vec::new();
    for c in script.chars().chain(std::iter::once('\n')) {
        if c.is_whitespace() || ";&|()}".contains(c) {
            if !word.is_empty() {
                words.push(std::mem::take(&mut word));
            }
            if !c.is_whitespace() || c == '\n' {
                words.push(String::new());
            }
        } else {
            word.push(c);
        }
    }
    for w in &words {
        if w.is_empty() {
            // An operator or a line's end: a command comes next.
            at_command = true;
            in_wrapper = None;
            values = 0;
            continue;
        }
        if !at_command {
            continue;
        }
        if values > 0 {
            // A wrapper's option's value (`env -C build-bmake gmake`).
            values -= 1;
            continue;
        }
        let is_assignment = w
            .split_once('=')
            .is_some_and(|(name, _)| !name.is_empty() && !name.contains('/'));
        if KEYWORDS.contains(&w.as_str()) || is_assignment {
            continue;
        }
        if let Some(wrapper) = in_wrapper {
            if w.starts_with('-') {
                // A wrapper's option, and the words that are its value.
                values = option_values(OsStr::new(wrapper), OsStr::new(w));
                continue;
            }
            if w.starts_with(|c: char| c.is_ascii_digit()) {
                // A wrapper's argument (`timeout 600`, `taskset 0x3`).
                continue;
            }
        }
        programs.extend(Program::of(OsStr::new(w)));
        in_wrapper = is_named(OsStr::new(w), &WRAPPERS).then_some(w.as_str());
        at_command = in_wrapper.is_some();
    }
    programs
}

/// Programs that run the rest of their arguments as a command.
const WRAPPERS: [&str; 14] = [
    "timeout",
    "nice",
    "nohup",
    "setsid",
    "env",
    "time",
    "stdbuf",
    "ionice",
    "chrt",
    "taskset",
    "unshare",
    "bwrap",
    "firejail",
    "systemd-run",
];

/// How many of the words after `option` (a word of `wrapper`'s that
/// starts with `-`) are its value: 0 for a flag, an option whose value is
/// in the same word (`-n5`, `--chdir=dir`) and an option not known here.
/// The options of the wrappers above whose value is a separate word, from
/// their manuals (coreutils, util-linux, GNU time, bubblewrap, systemd).
fn option_values(wrapper: &OsStr, option: &OsStr) -> usize {
    let name = std::path::Path::new(wrapper)
        .file_name()
        .unwrap_or(wrapper)
        .to_string_lossy();
    let option = option.to_string_lossy();
    let one: &[&str] = match name.as_ref() {
        "env" => &[
            "-u",
            "--unset",
            "-C",
            "--chdir",
            "-S",
            "--split-string",
            "-a",
            "--argv0",
        ],
        "timeout" => &["-s", "--signal", "-k", "--kill-after"],
        "nice" => &["-n", "--adjustment"],
        "time" => &["-f", "--format", "-o", "--output"],
        "stdbuf" => &["-i", "--input", "-o", "--output", "-e", "--error"],
        "ionice" => &[
            "-c",
            "--class",
            "-n",
            "--classdata",
            "-p",
            "--pid",
            "-P",
            "--pgid",
            "-u",
            "--uid",
        ],
        "chrt" => &[
            "-T",
            "--sched-runtime",
            "-P",
            "--sched-period",
            "-D",
            "--sched-deadline",
        ],
        "unshare" => &[
            "-S",
            "--setuid",
            "-G",
            "--setgid",
            "-R",
            "--root",
            "-w",
            "--wd",
            "--propagation",
            "--map-user",
            "--map-group",
            "--map-users",
            "--map-groups",
            "--monotonic",
            "--boottime",
        ],
        "systemd-run" => &[
            "-p",
            "--property",
            "-E",
            "--setenv",
            "-u",
            "--unit",
            "--uid",
            "--gid",
            "--nice",
            "-M",
            "--machine",
            "-H",
            "--host",
            "--description",
            "--slice",
            "--working-directory",
            "--on-active",
            "--on-boot",
            "--on-startup",
            "--on-unit-active",
            "--on-unit-inactive",
            "--on-calendar",
            "--path-property",
            "--socket-property",
            "--timer-property",
            "--service-type",
            "--expand-environment",
        ],
        "bwrap" => {
            const TWO: [&str; 12] = [
                "--bind",
                "--ro-bind",
                "--dev-bind",
                "--bind-try",
                "--ro-bind-try",
                "--dev-bind-try",
                "--symlink",
                "--setenv",
                "--file",
                "--bind-data",
                "--ro-bind-data",
                "--chmod",
            ];
            if TWO.contains(&option.as_ref()) {
                return 2;
            }
            &[
                "--chdir",
                "--unsetenv",
                "--dev",
                "--proc",
                "--tmpfs",
                "--mqueue",
                "--dir",
                "--remount-ro",
                "--uid",
                "--gid",
                "--hostname",
                "--lock-file",
                "--sync-fd",
                "--seccomp",
                "--add-seccomp-fd",
                "--exec-label",
                "--file-label",
                "--cap-add",
                "--cap-drop",
                "--userns",
                "--userns2",
                "--pidns",
                "--info-fd",
                "--json-status-fd",
                "--block-fd",
                "--userns-block-fd",
                "--args",
                "--perms",
                "--size",
                "--argv0",
                "--overlay-src",
                "--tmp-overlay",
                "--ro-overlay",
            ]
        }
        _ => &[],
    };
    usize::from(one.contains(&option.as_ref()))
}

/// Shells whose `-c` string [`Flavor::for_script`] reads.
const SHELLS: [&str; 7] = ["sh", "bash", "dash", "zsh", "ksh", "mksh", "posh"];

/// Whether the file name of `word` is one of `names`.
fn is_named(word: &OsStr, names: &[&str]) -> bool {
    let name = std::path::Path::new(word).file_name().unwrap_or(word);
    names.iter().any(|n| name == OsStr::new(n))
}

/// Whether `word` is a variable assignment (`NAME=VALUE`, no `/` before
/// the `=`), as `env` and a shell read it.
fn is_assignment(word: &OsStr) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let bytes = word.as_bytes();
    bytes
        .iter()
        .position(|&b| b == b'=')
        .is_some_and(|eq| eq > 0 && !bytes[..eq].contains(&b'/'))
}

/// Whether `word` names a program to run: a path, or a file in a
/// directory of `PATH`; not an assignment (`env PATH=/opt/bin bmake`).
fn is_command_word(word: &OsStr) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let bytes = word.as_bytes();
    if let Some(eq) = bytes.iter().position(|&b| b == b'=') {
        if !bytes[..eq].contains(&b'/') {
            return false;
        }
    }
    if bytes.contains(&b'/') {
        return true;
    }
    !word.is_empty()
        && std::env::var_os("PATH")
            .is_some_and(|paths| std::env::split_paths(&paths).any(|dir| dir.join(word).is_file()))
}

impl std::str::FromStr for Flavor {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Flavor, String> {
        Flavor::ALL
            .into_iter()
            .find(|v| v.name() == s)
            .ok_or_else(|| format!("unknown jobserver flavour {s:?} (gnu or bmake)"))
    }
}

/// How classic clients reach the tokens of a jobserver that herdless makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Style {
    /// Inherited descriptors `R,W`: every classic client reads these.
    Pipe,
    /// A named FIFO (`fifo:PATH`): GNU make 4.4 and later only.
    Fifo,
}

impl Style {
    /// Every style, in the order the command line lists them.
    pub const ALL: [Style; 2] = [Style::Pipe, Style::Fifo];

    /// The style's name: `pipe` or `fifo`.
    pub const fn name(self) -> &'static str {
        match self {
            Style::Pipe => "pipe",
            Style::Fifo => "fifo",
        }
    }
}

impl std::str::FromStr for Style {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Style, String> {
        Style::ALL
            .into_iter()
            .find(|v| v.name() == s)
            .ok_or_else(|| format!("unknown jobserver style {s:?} (pipe or fifo)"))
    }
}

/// A program that takes part in a jobserver, known by its command name
/// (the file name of `argv[0]`, or the kernel's `comm`), case-insensitive.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Program {
    /// `make`, `gmake`, `gnumake`, any other `*make` and `make-*` that is
    /// not a bmake: GNU make's conventions.
    GnuMake,
    /// `bmake`, `bsdmake`, `pmake` and any `*-bmake`: bmake's `-J` and abort
    /// tokens.
    Bmake,
    /// `ninja` and its rewrite `samu`.
    Ninja,
    /// `cargo`.
    Cargo,
    /// `rustc`, which reads the jobserver for its own threads.
    Rustc,
    /// `herdless` itself (`herdless exec` holds a job's slot for its
    /// command).
    Herdless,
}

impl Program {
    /// The program a command name (or path) names, if it is one of these.
    pub fn of(command: &OsStr) -> Option<Program> {
        let name = Path::new(command).file_name()?.to_string_lossy();
        let name = name.trim().to_ascii_lowercase();
        // An option (`-Cbuild-bmake`), never a program's name.
        if name.starts_with('-') {
            return None;
        }
        Some(match name.as_str() {
            "bmake" | "bsdmake" | "pmake" => Program::Bmake,
            // A bmake by another prefix (`herdless-bmake`, `x86_64-bmake`).
            n if n.ends_with("-bmake") => Program::Bmake,
            "ninja" | "samu" => Program::Ninja,
            "cargo" => Program::Cargo,
            "rustc" => Program::Rustc,
            "herdless" => Program::Herdless,
            // GNU make by its usual names, a target prefix
            // (`x86_64-linux-gnu-make`) or a version (`make-4.4`); not
            // programs whose name only ends in "make" (automake, cmake,
            // qmake, imake), which neither read the jobserver nor run
            // their jobs one slot each.
            "make" | "gmake" | "gnumake" | "remake" => Program::GnuMake,
            n if n.ends_with("-make") || n.starts_with("make-") || n.starts_with("gmake-") => {
                Program::GnuMake
            }
            _ => return None,
        })
    }

    /// Whose conventions its jobserver flags follow.
    pub fn flavor(self) -> Flavor {
        match self {
            Program::Bmake => Flavor::Bmake,
            _ => Flavor::Gnu,
        }
    }

    /// Whether it is a classic jobserver client: it takes tokens from the
    /// pipe named in `MAKEFLAGS` from the start. Only a nested `herdless
    /// run` asks this, before its command starts, to decide whether the
    /// command gets a classic jobserver of the run's own; a top-level run
    /// learns it from its broker instead (see `bridge.rs`).
    pub fn reads_jobserver(self) -> bool {
        self != Program::Herdless
    }

    /// Whether it starts each job it runs in a job slot of its own (a make,
    /// ninja, cargo, or `herdless exec` for its command); rustc runs
    /// threads, not jobs.
    pub fn runs_each_job_in_a_slot(self) -> bool {
        self != Program::Rustc
    }
}

impl fmt::Display for Flavor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Flavor::Gnu => "GNU make",
            Flavor::Bmake => "bmake",
        })
    }
}

/// A classic jobserver named in the environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Jobserver {
    var: &'static str,
    option: String,
    auth: Auth,
    flavor: Flavor,
    jobs: Option<u32>,
}

impl Jobserver {
    /// Makes a description by hand, e.g. for a jobserver created by this
    /// process. `jobs` is the `-j` limit, if known.
    pub fn new(auth: Auth, flavor: Flavor, jobs: Option<u32>) -> Jobserver {
        let option = match (&auth, flavor) {
            (Auth::Fds { read, write }, Flavor::Bmake) => format!("-J {read},{write}"),
            (Auth::Fds { read, write }, Flavor::Gnu) => format!("--jobserver-auth={read},{write}"),
            // One word of MAKEFLAGS, its blanks and backslashes escaped
            // as the makes' parsers (and this crate's) read them: a TMPDIR
            // with a space in it must not split the path.
            (Auth::Fifo(p), _) => {
                format!("--jobserver-auth=fifo:{}", escape(&p.display().to_string()))
            }
            (Auth::Disabled, Flavor::Bmake) => "-J -1,-1".to_owned(),
            (Auth::Disabled, Flavor::Gnu) => "--jobserver-auth=-2,-2".to_owned(),
        };
        Jobserver {
            var: "",
            option,
            auth,
            flavor,
            jobs,
        }
    }

    /// The jobserver named by `CARGO_MAKEFLAGS`, `MAKEFLAGS` or `MFLAGS`
    /// (see [`VARS`]); `None` when none of them names one.
    ///
    /// # Errors
    ///
    /// `BadJobserver` when the first variable that names a jobserver names
    /// it in a form that cannot be read (`--jobserver-auth=x`). Later
    /// variables are not consulted then: a make that meant to pass a
    /// jobserver did, and guessing another would be wrong.
    pub fn from_env() -> Result<Option<Jobserver>> {
        let values: Vec<_> = VARS.iter().map(|v| (*v, std::env::var_os(v))).collect();
        Jobserver::from_vars(values.iter().map(|(k, v)| (*k, v.as_deref())))
    }

    /// [`Jobserver::from_env`] over given values, in order of preference.
    pub fn from_vars<'a>(
        vars: impl IntoIterator<Item = (&'static str, Option<&'a OsStr>)>,
    ) -> Result<Option<Jobserver>> {
        for (var, value) in vars {
            if let Some(value) = value {
                if let Some(js) = Jobserver::parse(var, value)? {
                    return Ok(Some(js));
                }
            }
        }
        Ok(None)
    }

    /// Reads one variable's value. `None` when it names no jobserver; when
    /// it names several, the last one wins (a sub-make appends its own).
    ///
    /// # Errors
    ///
    /// `BadJobserver` when the winning option cannot be read.
    pub fn parse(var: &'static str, value: &OsStr) -> Result<Option<Jobserver>> {
        let mut scan = Scan::default();
        scan.words(&split_words(value.as_bytes()));
        let Some((option, flavor, arg)) = scan.found else {
            return Ok(None);
        };
        let option = String::from_utf8_lossy(&option).into_owned();
        let malformed = |expected: &str| {
            Error::new(
                ErrorKind::BadJobserver,
                format!("{var} has a malformed jobserver option {option:?}: {expected}"),
            )
        };
        let auth = parse_auth(&arg).ok_or_else(|| {
            malformed(match flavor {
                Flavor::Gnu => "expected R,W (two descriptor numbers) or fifo:PATH",
                Flavor::Bmake => "expected R,W (two descriptor numbers)",
            })
        })?;
        if flavor == Flavor::Bmake && matches!(auth, Auth::Fifo(_)) {
            return Err(malformed("bmake's -J takes R,W, not a fifo"));
        }
        Ok(Some(Jobserver {
            var,
            option,
            auth,
            flavor,
            jobs: scan.jobs,
        }))
    }

    /// `MAKEFLAGS` for a child: `existing` without an outer make's job
    /// count and jobserver flags ([`without_jobserver`]), with this
    /// jobserver's `-j` (when known) and option in its flavour's spelling
    /// (`-jN --jobserver-auth=R,W` or `fifo:PATH` for GNU make, `-j N -J
    /// R,W` for bmake) after the other options and before the variable
    /// definitions that follow a `--`.
    pub fn makeflags(&self, existing: Option<&OsStr>) -> std::ffi::OsString {
        let kept = without_jobserver(&existing.map(OsStr::to_string_lossy).unwrap_or_default());
        // Options go before a `--` word: what follows it are variable
        // definitions, which no make reads options from.
        let words = raw_words(&kept);
        let (options, definitions) = match words.iter().position(|w| unescape(w) == "--") {
            Some(i) => (words[..i].join(" "), Some(words[i..].join(" "))),
            None => (kept.clone(), None),
        };
        let options = match self.flavor {
            Flavor::Bmake => gnu_flag_word_for_bmake(&options),
            Flavor::Gnu => options,
        };
        let mut words: Vec<String> = Vec::new();
        if !options.is_empty() {
            words.push(options);
        }
        match (self.jobs, self.flavor) {
            (Some(n), Flavor::Gnu) => words.push(format!("-j{n}")),
            (Some(n), Flavor::Bmake) => words.push(format!("-j {n}")),
            (None, _) => {}
        }
        words.push(self.option.clone());
        words.extend(definitions);
        words.join(" ").into()
    }

    /// The variable it was found in (`"MAKEFLAGS"`), or `""` for one made
    /// with [`Jobserver::new`].
    pub fn var(&self) -> &'static str {
        self.var
    }

    /// The option as written, e.g. `--jobserver-auth=3,4` or `-J 15,16`.
    pub fn option(&self) -> &str {
        &self.option
    }

    /// Where the tokens are.
    pub fn auth(&self) -> &Auth {
        &self.auth
    }

    /// Which family of make wrote it.
    pub fn flavor(&self) -> Flavor {
        self.flavor
    }

    /// The `-j` limit that came with it, if a number was given (`-j` alone,
    /// as cargo writes it, gives none).
    pub fn jobs(&self) -> Option<u32> {
        self.jobs
    }

    /// The fifo's path, for the fifo style.
    pub fn fifo(&self) -> Option<&Path> {
        match &self.auth {
            Auth::Fifo(p) => Some(p),
            _ => None,
        }
    }

    /// Which jobserver this names, as `(st_dev, st_ino)` of its pipe or
    /// FIFO, found without opening anything: of the FIFO's path, or of
    /// the pipe or FIFO open as the read descriptor, when the write
    /// descriptor is one too, each open the way a jobserver's end is (the
    /// read one for reading, the write one for writing). On Linux, where
    /// both ends of one pipe have one inode, the two descriptors must be
    /// one pipe's ends (or one FIFO's), as every make makes them. `None`
    /// when that is not there to see: a disabled jobserver, a descriptor
    /// not open, a path that does not exist, anything not a pipe or FIFO,
    /// a read descriptor open for writing only (a number a script reused,
    /// `R>&1`), or on Linux two descriptors of different pipes (the two
    /// FIFOs of a herdless bridge in pipe style, a number reused for
    /// another pipe).
    pub fn identity(&self) -> Option<(u64, u64)> {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        match &self.auth {
            Auth::Disabled => None,
            Auth::Fifo(path) => {
                let meta = std::fs::metadata(path).ok()?;
                meta.file_type().is_fifo().then(|| (meta.dev(), meta.ino()))
            }
            Auth::Fds { read, write } => {
                use herdless_platform::fd_access_mode as mode;
                use nix::fcntl::OFlag;
                // Open the ways a jobserver's ends are: not a number a
                // script reused with `R>&1`.
                if mode(*read)? == OFlag::O_WRONLY || mode(*write)? == OFlag::O_RDONLY {
                    return None;
                }
                let read_id = herdless_platform::fifo_identity(*read)?;
                let write_id = herdless_platform::fifo_identity(*write)?;
                (!cfg!(target_os = "linux") || read_id == write_id).then_some(read_id)
            }
        }
    }

    /// Where the description came from, for messages: `MAKEFLAGS` or "the
    /// jobserver description".
    pub(crate) fn source(&self) -> &'static str {
        if self.var.is_empty() {
            "the jobserver description"
        } else {
            self.var
        }
    }
}

impl fmt::Display for Jobserver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.var.is_empty() {
            write!(f, "{} jobserver {}", self.flavor, self.option)
        } else {
            write!(
                f,
                "{} jobserver {} (from {})",
                self.flavor, self.option, self.var
            )
        }
    }
}

/// `MAKEFLAGS` without the job-count and jobserver flags of an outer
/// make (`-jN`, `-j N`, `--jobserver-auth=…`, `--jobserver-fds=…`, bmake's
/// `-J R,W`, and those letters inside a cluster such as `-kj4`), so a tree
/// sees only the jobserver it is given; everything else, and the variable
/// definitions after `--`, is kept as it was written.
///
/// Words are found as [`Jobserver::parse`] finds them (at unescaped
/// spaces, tabs and newlines; a backslash escapes the next character), so
/// that what a writer appends after the result is read as the words it
/// wrote: a last word that ends in a lone backslash gets it doubled.
pub fn without_jobserver(makeflags: &str) -> String {
    let numeric = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let raw = raw_words(makeflags);
    // What the parser compares: each word with its escapes undone.
    let words: Vec<String> = raw.iter().map(|w| unescape(w)).collect();
    let mut kept: Vec<String> = Vec::new();
    let mut i = 0;
    while i < words.len() {
        let w = words[i].as_str();
        i += 1;
        if w == "--" {
            kept.extend(raw[i - 1..].iter().map(|w| w.to_string()));
            break;
        }
        if w.starts_with("--jobserver-auth=") || w.starts_with("--jobserver-fds=") {
            continue;
        }
        // A cluster of short options, or GNU make's first word, which has
        // no dash ("ks"), as the parser reads them; a word that comes first
        // in what is written is read as that first word.
        let cluster = match w.strip_prefix('-') {
            Some(c) if !c.starts_with('-') => Some((c, "-")),
            None if kept.is_empty()
                && !w.is_empty()
                && w.bytes().all(|b| b.is_ascii_alphanumeric()) =>
            {
                Some((w, ""))
            }
            _ => None,
        };
        let Some((cluster, dash)) = cluster else {
            kept.push(raw[i - 1].to_string());
            continue;
        };
        match strip_job_letters(cluster) {
            None => kept.push(raw[i - 1].to_string()),
            Some((before, letter, rest)) => {
                if rest.is_empty() {
                    // The option's value is the next word: bmake's `-J`
                    // always takes it, `-j` only a number.
                    let next = words.get(i).map_or("", String::as_str);
                    if i < words.len() && (letter == 'J' || numeric(next)) {
                        i += 1;
                    }
                }
                if !before.is_empty() {
                    kept.push(escape(&format!("{dash}{before}")));
                }
            }
        }
    }
    if let Some(last) = kept.last_mut() {
        if ends_in_lone_backslash(last) {
            last.push('\\');
        }
    }
    kept.join(" ")
}

/// The flags bmake reads as GNU make does, with no argument: environment
/// overrides, ignore errors, keep going, no execute, question, no builtin
/// rules, silent, touch, print the directory.
const SHARED_FLAGS: &str = "eiknqrstw";

/// `options` (MAKEFLAGS options, without the jobserver's) for a bmake:
/// GNU make's first word, its single-letter flags without a dash (`ks`),
/// would be a target to bmake ("don't know how to make k"); it is written
/// `-ks`, keeping only the letters bmake reads the same way
/// ([`SHARED_FLAGS`]: not `B`, always make to GNU make but compat mode to
/// bmake, nor `d`, which takes an argument in bmake), and dropped when
/// none is left. Anything else is kept as it is.
fn gnu_flag_word_for_bmake(options: &str) -> String {
    let words = raw_words(options);
    let Some(first) = words.first() else {
        return options.to_owned();
    };
    if first.is_empty() || !first.bytes().all(|b| b.is_ascii_alphabetic()) {
        return options.to_owned();
    }
    let shared: String = first
        .chars()
        .filter(|c| SHARED_FLAGS.contains(*c))
        .collect();
    let next_reads_as_flags = words
        .get(1)
        .is_some_and(|w| !w.is_empty() && w.bytes().all(|b| b.is_ascii_alphabetic()));
    if shared.is_empty() && next_reads_as_flags {
        // Dropping the word would make the next one the first, read as
        // flags in its turn (no make writes that; kept as it is).
        return options.to_owned();
    }
    let mut out: Vec<String> = Vec::new();
    if !shared.is_empty() {
        out.push(format!("-{shared}"));
    }
    out.extend(words[1..].iter().map(|w| w.to_string()));
    out.join(" ")
}

/// A raw word with its escapes undone, as the parser reads it.
fn unescape(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => out.push(chars.next().unwrap_or('\\')),
            c => out.push(c),
        }
    }
    out
}

/// `word` written so that the parser reads it back as one word.
fn escape(word: &str) -> String {
    let mut out = String::with_capacity(word.len());
    for c in word.chars() {
        if matches!(c, '\\' | ' ' | '\t' | '\n') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Where a cluster of one-letter options (without its dash) names `j` or
/// `J`, as [`Jobserver::parse`] reads it: the letters before it, the letter,
/// and the rest of the cluster (its value). `None` when it names neither,
/// or when a letter that takes a value comes first (the rest is that value).
fn strip_job_letters(cluster: &str) -> Option<(&str, char, &str)> {
    for (k, letter) in cluster.char_indices() {
        match letter {
            'J' | 'j' => return Some((&cluster[..k], letter, &cluster[k + 1..])),
            'C' | 'D' | 'I' | 'T' | 'V' | 'd' | 'f' | 'm' | 'v' | 'o' | 'O' | 'l' | 'L' | 'W' => {
                return None
            }
            _ => {}
        }
    }
    None
}

/// The words of `s` as written (escapes kept), split where
/// [`Jobserver::parse`] splits them: at spaces, tabs and newlines that no
/// backslash escapes.
fn raw_words(s: &str) -> Vec<&str> {
    let mut words = Vec::new();
    let mut start = None;
    let mut escaped = false;
    for (k, c) in s.char_indices() {
        if escaped {
            escaped = false;
            continue;
        }
        match c {
            '\\' => {
                escaped = true;
                start.get_or_insert(k);
            }
            ' ' | '\t' | '\n' => {
                if let Some(b) = start.take() {
                    words.push(&s[b..k]);
                }
            }
            _ => {
                start.get_or_insert(k);
            }
        }
    }
    if let Some(b) = start {
        words.push(&s[b..]);
    }
    words
}

/// Whether `word` ends in a backslash that escapes nothing (the parser
/// would take it with whatever is written after it).
fn ends_in_lone_backslash(word: &str) -> bool {
    let mut escaped = false;
    for c in word.chars() {
        escaped = !escaped && c == '\\';
    }
    escaped
}

/// `R,W` with both numbers non-negative, negative numbers (disabled), or
/// `fifo:PATH`.
fn parse_auth(arg: &[u8]) -> Option<Auth> {
    if let Some(path) = arg.strip_prefix(b"fifo:") {
        if path.is_empty() {
            return None;
        }
        return Some(Auth::Fifo(PathBuf::from(OsStr::from_bytes(path))));
    }
    let text = std::str::from_utf8(arg).ok()?;
    let (r, w) = text.split_once(',')?;
    let read: RawFd = r.parse().ok()?;
    let write: RawFd = w.parse().ok()?;
    match (read < 0, write < 0) {
        (true, true) => Some(Auth::Disabled),
        (false, false) => Some(Auth::Fds { read, write }),
        _ => None,
    }
}

fn parse_u32(s: &[u8]) -> Option<u32> {
    if s.is_empty() || !s.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(s).ok()?.parse().ok()
}

/// What the words of one variable say: the last jobserver option (as
/// written, its flavour, its argument) and the last `-j` count.
#[derive(Default)]
struct Scan {
    found: Option<(Vec<u8>, Flavor, Vec<u8>)>,
    jobs: Option<u32>,
}

impl Scan {
    /// Reads the words up to a `--` (after which come variable
    /// definitions).
    fn words(&mut self, words: &[Vec<u8>]) {
        let mut i = 0;
        while i < words.len() {
            let w = &words[i];
            i += 1;
            if w.as_slice() == b"--" {
                break;
            }
            if let Some(rest) = w.strip_prefix(b"--") {
                i += self.long_option(w, rest, words.get(i));
                continue;
            }
            // A cluster of short options: "-j4", "-kJ 3,4", and GNU make's
            // first word, which has no dash ("k", "ks").
            let cluster = match w.strip_prefix(b"-") {
                Some(c) => c,
                None if i == 1 && !w.is_empty() && w.iter().all(u8::is_ascii_alphanumeric) => w,
                None => continue,
            };
            i += self.short_options(cluster, words.get(i));
        }
    }

    /// `--jobserver-auth=`, `--jobserver-fds=`, `--jobs=N` or `--jobs N`;
    /// returns how many following words it took (0 or 1).
    fn long_option(&mut self, word: &[u8], rest: &[u8], next: Option<&Vec<u8>>) -> usize {
        for name in [&b"jobserver-auth="[..], b"jobserver-fds="] {
            if let Some(arg) = rest.strip_prefix(name) {
                self.found = Some((word.to_vec(), Flavor::Gnu, arg.to_vec()));
            }
        }
        if let Some(n) = rest.strip_prefix(b"jobs=") {
            self.jobs = parse_u32(n).or(self.jobs);
        } else if rest == b"jobs" {
            if let Some(n) = next.and_then(|n| parse_u32(n)) {
                self.jobs = Some(n);
                return 1;
            }
        }
        0
    }

    /// A cluster of one-letter options; returns how many following words
    /// it took as an argument (0 or 1).
    fn short_options(&mut self, cluster: &[u8], next: Option<&Vec<u8>>) -> usize {
        for (k, &letter) in cluster.iter().enumerate() {
            let rest = &cluster[k + 1..];
            match letter {
                b'J' => {
                    let (arg, took) = match rest.is_empty() {
                        true => (next.cloned().unwrap_or_default(), 1),
                        false => (rest.to_vec(), 0),
                    };
                    let mut option = b"-J ".to_vec();
                    option.extend_from_slice(&arg);
                    self.found = Some((option, Flavor::Bmake, arg));
                    return took;
                }
                b'j' => {
                    if !rest.is_empty() {
                        self.jobs = parse_u32(rest).or(self.jobs);
                        return 0;
                    }
                    return match next.and_then(|n| parse_u32(n)) {
                        Some(n) => {
                            self.jobs = Some(n);
                            1
                        }
                        None => 0,
                    };
                }
                // Letters that take an argument in GNU make or bmake: the
                // rest of the word, or the next word when it does not look
                // like an option, is that argument.
                b'C' | b'D' | b'I' | b'T' | b'V' | b'd' | b'f' | b'm' | b'v' | b'o' | b'O'
                | b'l' | b'L' | b'W' => {
                    let takes_next = rest.is_empty()
                        && letter != b'O'
                        && next.is_some_and(|n| !n.starts_with(b"-"));
                    return usize::from(takes_next);
                }
                _ => {}
            }
        }
        0
    }
}

/// Splits at unescaped blanks; a backslash keeps the next byte as it is.
fn split_words(s: &[u8]) -> Vec<Vec<u8>> {
    let mut words = Vec::new();
    let mut word = Vec::new();
    let mut in_word = false;
    let mut bytes = s.iter().copied();
    while let Some(b) = bytes.next() {
        match b {
            b'\\' => {
                in_word = true;
                word.push(bytes.next().unwrap_or(b'\\'));
            }
            b' ' | b'\t' | b'\n' => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            _ => {
                in_word = true;
                word.push(b);
            }
        }
    }
    if in_word {
        words.push(word);
    }
    words
}

#[cfg(test)]
mod tests {
    #[test]
    fn outer_jobserver_flags_are_dropped() {
        assert_eq!(without_jobserver(""), "");
        assert_eq!(
            without_jobserver("k -j3 --jobserver-auth=3,4 -- CC=gcc -j5"),
            "k -- CC=gcc -j5"
        );
        assert_eq!(
            without_jobserver(" -j 4 -J 15,16 .MAKE.LEVEL.ENV=MAKELEVEL"),
            ".MAKE.LEVEL.ENV=MAKELEVEL"
        );
        assert_eq!(without_jobserver("-j --jobserver-fds=3,4 -s"), "-s");
        assert_eq!(without_jobserver("-J3,4 -k"), "-k");
        assert_eq!(without_jobserver("--jobserver-auth=fifo:/tmp/x -w"), "-w");
    }

    #[test]
    fn outer_words_are_read_as_the_parser_reads_them() {
        // A cluster's j or J goes with its value; a cluster's other letters
        // stay; a letter that takes a value hides what follows it.
        assert_eq!(without_jobserver("-kJ 3,4 -s"), "-k -s");
        assert_eq!(without_jobserver("-kJ"), "-k");
        assert_eq!(without_jobserver("-kj4 -w"), "-k -w");
        assert_eq!(without_jobserver("-kj 4 -w"), "-k -w");
        assert_eq!(without_jobserver("-fJ x"), "-fJ x");
        assert_eq!(without_jobserver("kj -w"), "k -w");
        // Tabs and newlines separate words as spaces do.
        assert_eq!(without_jobserver("-j3\t--\tX=1"), "-- X=1");
        // Escaped spaces stay inside their word; a lone final backslash is
        // doubled so that nothing written after it is glued on.
        assert_eq!(without_jobserver("A\\ B -j2"), "A\\ B");
        assert_eq!(without_jobserver("-k \\"), "-k \\\\");
    }

    #[test]
    fn makeflags_round_trip_what_the_fuzzer_found() {
        for outer in [
            "-kJ",
            "-k --\tX=1",
            "-k \\",
            "-kJ\t-s",
            "J 1",
            "x\\ -- -s",
            " J 171,65 J",
            "-w - \\-\\- -s",
            "-\\J 1 -s",
            "D  -\\-",
        ] {
            for flavor in Flavor::ALL {
                let js = Jobserver::new(Auth::Fds { read: 3, write: 4 }, flavor, Some(7));
                let flags = js.makeflags(Some(OsStr::new(outer)));
                let back = Jobserver::parse("MAKEFLAGS", &flags)
                    .unwrap_or_else(|e| panic!("{outer:?} -> {flags:?}: {e}"))
                    .unwrap_or_else(|| panic!("{outer:?} -> {flags:?} lost the jobserver"));
                assert_eq!(back.auth(), js.auth(), "{outer:?} -> {flags:?}");
                assert_eq!(back.jobs(), Some(7), "{outer:?} -> {flags:?}");
            }
        }
    }

    #[test]
    fn makeflags_written_are_read_back() {
        let cases = [
            (
                Auth::Fds { read: 3, write: 4 },
                Flavor::Gnu,
                "k -- X=1",
                "k -j4 --jobserver-auth=3,4 -- X=1",
            ),
            (
                Auth::Fds { read: 5, write: 6 },
                Flavor::Bmake,
                "-j 9 -J 1,2",
                "-j 4 -J 5,6",
            ),
            (
                Auth::Fifo(PathBuf::from("/t/f")),
                Flavor::Gnu,
                "-j2 --jobserver-auth=1,2",
                "-j4 --jobserver-auth=fifo:/t/f",
            ),
            // GNU make's flag word, for a bmake: a dash, and only the
            // letters bmake reads the same way.
            (
                Auth::Fds { read: 5, write: 6 },
                Flavor::Bmake,
                "kBs -j2 --jobserver-auth=3,4 -- X=1",
                "-ks -j 4 -J 5,6 -- X=1",
            ),
            (
                Auth::Fds { read: 5, write: 6 },
                Flavor::Bmake,
                "B -j2 --jobserver-auth=3,4",
                "-j 4 -J 5,6",
            ),
        ];
        for (auth, flavor, outer, want) in cases {
            let js = Jobserver::new(auth.clone(), flavor, Some(4));
            let flags = js.makeflags(Some(OsStr::new(outer)));
            assert_eq!(flags, OsStr::new(want));
            let back = Jobserver::parse("MAKEFLAGS", &flags).unwrap().unwrap();
            assert_eq!(
                (back.auth(), back.flavor(), back.jobs()),
                (&auth, flavor, Some(4))
            );
        }
    }

    #[test]
    fn programs_by_name() {
        let of = |n: &str| Program::of(OsStr::new(n));
        for n in [
            "make",
            "/usr/bin/gmake",
            "gnumake",
            "remake",
            "make-4.4",
            "GMAKE",
            "x86_64-linux-gnu-make",
        ] {
            assert_eq!(of(n), Some(Program::GnuMake), "{n}");
        }
        for n in ["bmake", "bsdmake", "/usr/bin/pmake", "herdless-bmake"] {
            assert_eq!(of(n), Some(Program::Bmake), "{n}");
        }
        assert_eq!(of("samu"), Some(Program::Ninja));
        assert_eq!(of("cargo"), Some(Program::Cargo));
        assert_eq!(of("rustc"), Some(Program::Rustc));
        assert_eq!(of("herdless"), Some(Program::Herdless));
        for n in [
            "sh",
            "makefile.sh",
            "cc",
            "xargs",
            "timeout",
            "",
            "automake",
            "cmake",
            "qmake",
            "imake",
        ] {
            assert_eq!(of(n), None, "{n}");
        }
        assert!(!Program::Herdless.reads_jobserver());
        assert!(!Program::Rustc.runs_each_job_in_a_slot());
        assert_eq!(Flavor::for_command(OsStr::new("bsdmake")), Flavor::Bmake);
        assert_eq!(Flavor::for_command(OsStr::new("./build.sh")), Flavor::Gnu);
        for (line, want) in [
            (&["bmake", "-j4"][..], Flavor::Bmake),
            (&["timeout", "600", "bmake"][..], Flavor::Bmake),
            (
                &["/usr/bin/nice", "-n", "5", "/usr/bin/bmake", "-k"][..],
                Flavor::Bmake,
            ),
            (&["env", "X=1", "bsdmake"][..], Flavor::Bmake),
            (&["env", "BMAKE=/opt/bin/x-bmake", "gmake"][..], Flavor::Gnu),
            (
                &["env", "PATH=/opt/bin:/usr/bin", "bmake"][..],
                Flavor::Bmake,
            ),
            (&["unshare", "--pid", "--fork", "gmake"][..], Flavor::Gnu),
            // An option's value names no program (a directory, a file).
            (&["env", "-C", "build-bmake", "gmake"][..], Flavor::Gnu),
            (&["env", "-Cbuild-bmake", "gmake"][..], Flavor::Gnu),
            (&["env", "--chdir", "x-bmake", "make"][..], Flavor::Gnu),
            (&["env", "-u", "MAKEFLAGS", "bmake"][..], Flavor::Bmake),
            (&["time", "-o", "out-bmake", "gmake"][..], Flavor::Gnu),
            (
                &["bwrap", "--bind", "/src", "/w-bmake", "gmake"][..],
                Flavor::Gnu,
            ),
            (
                &["systemd-run", "--unit", "x-bmake", "--wait", "gmake"][..],
                Flavor::Gnu,
            ),
            // `env -S` splits its value into the command line.
            (&["env", "-S", "bmake -j4"][..], Flavor::Bmake),
            // A wrapper in a wrapper.
            (
                &["nice", "-n", "5", "timeout", "-s", "KILL", "600", "bmake"][..],
                Flavor::Bmake,
            ),
            (
                &["sh", "-c", "env -C build-bmake gmake -j4"][..],
                Flavor::Gnu,
            ),
            (
                &["sh", "-c", "nice -n 5 timeout -k 9 600 bmake"][..],
                Flavor::Bmake,
            ),
            (&["timeout", "600", "./build.sh", "bmake"][..], Flavor::Gnu),
            (&["nice", "-n", "5", "sh", "-c", "bmake"][..], Flavor::Bmake),
            (&["sh", "-c", "bmake"][..], Flavor::Bmake),
            (
                &["/bin/sh", "-ec", "cd src && bmake -j4"][..],
                Flavor::Bmake,
            ),
            (
                &["bash", "-o", "pipefail", "-c", "bmake | tee log"][..],
                Flavor::Bmake,
            ),
            (
                &["sh", "-c", "X=1 timeout 600 bmake all"][..],
                Flavor::Bmake,
            ),
            (
                &["sh", "-c", "for d in a b; do bmake -C $d; done"][..],
                Flavor::Bmake,
            ),
            (
                &["sh", "-c", "(cd a && exec bmake) & wait"][..],
                Flavor::Bmake,
            ),
            (&["timeout", "9", "sh", "-c", "bmake"][..], Flavor::Bmake),
            // Another jobserver reader beside it, or none: GNU's flags.
            (&["sh", "-c", "bmake && cargo build"][..], Flavor::Gnu),
            (&["sh", "-c", "make; bmake"][..], Flavor::Gnu),
            (&["sh", "-c", "./configure && make"][..], Flavor::Gnu),
            // A bmake named as an argument, not run: not looked at.
            (
                &["sh", "-c", "echo bmake; which bmake-tools"][..],
                Flavor::Gnu,
            ),
            (&["sh", "-c", "cp bmake /tmp"][..], Flavor::Gnu),
            (&["sh", "build.sh", "bmake"][..], Flavor::Gnu),
            (&["sh", "-e", "bmake"][..], Flavor::Gnu),
            (&["bash", "--norc", "-c", "bmake"][..], Flavor::Bmake),
            (&["./build.sh", "bmake"][..], Flavor::Gnu),
            (&["timeout", "600"][..], Flavor::Gnu),
            (&[][..], Flavor::Gnu),
        ] {
            assert_eq!(Flavor::for_command_line(line), want, "{line:?}");
        }
        // What runs, for a nested run's choice of a pool of its own.
        use Program::{Bmake, Cargo, GnuMake, Herdless};
        for (line, want) in [
            (&["bmake", "-k"][..], &[Bmake][..]),
            (&["timeout", "600", "make"][..], &[GnuMake][..]),
            (
                &[
                    "sh",
                    "-c",
                    "timeout 600 bmake -f a.mk & herdless exec job & wait",
                ][..],
                &[Bmake, Herdless][..],
            ),
            (
                &["sh", "-c", "make && cargo build"][..],
                &[GnuMake, Cargo][..],
            ),
            (&["sh", "-c", "echo make"][..], &[][..]),
            (&["sh", "build.sh"][..], &[][..]),
            (&["./build.sh"][..], &[][..]),
        ] {
            assert_eq!(Program::run_by_command_line(line), want, "{line:?}");
        }
        for f in Flavor::ALL {
            assert_eq!(f.name().parse::<Flavor>(), Ok(f));
        }
        for s in Style::ALL {
            assert_eq!(s.name().parse::<Style>(), Ok(s));
        }
    }

    use super::*;

    fn parse(value: &str) -> Option<Jobserver> {
        Jobserver::parse("MAKEFLAGS", OsStr::new(value)).unwrap()
    }

    fn fds(read: RawFd, write: RawFd) -> Auth {
        Auth::Fds { read, write }
    }

    #[test]
    fn gnu_make_4_3_pipe() {
        let js = parse("k -j3 --jobserver-auth=3,4 -- FOO=bar").unwrap();
        assert_eq!(js.auth(), &fds(3, 4));
        assert_eq!(js.flavor(), Flavor::Gnu);
        assert_eq!(js.jobs(), Some(3));
        assert_eq!(js.option(), "--jobserver-auth=3,4");
        assert_eq!(js.var(), "MAKEFLAGS");
        // MFLAGS has a dash on the first word.
        let js = parse("-k -j3 --jobserver-auth=3,4").unwrap();
        assert_eq!(js.auth(), &fds(3, 4));
    }

    #[test]
    fn gnu_make_4_4_fifo() {
        let js = parse(" -j3 --jobserver-auth=fifo:/tmp/GMfifo26056").unwrap();
        assert_eq!(js.auth(), &Auth::Fifo("/tmp/GMfifo26056".into()));
        assert_eq!(js.fifo(), Some(Path::new("/tmp/GMfifo26056")));
        assert_eq!(js.flavor(), Flavor::Gnu);
    }

    #[test]
    fn escaped_blanks_in_a_fifo_path() {
        let js = parse(r"-j2 --jobserver-auth=fifo:/tmp/a\ b/fifo -- X=1").unwrap();
        assert_eq!(js.auth(), &Auth::Fifo("/tmp/a b/fifo".into()));
    }

    #[test]
    fn old_jobserver_fds() {
        let js = parse(" --jobserver-fds=5,6 -j").unwrap();
        assert_eq!(js.auth(), &fds(5, 6));
        assert_eq!(js.jobs(), None);
    }

    #[test]
    fn the_last_option_wins() {
        // What the jobserver crate (and so cargo) writes.
        let js = parse("-j --jobserver-fds=3,4 --jobserver-auth=3,4").unwrap();
        assert_eq!(js.auth(), &fds(3, 4));
        let js = parse("--jobserver-auth=3,4 -j4 --jobserver-auth=7,8").unwrap();
        assert_eq!(js.auth(), &fds(7, 8));
        assert_eq!(js.option(), "--jobserver-auth=7,8");
        let js = parse("--jobserver-auth=7,8 --jobserver-fds=9,10").unwrap();
        assert_eq!(js.auth(), &fds(9, 10));
    }

    #[test]
    fn negative_fds_mean_disabled() {
        assert_eq!(
            parse("-j --jobserver-auth=-2,-2").unwrap().auth(),
            &Auth::Disabled
        );
        assert_eq!(parse(" -j 4 -J -1,-1").unwrap().auth(), &Auth::Disabled);
        // A later enabled option still wins.
        assert_eq!(
            parse("--jobserver-fds=-2,-2 --jobserver-auth=3,4")
                .unwrap()
                .auth(),
            &fds(3, 4)
        );
    }

    #[test]
    fn bmake_forms() {
        // What bmake 20200710 exports to its children.
        let js = parse(" -j 4 -J 15,16 .MAKE.LEVEL.ENV=MAKELEVEL FOO=bar").unwrap();
        assert_eq!(js.auth(), &fds(15, 16));
        assert_eq!(js.flavor(), Flavor::Bmake);
        assert_eq!(js.jobs(), Some(4));
        assert_eq!(js.option(), "-J 15,16");
        // What bmake accepts from its environment.
        for v in ["-j 3 -J 3,4", "-j3 -J3,4", "-kJ 3,4 -j3", "-kJ3,4"] {
            let js = parse(v).unwrap_or_else(|| panic!("{v}"));
            assert_eq!(js.auth(), &fds(3, 4), "{v}");
            assert_eq!(js.flavor(), Flavor::Bmake, "{v}");
        }
        // getopt reads "-j4J3,4" as -j with the argument "4J3,4"; so does
        // bmake, so this names no jobserver.
        assert_eq!(parse("-j4J3,4"), None);
    }

    #[test]
    fn arguments_of_other_options_are_not_options() {
        // bmake -I and -m take a path; a J inside it is not -J.
        assert_eq!(parse("-I /J/3,4 -m/usr/share/mk/J"), None);
        assert_eq!(parse("-dJ"), None);
        // A GNU make variable definition after "--" is not read.
        assert_eq!(parse("k -j2 -- X=--jobserver-auth=3,4"), None);
        // Nor a bmake one, which is a word with no dash.
        assert_eq!(parse(" -j 2 X=-J\\ 3,4"), None);
    }

    #[test]
    fn nothing_named() {
        assert_eq!(parse(""), None);
        assert_eq!(parse("k -j4"), None);
        assert_eq!(parse(" -j 4 -B"), None);
    }

    #[test]
    fn malformed_options_are_errors_that_quote_them() {
        for (v, quoted) in [
            ("--jobserver-auth=abc", "--jobserver-auth=abc"),
            ("--jobserver-auth=3", "--jobserver-auth=3"),
            ("--jobserver-auth=3,-1", "--jobserver-auth=3,-1"),
            ("--jobserver-auth=fifo:", "--jobserver-auth=fifo:"),
            ("-J x", "-J x"),
            ("-J", "-J "),
            ("-J fifo:/x", "-J fifo:/x"),
        ] {
            let e = Jobserver::parse("MAKEFLAGS", OsStr::new(v)).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::BadJobserver, "{v}");
            let msg = e.to_string();
            assert!(msg.starts_with("MAKEFLAGS has a malformed"), "{msg}");
            assert!(msg.contains(&format!("{quoted:?}")), "{msg}");
        }
    }

    #[test]
    fn the_first_variable_that_names_one_wins() {
        let pick = |vars: [Option<&str>; 3]| {
            Jobserver::from_vars(VARS.iter().copied().zip(vars.map(|v| v.map(OsStr::new))))
                .unwrap()
                .map(|js| (js.var(), js.auth().clone()))
        };
        assert_eq!(
            pick([
                Some("-j --jobserver-auth=7,8"),
                Some("-j3 --jobserver-auth=3,4"),
                None
            ]),
            Some(("CARGO_MAKEFLAGS", fds(7, 8)))
        );
        // CARGO_MAKEFLAGS without a jobserver is passed over.
        assert_eq!(
            pick([Some("-j4"), Some("k -j3 --jobserver-auth=3,4"), None]),
            Some(("MAKEFLAGS", fds(3, 4)))
        );
        assert_eq!(
            pick([None, Some("k"), Some("-k -j2 --jobserver-auth=5,6")]),
            Some(("MFLAGS", fds(5, 6)))
        );
        // Disabled is an answer: later variables are not consulted.
        assert_eq!(
            pick([
                None,
                Some("-j --jobserver-auth=-2,-2"),
                Some("--jobserver-auth=5,6")
            ]),
            Some(("MAKEFLAGS", Auth::Disabled))
        );
        assert_eq!(pick([None, None, None]), None);
        // A malformed first one is an error, not a reason to look further.
        let e = Jobserver::from_vars([
            ("MAKEFLAGS", Some(OsStr::new("--jobserver-auth=x"))),
            ("MFLAGS", Some(OsStr::new("--jobserver-auth=3,4"))),
        ])
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::BadJobserver);
    }

    #[test]
    fn non_utf8_fifo_paths_survive() {
        let value = OsStr::from_bytes(b"--jobserver-auth=fifo:/tmp/\xff");
        let js = Jobserver::parse("MAKEFLAGS", value).unwrap().unwrap();
        assert_eq!(js.fifo().unwrap().as_os_str().as_bytes(), b"/tmp/\xff");
    }

    #[test]
    fn made_by_hand() {
        let js = Jobserver::new(fds(3, 4), Flavor::Bmake, Some(4));
        assert_eq!(js.option(), "-J 3,4");
        assert_eq!(js.var(), "");
        assert_eq!(js.source(), "the jobserver description");
        assert_eq!(js.to_string(), "bmake jobserver -J 3,4");
    }

    /// A jobserver's identity is its pipe's or FIFO's inode: both ends of
    /// one pipe, or the FIFO's path; anything else names none.
    #[test]
    fn a_fifo_path_with_blanks_and_backslashes_stays_one_word() {
        for path in ["/tmp/sp ace/jobserver.fifo", "/tmp/t\tab\\x/j.fifo"] {
            let js = Jobserver::new(Auth::Fifo(PathBuf::from(path)), Flavor::Gnu, Some(4));
            let flags = js.makeflags(Some(OsStr::new("-k")));
            let back = Jobserver::parse("MAKEFLAGS", &flags)
                .unwrap()
                .expect("a jobserver");
            assert_eq!(back.auth(), &Auth::Fifo(PathBuf::from(path)), "{flags:?}");
            assert_eq!(back.jobs(), Some(4));
        }
    }

    #[test]
    fn identity_is_one_pipe_or_a_fifo() {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::MetadataExt;
        let fds = |r: &std::os::fd::OwnedFd, w: &std::os::fd::OwnedFd| {
            Jobserver::new(
                Auth::Fds {
                    read: r.as_raw_fd(),
                    write: w.as_raw_fd(),
                },
                Flavor::Gnu,
                None,
            )
        };
        let (r, w) = nix::unistd::pipe().unwrap();
        let (r2, w2) = nix::unistd::pipe().unwrap();
        let one = fds(&r, &w).identity().expect("a pipe's two ends");
        let other = fds(&r2, &w2).identity().unwrap();
        assert_ne!(one, other);
        // Ends the wrong way round (a write end where the read end goes):
        // none.
        assert_eq!(fds(&w, &r).identity(), None);
        assert_eq!(fds(&w, &w).identity(), None);
        if cfg!(target_os = "linux") {
            // One inode for both ends; ends of two pipes (a number reused
            // for another pipe) name none.
            assert_eq!(fds(&r, &w2).identity(), None);
        } else {
            // Each end has a number of its own: the read end's counts.
            assert_eq!(fds(&r, &w2).identity(), Some(one));
        }
        // A descriptor that is not a pipe: none.
        let file = std::fs::File::open("/dev/null").unwrap();
        let file = std::os::fd::OwnedFd::from(file);
        assert_eq!(fds(&file, &file).identity(), None);
        // A closed descriptor: none.
        let closed = r2.as_raw_fd();
        drop((r2, w2));
        let gone = Jobserver::new(
            Auth::Fds {
                read: closed,
                write: closed,
            },
            Flavor::Gnu,
            None,
        );
        assert_eq!(gone.identity(), None);
        assert_eq!(
            Jobserver::new(Auth::Disabled, Flavor::Gnu, None).identity(),
            None
        );
        // A FIFO by its path; a path that is gone, or not a FIFO: none.
        let dir = std::env::temp_dir().join(format!("herdless-identity-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let meta = std::fs::metadata(&fifo).unwrap();
        let by_path = |p: &Path| Jobserver::new(Auth::Fifo(p.to_path_buf()), Flavor::Gnu, None);
        assert_eq!(by_path(&fifo).identity(), Some((meta.dev(), meta.ino())));
        assert_eq!(by_path(&dir.join("nothing")).identity(), None);
        assert_eq!(by_path(&dir).identity(), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
