//! Running commands visibly and timing steps.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// The repository root (the parent of this crate's directory).
pub fn repo_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the repository root")
}

/// A path relative to the repository root, for messages.
pub fn rel(path: &Path) -> PathBuf {
    path.strip_prefix(repo_root())
        .map_or_else(|_| path.to_path_buf(), Path::to_path_buf)
}

/// The name a results file takes from a model: a GGUF path's file stem, else the manifest
/// name whole (manifest names hold dots: `qwen2.5-coder-0.5b`).
pub fn results_name(model: &str) -> String {
    match Path::new(model).file_stem() {
        Some(stem) if model.ends_with(".gguf") => stem.to_string_lossy().into_owned(),
        _ => model.to_owned(),
    }
}

/// `base` with `.ext` appended to its file name (`Path::with_extension` would replace what
/// follows a dot inside the name).
pub fn suffixed(base: &Path, ext: &str) -> PathBuf {
    let mut s = base.as_os_str().to_owned();
    s.push(".");
    s.push(ext);
    PathBuf::from(s)
}

/// `cargo` from `PATH` (the rustup proxy, which keeps the pinned toolchain), run from the
/// repository root.
pub fn cargo<I, S>(args: I) -> Command
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut cmd = Command::new("cargo");
    cmd.args(args).current_dir(repo_root());
    cmd
}

/// The command line as a shell would show it, with the variables it sets in front.
pub fn display(cmd: &Command) -> String {
    let mut parts: Vec<String> = cmd
        .get_envs()
        .filter_map(|(k, v)| Some(format!("{}={:?}", k.to_string_lossy(), v?)))
        .collect();
    parts.push(cmd.get_program().to_string_lossy().into_owned());
    parts.extend(cmd.get_args().map(|a| a.to_string_lossy().into_owned()));
    parts.join(" ")
}

/// Prints and runs `cmd` with inherited stdio; an error if it cannot start or exits non-zero.
pub fn run_cmd(cmd: &mut Command) -> Result<()> {
    let shown = display(cmd);
    println!("$ {shown}");
    let status = cmd
        .status()
        .with_context(|| format!("could not start `{shown}`"))?;
    if !status.success() {
        bail!("`{shown}` failed ({status})");
    }
    Ok(())
}

/// Whether `cmd` runs and exits zero, with its output discarded.
pub fn succeeds(cmd: &mut Command) -> bool {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `12.3s` or `4m05s`.
pub fn secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s < 60.0 {
        format!("{s:.1}s")
    } else {
        let whole = d.as_secs();
        format!("{}m{:02}s", whole / 60, whole % 60)
    }
}

/// A sequence of named steps, each printed with a header and its time; the first failure
/// stops the sequence and is reported with the times of the steps before it.
#[derive(Debug)]
pub struct Steps {
    total: usize,
    started: Instant,
    done: Vec<(&'static str, Duration)>,
}

impl Steps {
    /// A sequence of `total` steps.
    pub fn new(total: usize) -> Self {
        Self {
            total,
            started: Instant::now(),
            done: Vec::new(),
        }
    }

    /// Runs one step.
    pub fn step(&mut self, name: &'static str, f: impl FnOnce() -> Result<()>) -> Result<()> {
        let n = self.done.len() + 1;
        println!("\n===== [{n}/{}] {name} =====", self.total);
        let t = Instant::now();
        let result = f();
        let dt = t.elapsed();
        match result {
            Ok(()) => {
                println!("===== {name}: ok in {} =====", secs(dt));
                self.done.push((name, dt));
                Ok(())
            }
            Err(e) => {
                println!("===== {name}: FAILED after {} =====", secs(dt));
                disk_report();
                self.summary();
                Err(e.context(format!(
                    "step {n}/{} `{name}` failed after {}",
                    self.total,
                    secs(dt)
                )))
            }
        }
    }

    /// Prints the time of every completed step and the total.
    pub fn summary(&self) {
        println!("\nstep times:");
        for (name, dt) in &self.done {
            println!("  {name:<12} {:>8}", secs(*dt));
        }
        println!("  {:<12} {:>8}", "total", secs(self.started.elapsed()));
    }
}

/// Prints the free space where builds write (the target directory and the temporary one):
/// a compiler that fails for want of disk says little more than its exit status.
fn disk_report() {
    let target = repo_root().join("target");
    let tmp = std::env::temp_dir();
    let mut df = Command::new("df");
    df.arg("-h").arg(&target).arg(&tmp);
    match df.output() {
        Ok(o) if o.status.success() => {
            println!(
                "free disk where builds write:\n{}",
                String::from_utf8_lossy(&o.stdout)
            );
        }
        _ => println!("(`df` could not report the free disk)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_files_keep_the_dots_of_manifest_names() {
        assert_eq!(results_name("qwen2.5-coder-0.5b"), "qwen2.5-coder-0.5b");
        assert_eq!(
            results_name("/m/SmolLM2-135M.Q4_1.gguf"),
            "SmolLM2-135M.Q4_1"
        );
        let base = Path::new("benches/results").join("kv-qwen2.5-coder-0.5b");
        assert_eq!(
            suffixed(&base, "md"),
            Path::new("benches/results/kv-qwen2.5-coder-0.5b.md")
        );
    }

    #[test]
    fn durations_read_naturally() {
        assert_eq!(secs(Duration::from_millis(12_340)), "12.3s");
        assert_eq!(secs(Duration::from_secs(245)), "4m05s");
    }

    #[test]
    fn display_shows_variables_then_the_command() {
        let mut cmd = Command::new("cargo");
        cmd.args(["doc", "--no-deps"])
            .env("RUSTDOCFLAGS", "-D warnings");
        assert_eq!(
            display(&cmd),
            r#"RUSTDOCFLAGS="-D warnings" cargo doc --no-deps"#
        );
    }

    #[test]
    fn a_failing_step_stops_with_its_name() {
        let mut steps = Steps::new(2);
        steps.step("first", || Ok(())).unwrap();
        let err = steps
            .step("second", || bail!("boom"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("step 2/2 `second` failed"), "{err}");
    }
}
