//! Named pipes, and the records waiters send their coordinator through one.
//!
//! Every process opens the FIFOs it needs by path, so no descriptor has to
//! be inherited across `exec` (which would need an unsafe adoption of a raw
//! descriptor in the child). Each record is one text line written with one
//! `write()` of less than `PIPE_BUF` (512 bytes on every supported system),
//! which POSIX makes atomic: records of many writers never interleave.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::Duration;

use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::stat::Mode as Perm;

/// Lines stay below POSIX's smallest `PIPE_BUF`.
const MAX_LINE: usize = 500;

/// `mkfifo(path, 0600)`.
pub(crate) fn make_fifo(path: &Path) -> io::Result<()> {
    nix::unistd::mkfifo(path, Perm::S_IRUSR | Perm::S_IWUSR).map_err(|e| {
        io::Error::new(
            io::Error::from(e).kind(),
            format!("cannot make the FIFO {}: {e}", path.display()),
        )
    })
}

/// Opens a FIFO for reading with a description of this process's own.
///
/// The open itself is always non-blocking (a blocking open waits for a
/// writer, fifo(7)); `nonblocking: false` then clears `O_NONBLOCK` on the
/// new description, which no other process shares.
pub(crate) fn open_fifo_read(path: &Path, nonblocking: bool) -> io::Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| io::Error::new(e.kind(), format!("cannot open {}: {e}", path.display())))?;
    if !nonblocking {
        set_nonblocking(&file, false)?;
    }
    Ok(file)
}

/// Opens a FIFO for writing. Fails with `ENXIO` when no process has it
/// open for reading (fifo(7)), instead of waiting for one.
pub(crate) fn open_fifo_write(path: &Path, nonblocking: bool) -> io::Result<File> {
    let file = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot open {} for writing: {e}", path.display()),
            )
        })?;
    if !nonblocking {
        set_nonblocking(&file, false)?;
    }
    Ok(file)
}

fn set_nonblocking(file: &File, yes: bool) -> io::Result<()> {
    let flags = OFlag::from_bits_retain(fcntl(file, FcntlArg::F_GETFL)?);
    let flags = if yes {
        flags | OFlag::O_NONBLOCK
    } else {
        flags - OFlag::O_NONBLOCK
    };
    fcntl(file, FcntlArg::F_SETFL(flags))?;
    Ok(())
}

/// Waits up to `timeout` for `file` to be readable (or hung up).
/// `Ok(false)` on timeout; a signal counts as a spurious wake-up.
pub(crate) fn wait_readable(file: &File, timeout: Duration) -> io::Result<bool> {
    let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    let mut fds = [PollFd::new(file.as_fd(), PollFlags::POLLIN)];
    match nix::poll::poll(
        &mut fds,
        PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX),
    ) {
        Ok(n) => Ok(n > 0),
        Err(nix::errno::Errno::EINTR) => Ok(true),
        Err(e) => Err(e.into()),
    }
}

/// What a waiter tells its coordinator. Times are nanoseconds of the
/// machine-wide monotonic clock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Record {
    /// Set up, and about to wait for the first time.
    Ready { idx: u32, pid: u32 },
    /// Got a token: began wanting it at `t_want`, had it at `t_got`.
    /// Herdless mode: `t_rel` is when this waiter gave back the token it
    /// got before, if it did and has not said so yet. A herdless waiter
    /// keeps these until it is stopped (see [`Record::Drained`]).
    Got {
        idx: u32,
        t_want: u64,
        t_got: u64,
        t_rel: Option<u64>,
    },
    /// Herdless mode: this waiter's grant spent the budget; it was the
    /// last of the cell. Herdless waiters pass tokens on among themselves,
    /// and the coordinator has no part in a hand-off: a record per grant
    /// would wake it in the middle of the next one, for the measurement
    /// alone. So they keep their `Got` records until the stop, and this
    /// one record ends the grant phase.
    Drained { idx: u32 },
    /// Told to stop. `wakes`: sleeps ended during the grant phase;
    /// `cpu_ns`: user + system time since `Ready`; `t_want`: when the wait
    /// that the stop ended began; `t_rel`: its last give-back, if no
    /// `Got` said it.
    Final {
        idx: u32,
        wakes: u64,
        cpu_ns: u64,
        t_want: u64,
        t_rel: Option<u64>,
    },
    /// The waiter failed; it exits after this.
    Failed { idx: u32, message: String },
}

impl Record {
    fn encode(&self) -> String {
        let mut line = match self {
            Record::Ready { idx, pid } => format!("ready {idx} {pid}"),
            Record::Drained { idx } => format!("drained {idx}"),
            Record::Got {
                idx,
                t_want,
                t_got,
                t_rel,
            } => format!("got {idx} {t_want} {t_got} {}", t_rel.unwrap_or(0)),
            Record::Final {
                idx,
                wakes,
                cpu_ns,
                t_want,
                t_rel,
            } => format!(
                "final {idx} {wakes} {cpu_ns} {t_want} {}",
                t_rel.unwrap_or(0)
            ),
            Record::Failed { idx, message } => {
                let one_line: String = message
                    .chars()
                    .map(|c| if c.is_control() { ' ' } else { c })
                    .collect();
                let mut s = format!("failed {idx} {one_line}");
                while s.len() > MAX_LINE {
                    s.pop();
                }
                s
            }
        };
        line.push('\n');
        line
    }

