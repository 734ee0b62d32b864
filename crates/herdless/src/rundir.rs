//! Where the broker's socket lives: a directory only its user can enter.
//!
//! Connecting to a Unix socket needs search permission on its directory, so
//! a mode-0700 directory keeps other users out before any credential check;
//! the broker also refuses peers of another uid (see `broker`).

use std::ffi::OsString;
use std::fs::{self, File};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::fcntl::AtFlags;
use nix::sys::stat::{fstatat, SFlag};
use nix::unistd::UnlinkatFlags;

/// The socket's directory; removed on drop when this process made it.
///
/// The directory is checked through a descriptor opened without following
/// a symbolic link (`O_NOFOLLOW`), and the socket is removed through that
/// same descriptor (`unlinkat`), only if the entry is still the socket this
/// process bound: a link swapped in later cannot make it check or delete
/// anything else.
#[derive(Debug)]
pub struct RunDir {
    dir: PathBuf,
    socket: PathBuf,
    /// The directory itself, as checked.
    handle: File,
    /// The socket's name inside `handle`.
    name: OsString,
    owned: bool,
    /// Device and inode of the socket this process bound.
    bound: Option<(u64, u64)>,
}

/// The file name of the socket inside a directory made by [`RunDir::create`].
pub const SOCKET_NAME: &str = "broker.sock";

/// Where this user's private directories go: `$XDG_RUNTIME_DIR`, `$TMPDIR`
/// and `/tmp`, those set and existing, in that order, as absolute paths (a
/// relative one is taken from the current directory): the processes given
/// the paths made there may change directory (a sub-make run as `cd sub &&
/// $(MAKE)`).
pub(crate) fn runtime_bases() -> impl Iterator<Item = PathBuf> {
    ["XDG_RUNTIME_DIR", "TMPDIR"]
        .iter()
        .filter_map(std::env::var_os)
        .map(PathBuf::from)
        .chain(std::iter::once(PathBuf::from("/tmp")))
        .filter(|p| p.is_dir())
        .filter_map(|p| std::path::absolute(p).ok())
}

/// What `make` gives for the first of `bases` where it succeeds; the first
/// error when it succeeds nowhere.
pub(crate) fn first_that_works<T>(
    bases: impl IntoIterator<Item = PathBuf>,
    mut make: impl FnMut(&Path) -> io::Result<T>,
) -> io::Result<T> {
    let mut first_error = None;
    for base in bases {
        match make(&base) {
            Ok(made) => return Ok(made),
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    Err(first_error.unwrap_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            "none of $XDG_RUNTIME_DIR, $TMPDIR and /tmp is a directory",
        )
    }))
}

/// The most bytes a socket's path may have: `sockaddr_un`'s `sun_path`
/// less its terminating NUL (107 on Linux, 103 on the BSDs and macOS).
pub const SOCKET_PATH_MAX: usize = std::mem::size_of::<libc::sockaddr_un>()
    - std::mem::offset_of!(libc::sockaddr_un, sun_path)
    - 1;

fn path_len(path: &Path) -> usize {
    std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str()).len()
}

/// The path by which the socket `path` is bound or reached: `path` itself
/// when it fits in a socket address; on Linux, a longer one through an
/// `O_PATH` descriptor of its directory, `/proc/self/fd/N/NAME`, with the
/// descriptor (to be kept open until the call is made). Elsewhere a path
/// too long is an `InvalidInput` error that says so.
fn reachable(path: &Path) -> io::Result<(PathBuf, Option<File>)> {
    if path_len(path) <= SOCKET_PATH_MAX {
        return Ok((path.to_path_buf(), None));
    }
    #[cfg(target_os = "linux")]
    if let Some((short, dir)) = through_proc_fd(path)? {
        return Ok((short, Some(dir)));
    }
    Err(io::Error::new(
        io::ErrorKind::InvalidInput,
        format!(
            "socket path {} is {} bytes; a socket address holds at most {SOCKET_PATH_MAX} \
             (set TMPDIR, or the socket's path, to a shorter one)",
            path.display(),
            path_len(path)
        ),
    ))
}

