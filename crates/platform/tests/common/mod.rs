//! What the platform crate's tests share.

use std::process::Command;

/// This test binary, to be run again as its `helper_process` test alone
/// (the caller adds the role in the environment).
pub fn helper_command() -> Command {
    let mut cmd = Command::new(std::env::current_exe().expect("this test binary"));
    cmd.args([
        "--exact",
        "helper_process",
        "--nocapture",
        "--test-threads=1",
    ]);
    cmd
}
