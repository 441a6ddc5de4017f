//! The tests' Python: a virtual environment of their own (scripts/testenv.py), with every
//! package any test imports. Made once per requirements file under a file lock, so test
//! binaries started at once, or run alone, each find it whole; the system interpreter's
//! site-packages are never touched.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../scripts")
        .join(name)
}

/// The environment's interpreter, made if need be; None (after saying so) when the tester
/// opted out of `python`. Otherwise a missing part fails the test, naming the command.
pub fn interpreter() -> Option<PathBuf> {
    static READY: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let ready = READY.get_or_init(|| ensure(None));
    match ready {
        Ok(p) => Some(p.clone()),
        Err(why) => {
            super::missing_part("python", why);
            None
        }
    }
}

/// Runs `scripts/testenv.py ensure` (with `requirements` instead of the tests' own):
/// the interpreter's path, or why there is none with the command that provides it.
pub fn ensure(requirements: Option<&Path>) -> Result<PathBuf, String> {
    let mut cmd = Command::new("python3");
    cmd.arg(script("testenv.py")).arg("ensure");
    if let Some(r) = requirements {
        cmd.arg("--requirements").arg(r);
    }
    let out = cmd.stderr(Stdio::inherit()).output().map_err(|e| {
        format!("no python3 ({e}); install it (apt-get install python3 python3-venv)")
    })?;
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() || path.is_empty() {
        return Err(format!(
            "`python3 scripts/testenv.py ensure` failed ({}); it makes the tests' virtual environment \
             from scripts/test-requirements.txt (network needed once)",
            out.status
        ));
    }
    Ok(PathBuf::from(path))
}
