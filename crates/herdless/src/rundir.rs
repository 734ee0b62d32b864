//! Where the broker's socket lives: a directory only its user can enter.
//!
//! Connecting to a Unix socket needs search permission on its directory, so
//! a mode-0700 directory keeps other users out before any credential check;
//! the broker also refuses peers of another uid (see `broker`).

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The socket's directory; removed on drop when this process made it.
#[derive(Debug)]
pub struct RunDir {
    dir: PathBuf,
    socket: PathBuf,
    owned: bool,
    bound: bool,
}

/// The file name of the socket inside a directory made by [`RunDir::create`].
pub const SOCKET_NAME: &str = "broker.sock";

impl RunDir {
    /// Makes a fresh private directory under `$XDG_RUNTIME_DIR`, `$TMPDIR`
    /// or `/tmp` (the first that is set and exists), e.g.
    /// `/tmp/herdless-1234-Ab12Cd/broker.sock`.
    pub fn create() -> io::Result<RunDir> {
        let base = ["XDG_RUNTIME_DIR", "TMPDIR"]
            .iter()
            .filter_map(std::env::var_os)
            .map(PathBuf::from)
            .find(|p| p.is_dir())
            .unwrap_or_else(|| PathBuf::from("/tmp"));
        RunDir::create_in(&base)
    }

    /// Makes a fresh private directory in `base`, e.g.
    /// `BASE/herdless-1234-Ab12Cd/broker.sock`.
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
        let socket = dir.join(SOCKET_NAME);
        Ok(RunDir {
            dir,
            socket,
            owned: true,
            bound: false,
        })
    }

    /// Uses `socket` as the socket path. Its directory is created with mode
    /// 0700 when missing; an existing one must belong to this user and let
    /// no one else in (no group or other permission bits), otherwise this
    /// fails with `PermissionDenied` and says why.
    pub fn at(socket: &Path) -> io::Result<RunDir> {
        let dir = match socket.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let owned = match fs::metadata(&dir) {
            Ok(meta) => {
                let uid = nix::unistd::geteuid().as_raw();
                if meta.uid() != uid {
                    return Err(io::Error::new(
                        io::ErrorKind::PermissionDenied,
                        format!(
                            "socket directory {} belongs to uid {}, not to this user ({uid})",
                            dir.display(),
                            meta.uid()
                        ),
                    ));
                }
                if meta.permissions().mode() & 0o077 != 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::PermissionDenied,
                        format!(
                            "socket directory {} has mode {:04o}; it must be 0700 so only its user can enter",
                            dir.display(),
                            meta.permissions().mode() & 0o7777
                        ),
                    ));
                }
                false
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                fs::DirBuilder::new()
                    .mode(0o700)
                    .create(&dir)
                    .map_err(|e| {
                        io::Error::new(e.kind(), format!("cannot create {}: {e}", dir.display()))
                    })?;
                true
            }
            Err(e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("cannot inspect {}: {e}", dir.display()),
                ))
            }
        };
        Ok(RunDir {
            dir,
            socket: socket.to_path_buf(),
            owned,
            bound: false,
        })
    }

    /// Records that this process bound the socket, so that dropping the
    /// directory removes it. A socket some other broker listens on is never
    /// removed.
    pub fn set_bound(&mut self) {
        self.bound = true;
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
        if self.bound {
            let _ = fs::remove_file(&self.socket);
        }
        if self.owned {
            let _ = fs::remove_dir(&self.dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