/// `/proc/self/fd/N/NAME` for `path`, N an `O_PATH` descriptor of its
/// directory, returned with it; `None` when that is still too long (a
/// long NAME) or `/proc` is not mounted.
#[cfg(target_os = "linux")]
fn through_proc_fd(path: &Path) -> io::Result<Option<(PathBuf, File)>> {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return Ok(None);
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let proc_fd = Path::new("/proc/self/fd");
    if path_len(&proc_fd.join("2147483647").join(name)) > SOCKET_PATH_MAX || !proc_fd.is_dir() {
        return Ok(None);
    }
    let handle = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(dir)
        .map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "cannot open {}, the directory of a socket path too long to use \
                     as it is: {e}",
                    dir.display()
                ),
            )
        })?;
    let short = proc_fd
        .join(std::os::fd::AsRawFd::as_raw_fd(&handle).to_string())
        .join(name);
    Ok(Some((short, handle)))
}

/// Connects to the socket at `path`, however long (see [`reachable`]).
pub fn connect(path: &Path) -> io::Result<std::os::unix::net::UnixStream> {
    let (reach, _dir) = reachable(path)?;
    std::os::unix::net::UnixStream::connect(reach)
}

/// Binds a socket at `path`, however long (see [`reachable`]).
pub fn bind(path: &Path) -> io::Result<std::os::unix::net::UnixListener> {
    let (reach, _dir) = reachable(path)?;
    std::os::unix::net::UnixListener::bind(reach)
}

/// Whether `path` can be bound or connected to as it is.
fn fits(path: &Path) -> bool {
    path_len(path) <= SOCKET_PATH_MAX
}

/// The socket's path in a directory [`RunDir::create_in`] would make in
/// `base`, for its length.
fn example_socket(base: &Path) -> PathBuf {
    base.join(format!("herdless-{}-XXXXXX", std::process::id()))
        .join(SOCKET_NAME)
}

/// What [`RunDir`] calls its directory in errors.
const SOCKET_DIR: &str = "socket directory";

/// Opens the directory `dir` itself and checks, on that open descriptor,
/// that it is private to this user: it is opened with `O_NOFOLLOW |
/// O_DIRECTORY`, so a symbolic link (wherever it points, whoever owns it)
/// or anything not a directory is refused, and `fstat` on the descriptor
/// must show this user as its owner and no group or other permission bits
/// (mode 0700). A directory swapped in after the check cannot pass it.
///
/// `what` names the directory in errors (`"socket directory"`), which say
/// which path is refused and why: `PermissionDenied` for a link, another
/// owner or an open mode; the kernel's error, `NotFound` included, when it
/// cannot be opened.
pub(crate) fn open_private_dir(dir: &Path, what: &str) -> io::Result<File> {
    let handle = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(dir)
        .map_err(|e| {
            let is_link = fs::symlink_metadata(dir).is_ok_and(|m| m.file_type().is_symlink());
            if is_link {
                io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!(
                        "{what} {} is a symbolic link; it must be the directory itself",
                        dir.display()
                    ),
                )
            } else {
                io::Error::new(
                    e.kind(),
                    format!("cannot open {what} {}: {e}", dir.display()),
                )
            }
        })?;
    let meta = handle.metadata().map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("cannot check {what} {}: {e}", dir.display()),
        )
    })?;
    let uid = nix::unistd::geteuid().as_raw();
    if meta.uid() != uid {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{what} {} belongs to uid {}, not to this user ({uid})",
                dir.display(),
                meta.uid()
            ),
        ));
    }
    if meta.mode() & 0o077 != 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{what} {} has mode {:04o}; it must be 0700 so only its user can enter",
                dir.display(),
                meta.mode() & 0o7777
            ),
        ));
    }
    Ok(handle)
}

impl RunDir {
    /// Makes a fresh private directory under `$XDG_RUNTIME_DIR`, `$TMPDIR`
    /// or `/tmp`: the first that is set, exists, lets it make the directory
    /// and leaves the socket's path short enough for a socket address (a
    /// deep `$TMPDIR`, or an `$XDG_RUNTIME_DIR` left by `su` for another
    /// user, is passed over), e.g. `/tmp/herdless-1234-Ab12Cd/broker.sock`.
    /// The error is the first base's when none works.
    pub fn create() -> io::Result<RunDir> {
        RunDir::create_first(runtime_bases().collect())
    }

