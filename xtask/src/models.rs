//! `cargo xtask fetch-models`: the real models of `models.toml`, through specula-fetch.

use anyhow::{Context, Result};
use specula_fetch::{ModelCache, models};

use crate::FetchArgs;

/// `98.4 MB`, `1.12 GB`: decimal units, as registries and download pages show sizes.
#[allow(
    clippy::cast_precision_loss,
    reason = "a size shown with three significant digits"
)]
fn human(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else {
        format!("{:.1} MB", b / 1e6)
    }
}

pub fn run(args: &FetchArgs) -> Result<()> {
    let cache = ModelCache::from_env().context("locating the model cache")?;
    if args.list {
        println!("model cache: {}", cache.root().display());
        println!("{:<24} {:>9}  {:<20} cached", "name", "size", "licence");
        for m in models() {
            let cached = cache
                .path_if_present(&m.name)
                .map_or_else(|| "no".to_owned(), |p| format!("yes ({})", p.display()));
            let name = if m.default {
                format!("{} (default)", m.name)
            } else {
                m.name.clone()
            };
            println!(
                "{name:<24} {:>9}  {:<20} {cached}",
                human(m.size),
                m.license
            );
        }
        return Ok(());
    }
    let paths = if args.names.is_empty() {
        cache.fetch_all(true)
    } else {
        let names: Vec<&str> = args.names.iter().map(String::as_str).collect();
        cache.fetch_names(&names, true)
    }
    .context("fetching models")?;
    for path in paths {
        println!("ok {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_shown_in_decimal_units() {
        assert_eq!(human(98_362_432), "98.4 MB");
        assert_eq!(human(1_117_320_736), "1.12 GB");
    }
}
