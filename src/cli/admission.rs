//! `--max-load`, `--min-free-memory`, `--min-jobs`: the admission limits
//! that `run` and `serve` share.

use anyhow::{bail, Result};

use herdless::broker::Admission;

#[derive(clap::Args, Debug)]
pub struct AdmissionArgs {
    /// Grant no job token while the 1-minute load average is above L (as
    /// make's -l). Re-checked on every grant and release, and once a second
    /// while only this limit holds a waiter back.
    #[arg(long, value_name = "L")]
    max_load: Option<f64>,
    /// Grant no job token while less memory than SIZE is available (bytes,
    /// or with a K, M, G or T suffix: powers of 1024). Linux only.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    min_free_memory: Option<u64>,
    /// Let at least M jobs run whatever the limits say, counting the
    /// command's own job as -j does, so a build always progresses.
    #[arg(long, value_name = "M", default_value_t = 1)]
    min_jobs: u32,
}

impl AdmissionArgs {
    /// The limits, checked.
    pub fn admission(&self) -> Result<Admission> {
        if let Some(l) = self.max_load {
            if !(l.is_finite() && l >= 0.0) {
                bail!("--max-load {l} must be a number, 0 or more");
            }
        }
        if self.min_free_memory.is_some()
            && herdless_platform::available_memory().is_none()
            && std::env::var_os(herdless::broker::SYSTEM_HOOK_ENV).is_none()
        {
            bail!("--min-free-memory: this OS does not report available memory");
        }
        Ok(Admission {
            max_load: self.max_load,
            min_free_memory: self.min_free_memory,
            min_jobs: self.min_jobs,
        })
    }
}

/// `SIZE`: bytes, or a number with a K, M, G or T suffix (KiB and so on
/// are accepted too), in powers of 1024.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let shift = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        "T" | "TB" | "TIB" => 40,
        other => return Err(format!("unknown size unit {other:?} (use K, M, G or T)")),
    };
    let value: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (e.g. 512M, 2G)"))?;
    let bytes = value * (1u64 << shift) as f64;
    if !(bytes.is_finite() && bytes >= 0.0 && bytes < u64::MAX as f64) {
        return Err(format!("{s:?} is out of range"));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1048576"), Ok(1 << 20));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("1.5k"), Ok(1536));
        assert!(parse_size("12X").is_err());
        assert!(parse_size("").is_err());
    }
}
