//! The running kernel's name and release.

/// The running kernel, as `uname()` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Kernel {
    /// `utsname.sysname`: "Linux", "FreeBSD", "NetBSD", "Darwin", ...
    pub sysname: String,
    /// `utsname.release`: "6.18.0-1-amd64", "14.1-RELEASE", "23.4.0", ...
    pub release: String,
}

impl Kernel {
    /// The release's leading `(major, minor)`, see [`parse_release`].
    pub fn version(&self) -> Option<(u32, u32)> {
        parse_release(&self.release)
    }

    /// Whether the release is at least `major.minor`. An unparsable release
    /// counts as older than any version, so callers never assume a feature
    /// they cannot confirm.
    pub fn at_least(&self, major: u32, minor: u32) -> bool {
        self.version().is_some_and(|v| v >= (major, minor))
    }
}

/// `uname()` — the running kernel's sysname and release.
///
/// Never fails: `uname()` can only fail with `EFAULT`, which the call
/// cannot cause; should it fail anyway, both fields are empty.
///
/// # Portability
///
/// All Unix systems. On macOS the release is Darwin's (23.x is macOS 14).
pub fn kernel() -> Kernel {
    match nix::sys::utsname::uname() {
        Ok(u) => Kernel {
            sysname: u.sysname().to_string_lossy().into_owned(),
            release: u.release().to_string_lossy().into_owned(),
        },
        Err(_) => Kernel {
            sysname: String::new(),
            release: String::new(),
        },
    }
}

/// Parses the leading `major.minor` of a kernel release string:
/// "6.18.0-rc1" gives `(6, 18)`, "14.1-RELEASE-p3" gives `(14, 1)`, "10"
/// gives `(10, 0)`. `None` when the string does not start with a number.
pub fn parse_release(release: &str) -> Option<(u32, u32)> {
    fn number(s: &str) -> (Option<u32>, &str) {
        let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        (s[..end].parse().ok(), &s[end..])
    }
    let (major, rest) = number(release);
    let major = major?;
    let minor = rest
        .strip_prefix('.')
        .and_then(|r| number(r).0)
        .unwrap_or(0);
    Some((major, minor))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_releases() {
        assert_eq!(parse_release("6.18.0-1-amd64"), Some((6, 18)));
        assert_eq!(parse_release("5.6.0"), Some((5, 6)));
        assert_eq!(parse_release("14.1-RELEASE-p3"), Some((14, 1)));
        assert_eq!(parse_release("23.4.0"), Some((23, 4)));
        assert_eq!(parse_release("10"), Some((10, 0)));
        assert_eq!(parse_release("4."), Some((4, 0)));
        assert_eq!(parse_release(""), None);
        assert_eq!(parse_release("v6.1"), None);
        assert_eq!(parse_release("99999999999.1"), None);
    }

    #[test]
    fn at_least_compares_major_then_minor() {
        let k = Kernel {
            sysname: "Linux".into(),
            release: "5.6.0".into(),
        };
        assert!(k.at_least(4, 5));
        assert!(k.at_least(5, 6));
        assert!(!k.at_least(5, 7));
        assert!(!k.at_least(6, 0));
        let unknown = Kernel {
            sysname: "Linux".into(),
            release: "weird".into(),
        };
        assert!(!unknown.at_least(0, 0));
    }

    #[test]
    fn running_kernel_has_a_version() {
        let k = kernel();
        assert!(!k.sysname.is_empty());
        assert!(k.version().is_some(), "release {:?}", k.release);
    }
}