    /// Makes a fresh private directory in `base`, or, when the socket's
    /// path there would not fit in a socket address (a deep `$TMPDIR`,
    /// say), in the first of `$XDG_RUNTIME_DIR`, `$TMPDIR` and `/tmp` where
    /// it fits and can be made, and in `base` if none: any client on any
    /// system can then reach the socket by the path it is given. A `base`
    /// where the directory cannot be made is an error, as the caller chose
    /// it.
    pub fn create_near(base: &Path) -> io::Result<RunDir> {
        if fits(&example_socket(base)) {
            return RunDir::create_in(base);
        }
        let mut bases: Vec<PathBuf> = runtime_bases().collect();
        bases.push(base.to_path_buf());
        RunDir::create_first(bases)
    }

    /// Makes the directory in the first of `bases` that works, those where
    /// the socket's path fits first (otherwise in order); the error is the
    /// first one's when none works.
    fn create_first(mut bases: Vec<PathBuf>) -> io::Result<RunDir> {
        bases.sort_by_key(|b| !fits(&example_socket(b)));
        first_that_works(bases, RunDir::create_in)
    }

    /// Makes a fresh private directory in `base`, e.g.
    /// `BASE/herdless-1234-Ab12Cd/broker.sock`.
    ///
    /// The paths kept have `base`'s form, relative if it is (a make's own
    /// FIFO keeps the form of its `TMPDIR`, as stock GNU make's does).
    pub fn create_in(base: &Path) -> io::Result<RunDir> {
        let template = base.join(format!("herdless-{}-XXXXXX", std::process::id()));
        // mkdtemp creates the directory with mode 0700.
        let dir = nix::unistd::mkdtemp(&template).map_err(|e| {
            io::Error::new(
                io::Error::from(e).kind(),
                format!(
                    "cannot create a private directory in {}: {e}",
                    base.display()
                ),
            )
        })?;
        let handle = match open_private_dir(&dir, SOCKET_DIR) {
            Ok(h) => h,
            Err(e) => {
                let _ = fs::remove_dir(&dir);
                return Err(e);
            }
        };
        let socket = dir.join(SOCKET_NAME);
        Ok(RunDir {
            dir,
            socket,
            handle,
            name: SOCKET_NAME.into(),
            owned: true,
            bound: None,
        })
    }