    fn parse(line: &str) -> Option<Record> {
        let mut words = line.split(' ');
        let kind = words.next()?;
        let idx = words.next()?.parse().ok()?;
        if kind == "failed" {
            let message = words.collect::<Vec<_>>().join(" ");
            return Some(Record::Failed { idx, message });
        }
        let nums: Vec<u64> = words.map(|w| w.parse().ok()).collect::<Option<_>>()?;
        match (kind, nums.as_slice()) {
            ("ready", &[pid]) => Some(Record::Ready {
                idx,
                pid: u32::try_from(pid).ok()?,
            }),
            ("drained", &[]) => Some(Record::Drained { idx }),
            ("got", &[t_want, t_got, t_rel]) => Some(Record::Got {
                idx,
                t_want,
                t_got,
                t_rel: (t_rel != 0).then_some(t_rel),
            }),
            ("final", &[wakes, cpu_ns, t_want, t_rel]) => Some(Record::Final {
                idx,
                wakes,
                cpu_ns,
                t_want,
                t_rel: (t_rel != 0).then_some(t_rel),
            }),
            _ => None,
        }
    }
}

/// A waiter's end of the record FIFO.
pub(crate) struct RecordWriter {
    fifo: File,
}

impl RecordWriter {
    /// Opens the FIFO, which the coordinator holds open for reading. Writes
    /// block while it is full.
    pub(crate) fn open(path: &Path) -> io::Result<RecordWriter> {
        Ok(RecordWriter {
            fifo: open_fifo_write(path, false)?,
        })
    }

    pub(crate) fn send(&mut self, record: &Record) -> io::Result<()> {
        let line = record.encode();
        // One write() of under PIPE_BUF bytes: all of it, atomically.
        let n = self.fifo.write(line.as_bytes())?;
        if n != line.len() {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                format!("short write of a record: {n} of {} bytes", line.len()),
            ));
        }
        Ok(())
    }
}

/// The coordinator's end of the record FIFO.
pub(crate) struct RecordReader {
    fifo: File,
    buf: Vec<u8>,
}

impl RecordReader {
    /// Opens the FIFO for reading, before any waiter opens it for writing.
    pub(crate) fn open(path: &Path) -> io::Result<RecordReader> {
        Ok(RecordReader {
            fifo: open_fifo_read(path, true)?,
            buf: Vec::with_capacity(64 * 1024),
        })
    }

    fn take_line(&mut self) -> io::Result<Option<Record>> {
        let Some(end) = self.buf.iter().position(|&b| b == b'\n') else {
            return Ok(None);
        };
        let line: Vec<u8> = self.buf.drain(..=end).collect();
        let text = String::from_utf8_lossy(&line[..end]);
        Record::parse(&text).map(Some).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("unreadable record from a waiter: {text:?}"),
            )
        })
    }

    /// The next record that has arrived, without waiting.
    pub(crate) fn try_next(&mut self) -> io::Result<Option<Record>> {
        if let Some(r) = self.take_line()? {
            return Ok(Some(r));
        }
        let mut chunk = [0u8; 16 * 1024];
        loop {
            match self.fifo.read(&mut chunk) {
                // No writer left (or none yet): nothing more for now.
                Ok(0) => return Ok(None),
                Ok(n) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    if let Some(r) = self.take_line()? {
                        return Ok(Some(r));
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// The next record, waiting up to `timeout` for one; `None` when none
    /// came in time.
    pub(crate) fn next(&mut self, timeout: Duration) -> io::Result<Option<Record>> {
        if let Some(r) = self.try_next()? {
            return Ok(Some(r));
        }
        if wait_readable(&self.fifo, timeout)? {
            return self.try_next();
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip() {
        let records = [
            Record::Ready { idx: 3, pid: 4242 },
            Record::Drained { idx: 7 },
            Record::Got {
                idx: 1,
                t_want: 10,
                t_got: 20,
                t_rel: Some(30),
            },
            Record::Got {
                idx: 1,
                t_want: 10,
                t_got: 20,
                t_rel: None,
            },
            Record::Final {
                idx: 9,
                wakes: 5,
                cpu_ns: 123456,
                t_want: 77,
                t_rel: Some(70),
            },
            Record::Final {
                idx: 9,
                wakes: 5,
                cpu_ns: 123456,
                t_want: 77,
                t_rel: None,
            },
            Record::Failed {
                idx: 2,
                message: "cannot open x: No such file".into(),
            },
        ];
        for r in records {
            let line = r.encode();
            assert!(line.ends_with('\n') && line.len() < MAX_LINE);
            assert_eq!(Record::parse(line.trim_end()), Some(r));
        }
        assert_eq!(Record::parse("got 1 2"), None);
        assert_eq!(Record::parse("drained 1 2"), None);
        assert_eq!(Record::parse("nonsense"), None);
    }

    #[test]
    fn long_failures_stay_atomic() {
        let r = Record::Failed {
            idx: 1,
            message: "x\n".repeat(1000),
        };
        let line = r.encode();
        assert!(line.len() <= MAX_LINE + 1);
        assert_eq!(line.matches('\n').count(), 1);
    }

    #[test]
    fn records_cross_a_fifo() {
        let dir = herdless::rundir::RunDir::create().unwrap();
        let path = dir.dir().join("records");
        make_fifo(&path).unwrap();
        let mut reader = RecordReader::open(&path).unwrap();
        assert_eq!(reader.next(Duration::from_millis(1)).unwrap(), None);
        let mut writer = RecordWriter::open(&path).unwrap();
        writer.send(&Record::Ready { idx: 0, pid: 1 }).unwrap();
        writer.send(&Record::Ready { idx: 1, pid: 2 }).unwrap();
        let got = reader.next(Duration::from_secs(5)).unwrap();
        assert_eq!(got, Some(Record::Ready { idx: 0, pid: 1 }));
        let got = reader.try_next().unwrap();
        assert_eq!(got, Some(Record::Ready { idx: 1, pid: 2 }));
        std::fs::remove_file(&path).unwrap();
    }
}
