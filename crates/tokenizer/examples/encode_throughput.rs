//! Encoding throughput of one model's tokenizer on files given on the command line:
//!
//!     cargo run --release -p specula-tokenizer --example encode_throughput -- MODEL.gguf FILE...
//!
//! Reports wall time and the process's CPU time (so that a busy machine does not hide the
//! figure), and the tokens per byte.

use std::time::Instant;

use specula_tokenizer::Tokenizer;

/// User + system CPU seconds of this process, from /proc (Linux); 0 elsewhere.
fn cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the command name (which is in parentheses and may hold spaces).
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime are fields 14 and 15 (1-based), i.e. 11 and 12 after the name.
    (ticks(11) + ticks(12)) / 100.0
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let model = args
        .next()
        .ok_or("usage: encode_throughput MODEL.gguf FILE...")?;
    let texts: Vec<String> = args
        .map(std::fs::read_to_string)
        .collect::<Result<_, _>>()?;
    let bytes: usize = texts.iter().map(String::len).sum();
    let t = Instant::now();
    let tok = Tokenizer::open(&model)?;
    println!("load: {:.0} ms", t.elapsed().as_secs_f64() * 1e3);
    let rounds: usize = std::env::var("ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(5);
    let (t, c) = (Instant::now(), cpu_seconds());
    let mut n_tokens = 0;
    for _ in 0..rounds {
        for text in &texts {
            n_tokens += tok.encode(text).len();
        }
    }
    let (wall, cpu) = (t.elapsed().as_secs_f64(), cpu_seconds() - c);
    #[allow(clippy::cast_precision_loss, reason = "throughput figures")]
    let mb = (bytes * rounds) as f64 / 1e6;
    println!(
        "{bytes} bytes x {rounds}: {:.1} MB/s wall, {:.1} MB/s CPU, {:.3} tokens/byte",
        mb / wall,
        mb / cpu.max(1e-9),
        {
            #[allow(clippy::cast_precision_loss, reason = "a ratio")]
            let r = n_tokens as f64 / (bytes * rounds) as f64;
            r
        }
    );
    Ok(())
}
