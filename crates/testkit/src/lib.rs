//! What the workspace's tests need to build tiny models by hand: reproducible pseudo-random
//! values (SplitMix64, the same on every machine and in the Python reference scripts that
//! mirror it) and the 256 token texts of GPT-2's byte alphabet; and the one place a test that
//! needs a real model or a golden file decides to skip ([`real_model`], [`skip`]): where
//! `SPECULA_REQUIRE_MODELS` is set (`.ci/run` sets it after fetching every model) a skip is a
//! failure, so the real-model goldens run on every CI submission. Test-only (a dev-dependency).
//!
//! - [`tiny`] — tiny GGUF models of every architecture and drafter, as editable lists.
//! - [`mutate`] — mutations of those models and the load-and-run property they must keep.
//! - [`counting`] — a backend wrapper that counts what crosses between host and device.

pub mod counting;
pub mod mutate;
pub mod tiny;

#[cfg(feature = "real-models")]
use std::path::PathBuf;

/// The variable that turns skips into failures.
pub const REQUIRE_MODELS: &str = "SPECULA_REQUIRE_MODELS";

/// Whether [`REQUIRE_MODELS`] is set to anything but empty or `0`.
#[must_use]
pub fn models_required() -> bool {
    required(std::env::var_os(REQUIRE_MODELS).as_deref())
}

fn required(value: Option<&std::ffi::OsStr>) -> bool {
    value.is_some_and(|v| !v.is_empty() && v != "0")
}

/// A test cannot run because `why` (a model not fetched, a golden file missing): prints
/// `skipped: why` and returns `None`, or fails the test where [`models_required`].
///
/// # Panics
/// Where [`models_required`]: a test that would skip fails instead.
#[must_use]
pub fn skip<T>(why: &str) -> Option<T> {
    assert!(
        !models_required(),
        "{why}, and {REQUIRE_MODELS} is set (CI): a real-model test may not skip"
    );
    eprintln!("skipped: {why}");
    None
}

/// The cached real model named `name` (`models.toml`), or [`skip`] with the command that
/// fetches it.
#[cfg(feature = "real-models")]
#[must_use]
pub fn real_model(name: &str) -> Option<PathBuf> {
    specula_fetch::cached_model_path(name).or_else(|| {
        skip(&format!(
            "{name} not fetched (cargo xtask fetch-models {name})"
        ))
    })
}

/// One step of SplitMix64: a well-mixed 64-bit value of `x`.
#[must_use]
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `x mod n` as an index.
///
/// # Panics
/// If `n` is 0.
#[must_use]
pub fn pick(x: u64, n: usize) -> usize {
    let n = u64::try_from(n).expect("n fits u64");
    usize::try_from(x % n).expect("below n, which is a usize")
}

/// `n` values uniform in `[-scale, scale)` (16 bits of resolution), a pure function of `seed`.
#[must_use]
pub fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    (0..u64::try_from(n).expect("n fits u64"))
        .map(|i| {
            let z = splitmix64(seed.wrapping_mul(1_000_003) ^ i);
            let u = f32::from(u16::try_from(z >> 48).expect("16 bits")) / 65_536.0;
            (u - 0.5) * 2.0 * scale
        })
        .collect()
}

/// GPT-2's byte alphabet (`bytes_to_unicode`): the symbol of each byte, in byte order — the
/// 256 token texts of a byte-level BPE vocabulary.
#[must_use]
pub fn byte_symbols() -> Vec<String> {
    let mut n = 0u32;
    (0u8..=255)
        .map(|b| {
            if matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF) {
                char::from(b).to_string()
            } else {
                n += 1;
                char::from_u32(255 + n).expect("a valid char").to_string()
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix64_matches_the_reference_sequence() {
        // SplitMix64 seeded with 0 (Vigna's reference): the first output is the mix of
        // 0x9E3779B97F4A7C15.
        assert_eq!(splitmix64(0), 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn values_are_bounded_and_reproducible() {
        let v = values(7, 1000, 0.5);
        assert!(v.iter().all(|x| (-0.5..0.5).contains(x)));
        assert_eq!(v, values(7, 1000, 0.5));
        assert_ne!(v, values(8, 1000, 0.5));
    }

    #[test]
    fn byte_symbols_are_gpt2s() {
        let s = byte_symbols();
        assert_eq!(s.len(), 256);
        assert_eq!(s[usize::from(b'A')], "A");
        assert_eq!(s[usize::from(b' ')], "Ġ");
        assert_eq!(s[usize::from(b'\n')], "Ċ");
    }
}

#[cfg(test)]
mod skip_tests {
    use super::*;

    #[test]
    fn any_value_but_empty_or_zero_requires_models() {
        assert!(!required(None));
        assert!(!required(Some("".as_ref())));
        assert!(!required(Some("0".as_ref())));
        assert!(required(Some("1".as_ref())));
        assert!(required(Some("true".as_ref())));
    }

    /// A skip under `SPECULA_REQUIRE_MODELS` fails the test (here: in a child process of this
    /// test binary, so the variable never leaks into other tests).
    #[test]
    fn a_skip_fails_where_models_are_required() {
        if std::env::var_os("SPECULA_TESTKIT_CHILD").is_some() {
            let _: Option<()> = skip("a model that is never there");
            return;
        }
        let exe = std::env::current_exe().unwrap();
        let run = |require: &str| {
            std::process::Command::new(&exe)
                .args([
                    "--exact",
                    "skip_tests::a_skip_fails_where_models_are_required",
                    "--nocapture",
                ])
                .env("SPECULA_TESTKIT_CHILD", "1")
                .env(REQUIRE_MODELS, require)
                .output()
                .unwrap()
        };
        let required = run("1");
        assert!(!required.status.success());
        let text = String::from_utf8_lossy(&required.stdout).into_owned()
            + &String::from_utf8_lossy(&required.stderr);
        assert!(text.contains("a real-model test may not skip"), "{text}");
        let optional = run("0");
        assert!(optional.status.success());
        assert!(String::from_utf8_lossy(&optional.stderr).contains("skipped: a model"));
    }
}