    /// Uses `socket` as the socket path. Its directory is created with mode
    /// 0700 when missing; an existing one must be a directory, not a
    /// symbolic link to one, belong to this user and let no one else in (no
    /// group or other permission bits), otherwise this fails with
    /// `PermissionDenied` and says why.
    ///
    /// A relative `socket` is taken from the current directory, and kept
    /// as an absolute path (see [`RunDir::create_in`]).
    pub fn at(socket: &Path) -> io::Result<RunDir> {
        let socket = &std::path::absolute(socket)?;
        let dir = match socket.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let name = socket
            .file_name()
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{} names no socket file", socket.display()),
                )
            })?
            .to_owned();
        let mut owned = false;
        let opened = match open_private_dir(&dir, SOCKET_DIR) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                fs::DirBuilder::new()
                    .mode(0o700)
                    .create(&dir)
                    .map_err(|e| {
                        io::Error::new(e.kind(), format!("cannot create {}: {e}", dir.display()))
                    })?;
                owned = true;
                open_private_dir(&dir, SOCKET_DIR)
            }
            opened => opened,
        };
        let handle = match opened {
            Ok(h) => h,
            Err(e) => {
                if owned {
                    let _ = fs::remove_dir(&dir);
                }
                return Err(e);
            }
        };
        Ok(RunDir {
            dir,
            socket: socket.to_path_buf(),
            handle,
            name,
            owned,
            bound: None,
        })
    }

    /// The socket entry in the checked directory, if it is a socket.
    fn socket_id(&self) -> Option<(u64, u64)> {
        let st = fstatat(
            &self.handle,
            self.name.as_os_str(),
            AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .ok()?;
        let is_socket = SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFSOCK;
        #[allow(clippy::unnecessary_cast)] // dev_t and ino_t vary by OS
        is_socket.then_some((st.st_dev as u64, st.st_ino as u64))
    }

    /// Records that this process bound the socket, so that dropping the
    /// directory removes it. A socket some other broker listens on is never
    /// removed, nor anything that is not the socket bound now.
    pub fn set_bound(&mut self) {
        self.bound = self.socket_id();
    }

    /// The socket's path.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The directory holding the socket.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        if self.bound.is_some() && self.socket_id() == self.bound {
            let _ = nix::unistd::unlinkat(
                &self.handle,
                self.name.as_os_str(),
                UnlinkatFlags::NoRemoveDir,
            );
        }
        if self.owned {
            // rmdir never follows a final symbolic link and removes only an
            // empty directory.
            let _ = fs::remove_dir(&self.dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn created_dir_is_private_and_removed() {
        let d = RunDir::create().unwrap();
        let mode = fs::metadata(d.dir()).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        let dir = d.dir().to_path_buf();
        drop(d);
        assert!(!dir.exists());
    }

    #[test]
    fn a_base_too_deep_for_a_socket_is_passed_over() {
        let d = RunDir::create().unwrap();
        let deep = d.dir().join("d".repeat(80)).join("e".repeat(80));
        fs::create_dir_all(&deep).unwrap();
        let near = RunDir::create_near(&deep).unwrap();
        assert!(fits(near.socket()), "{}", near.socket().display());
        assert!(!near.dir().starts_with(&deep));
        // A base where it fits is kept.
        let here = RunDir::create_near(d.dir()).unwrap();
        assert_eq!(here.dir().parent(), Some(d.dir()));
        // One where nothing can be made is the caller's error.
        let gone = RunDir::create_near(&d.dir().join("gone")).unwrap_err();
        assert_eq!(gone.kind(), io::ErrorKind::NotFound, "{gone}");
        // Among the defaults, one where nothing can be made is passed
        // over for the next.
        let next = RunDir::create_first(vec![d.dir().join("gone"), d.dir().to_path_buf()]).unwrap();
        assert_eq!(next.dir().parent(), Some(d.dir()));
        drop((near, here, next));
        fs::remove_dir_all(d.dir().join("d".repeat(80))).unwrap();
    }

    #[test]
    fn long_socket_paths_are_bound_and_reached_or_refused_with_the_limit() {
        use std::io::{Read, Write};
        let d = RunDir::create().unwrap();
        let deep = d.dir().join("d".repeat(80)).join("e".repeat(80));
        fs::create_dir_all(&deep).unwrap();
        let path = deep.join("s.sock");
        assert!(!fits(&path));
        match (bind(&path), cfg!(target_os = "linux")) {
            (Ok(listener), true) => {
                let mut client = connect(&path).unwrap();
                let (mut server, _) = listener.accept().unwrap();
                client.write_all(b"hi").unwrap();
                let mut got = [0u8; 2];
                server.read_exact(&mut got).unwrap();
                assert_eq!(&got, b"hi");
                // The socket is where the long path says.
                assert!(path.exists());
            }
            (Err(e), false) => {
                assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
                assert!(e.to_string().contains("at most"), "{e}");
            }
            (bound, linux) => panic!("on Linux: {linux}, bound: {:?}", bound.map(|_| ())),
        }
        // A name that alone is too long cannot be reached anywhere.
        let err = connect(&deep.join("n".repeat(120))).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        assert!(
            err.to_string().contains(&SOCKET_PATH_MAX.to_string()),
            "{err}"
        );
        fs::remove_dir_all(d.dir().join("d".repeat(80))).unwrap();
    }

    #[test]
    fn open_dirs_are_refused() {
        let d = RunDir::create().unwrap();
        let open = d.dir().join("open");
        fs::create_dir(&open).unwrap();
        fs::set_permissions(&open, fs::Permissions::from_mode(0o755)).unwrap();
        let err = RunDir::at(&open.join("s.sock")).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied);
        assert!(err.to_string().contains("0755"), "{err}");
        fs::remove_dir(&open).unwrap();
        // A missing directory is made private.
        let made = RunDir::at(&d.dir().join("new").join("s.sock")).unwrap();
        let mode = fs::metadata(made.dir()).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
    }

    #[test]
    fn private_dir_errors_name_the_path_and_the_fault() {
        let d = RunDir::create().unwrap();
        // Not a directory.
        let file = d.dir().join("file");
        fs::write(&file, b"").unwrap();
        let err = open_private_dir(&file, "slot directory").unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("slot directory") && msg.contains("file"),
            "{msg}"
        );
        // Missing: the kernel's kind, so a caller can make it.
        let err = open_private_dir(&d.dir().join("none"), "slot directory").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
        // Open to the group.
        let open = d.dir().join("open");
        fs::DirBuilder::new().mode(0o750).create(&open).unwrap();
        fs::set_permissions(&open, fs::Permissions::from_mode(0o750)).unwrap();
        let err = open_private_dir(&open, "slot directory").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied);
        assert!(err.to_string().contains("mode 0750"), "{err}");
        // A link to a private directory.
        let mine = d.dir().join("mine");
        fs::DirBuilder::new().mode(0o700).create(&mine).unwrap();
        let link = d.dir().join("link");
        std::os::unix::fs::symlink(&mine, &link).unwrap();
        let err = open_private_dir(&link, "slot directory").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied);
        assert!(err.to_string().contains("symbolic link"), "{err}");
        assert!(open_private_dir(&mine, "slot directory").is_ok());
        fs::remove_file(&file).unwrap();
        fs::remove_file(&link).unwrap();
        fs::remove_dir(&open).unwrap();
        fs::remove_dir(&mine).unwrap();
    }

    /// Makes `path` (a symbolic link) belong to uid 65534 where this
    /// process may (as root); otherwise leaves it as it is.
    fn give_away(path: &Path) {
        let _ = std::os::unix::fs::lchown(path, Some(65534), Some(65534));
    }

    #[test]
    fn a_symlinked_directory_is_refused() {
        let d = RunDir::create().unwrap();
        // A link (of another uid where possible) to a private directory of
        // this user: the owner check must not follow it.
        let mine = d.dir().join("mine");
        fs::DirBuilder::new().mode(0o700).create(&mine).unwrap();
        let link = d.dir().join("link");
        std::os::unix::fs::symlink(&mine, &link).unwrap();
        give_away(&link);
        let err = RunDir::at(&link.join("s.sock")).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied);
        assert!(err.to_string().contains("symbolic link"), "{err}");
        // A link to a directory of another uid.
        let theirs = d.dir().join("theirs");
        fs::DirBuilder::new().mode(0o700).create(&theirs).unwrap();
        let _ = std::os::unix::fs::chown(&theirs, Some(65534), Some(65534));
        let link2 = d.dir().join("link2");
        std::os::unix::fs::symlink(&theirs, &link2).unwrap();
        give_away(&link2);
        let err = RunDir::at(&link2.join("s.sock")).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied);
        assert!(err.to_string().contains("symbolic link"), "{err}");
        if fs::metadata(&theirs).unwrap().uid() == 65534 {
            // Named directly, it is refused for its owner.
            let err = RunDir::at(&theirs.join("s.sock")).unwrap_err();
            assert!(err.to_string().contains("uid 65534"), "{err}");
        }
        for p in [&link, &link2] {
            fs::remove_file(p).unwrap();
        }
        for p in [&mine, &theirs] {
            fs::remove_dir(p).unwrap();
        }
    }

    #[test]
    fn cleanup_removes_only_the_socket_it_bound() {
        let d = RunDir::create().unwrap();
        let a = d.dir().join("a");
        fs::DirBuilder::new().mode(0o700).create(&a).unwrap();
        let mut run = RunDir::at(&a.join("s.sock")).unwrap();
        let _listener = std::os::unix::net::UnixListener::bind(run.socket()).unwrap();
        run.set_bound();
        // While it serves, its directory is moved away and a link to
        // another directory holding a socket of the same name takes its
        // place.
        let moved = d.dir().join("moved");
        fs::rename(&a, &moved).unwrap();
        let other = d.dir().join("other");
        fs::DirBuilder::new().mode(0o700).create(&other).unwrap();
        let _victim = std::os::unix::net::UnixListener::bind(other.join("s.sock")).unwrap();
        std::os::unix::fs::symlink(&other, &a).unwrap();
        drop(run);
        assert!(
            other.join("s.sock").exists(),
            "removed a socket it did not bind"
        );
        // Its own socket went, through the directory it checked.
        assert!(!moved.join("s.sock").exists());

        // A socket replaced by another file under the same name stays.
        fs::remove_file(&a).unwrap();
        fs::remove_file(other.join("s.sock")).unwrap();
        let mut run = RunDir::at(&other.join("s.sock")).unwrap();
        let listener = std::os::unix::net::UnixListener::bind(run.socket()).unwrap();
        run.set_bound();
        drop(listener);
        fs::remove_file(other.join("s.sock")).unwrap();
        fs::write(other.join("s.sock"), b"keep").unwrap();
        drop(run);
        assert_eq!(fs::read(other.join("s.sock")).unwrap(), b"keep");
        fs::remove_file(other.join("s.sock")).unwrap();
        for p in [&moved, &other] {
            fs::remove_dir(p).unwrap();
        }
    }
}
