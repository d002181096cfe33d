//! How guessable a cluster secret is, counted the way a password cracker
//! guesses: a text secret (printable ASCII, which a person may have chosen)
//! is cut into the cheapest run of pieces — a character drawn from the
//! kinds the secret uses, a common word, a run of a sequence (`abcd`,
//! `4321`, a keyboard row), a repeat of what came before — and its strength
//! is the sum of their costs in bits. A binary secret (any other byte: from
//! a random source) counts 8 bits a byte over its shortest repeating unit.
//!
//! zxcvbn does this with thirty thousand words; its Rust port pulls in
//! `chrono`, `time` and `fancy-regex` (48 s of build per profile here,
//! four profiles in CI) and caps its count at 2^64 guesses, below the bar.
//! This counts the patterns that matter for a shared secret in a page.

#![forbid(unsafe_code)]

/// Words a guesser tries first, lower case: the most common passwords'
/// stems, and words a KV-cache cluster's secret would be made of.
const WORDS: &[&str] = &[
    "password",
    "passw0rd",
    "pass",
    "secret",
    "cluster",
    "kvxfer",
    "admin",
    "root",
    "letmein",
    "welcome",
    "qwerty",
    "dragon",
    "monkey",
    "master",
    "login",
    "test",
    "default",
    "changeme",
    "iloveyou",
    "princess",
    "sunshine",
    "football",
    "baseball",
    "shadow",
    "superman",
    "trustno1",
    "hello",
    "world",
    "user",
    "guest",
    "token",
    "key",
    "cache",
    "prefill",
    "decode",
    "server",
    "node",
    "prod",
    "production",
    "staging",
    "dev",
    "example",
    "sample",
    "demo",
    "nvidia",
    "cuda",
    "rdma",
    "llama",
    "model",
    "vllm",
    "sglang",
    "mooncake",
    "nixl",
    "etcd",
    "kubernetes",
    "docker",
    "summer",
    "winter",
    "spring",
    "autumn",
    "shared",
    "ci",
];

/// Keyboard rows, whose runs are guessed like sequences.
const ROWS: &[&[u8]] = &[b"qwertyuiop", b"asdfghjkl", b"zxcvbnm", b"1234567890"];

/// Longest text secret cut into pieces (past it, only its shortest
/// repeating unit is counted, by characters).
const MAX_CUT: usize = 512;
/// Longest unit a repeat inside the secret is looked for with.
const MAX_UNIT: usize = 64;

fn log2(x: f64) -> f64 {
    x.max(1.0).log2()
}

/// The kinds of characters `secret` uses, as the size of the set a
/// character is drawn from: lower case 26, upper case 26, digits 10, other
/// printable ASCII 33; any other byte makes it 256.
pub(super) fn pool(secret: &[u8]) -> u32 {
    let has = |f: fn(&u8) -> bool| secret.iter().any(f);
    if has(|b| !(0x20..0x7f).contains(b)) {
        return 256;
    }
    [
        (has(u8::is_ascii_lowercase), 26),
        (has(u8::is_ascii_uppercase), 26),
        (has(u8::is_ascii_digit), 10),
        (has(|b| b.is_ascii_punctuation() || *b == b' '), 33),
    ]
    .iter()
    .filter(|(present, _)| *present)
    .map(|(_, n)| n)
    .sum()
}

/// The shortest unit `s` is a repetition of (itself when none).
fn unit(s: &[u8]) -> &[u8] {
    let n = s.len();
    (1..n)
        .find(|&p| n.is_multiple_of(p) && s.chunks(p).all(|c| c == &s[..p]))
        .map_or(s, |p| &s[..p])
}

/// Bits a guesser needs for `secret` (see the module docs).
pub(super) fn guess_bits(secret: &[u8]) -> f64 {
    let pool = pool(secret);
    let s = unit(secret);
    let repeats = secret.len() / s.len().max(1);
    let extra = if repeats > 1 {
        log2(repeats as f64)
    } else {
        0.0
    };
    if pool == 256 || s.len() > MAX_CUT {
        return s.len() as f64 * log2(f64::from(pool)) + extra;
    }
    cut(s, f64::from(pool)) + extra
}

/// The cheapest cut of text `s` into pieces, a character costing
/// `log2(pool)`.
fn cut(s: &[u8], pool: f64) -> f64 {
    let n = s.len();
    let lower: Vec<u8> = s.to_ascii_lowercase();
    let char_bits = log2(pool);
    let word_bits = log2(WORDS.len() as f64) + 1.0; // which word, its case
    // best[i]: the cheapest cut of s[..i].
    let mut best = vec![f64::INFINITY; n + 1];
    best[0] = 0.0;
    for i in 0..n {
        let here = best[i];
        if !here.is_finite() {
            continue;
        }
        let mut offer = |end: usize, bits: f64| {
            if here + bits < best[end] {
                best[end] = here + bits;
            }
        };
        offer(i + 1, char_bits);
        for w in WORDS {
            if lower[i..].starts_with(w.as_bytes()) {
                offer(i + w.len(), word_bits);
            }
        }
        // A run of a sequence: its first character, length and direction.
        for step in [1i16, -1] {
            let mut end = i + 1;
            while end < n && i16::from(s[end]) - i16::from(s[end - 1]) == step {
                end += 1;
                if end - i >= 3 {
                    offer(end, char_bits + log2((end - i) as f64) + 1.0);
                }
            }
        }
        // A run of a keyboard row, either way.
        for row in ROWS {
            for dir in [false, true] {
                let r: Vec<u8> = if dir {
                    row.iter().rev().copied().collect()
                } else {
                    row.to_vec()
                };
                for start in 0..r.len() {
                    let len = lower[i..]
                        .iter()
                        .zip(&r[start..])
                        .take_while(|(a, b)| a == b)
                        .count();
                    for l in 3..=len {
                        offer(i + l, log2((ROWS.len() * 2 * 10) as f64) + log2(l as f64));
                    }
                }
            }
        }
        // A repeat of the unit just before it (`abcabc`): how many times.
        for p in 1..=MAX_UNIT.min(i) {
            let unit = &s[i - p..i];
            let mut end = i;
            while end + p <= n && &s[end..end + p] == unit {
                end += p;
                offer(
                    end,
                    log2(((end - i) / p) as f64 + 1.0) + log2(p as f64) + 1.0,
                );
            }
        }
    }
    best[n]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The secrets the issue found accepted are counted far below 128
    /// bits; secrets from random sources far above.
    #[test]
    fn patterns_cost_what_a_guesser_pays() {
        for (weak, most) in [
            (&b"abcdefghabcdefghabcdefghabcdefgh"[..], 20.0),
            (b"0123456701234567012345670123456701234567", 20.0),
            (b"Password1Password1Password1", 30.0),
            (b"0123456789abcdef0123456789abcdef", 40.0),
            (b"ci-cluster-secret-12345-6789", 80.0),
            (b"qwertyuiopasdfghjklzxcvbnm1234", 40.0),
            (b"etcd-test-cluster-secret-0123456789", 90.0),
            (b"netns-cluster-secret-0123456789", 90.0),
        ] {
            let bits = guess_bits(weak);
            assert!(
                bits <= most,
                "{} counted {bits:.0} bits",
                String::from_utf8_lossy(weak)
            );
        }
        for strong in [
            &b"3f9a0c7d2e41b8a6c5d9e0f1a2b3c4d5"[..],
            b"Zq7#mP2v!Lr9@xW4&nB6$kT1",
            b"Do not print me, ever: 42!",
        ] {
            let bits = guess_bits(strong);
            assert!(
                bits >= 128.0,
                "{} counted {bits:.0} bits",
                String::from_utf8_lossy(strong)
            );
        }
        // Binary: 8 bits a byte of its repeating unit.
        let random: Vec<u8> = (0..16u8).map(|i| i.wrapping_mul(97) ^ 0xc5).collect();
        assert_eq!(guess_bits(&random), 128.0);
        let twice = [random.clone(), random].concat();
        assert_eq!(guess_bits(&twice), 129.0);
    }

    #[test]
    fn units_and_pools() {
        assert_eq!(unit(b"abcabcabc"), b"abc");
        assert_eq!(unit(b"abcab"), b"abcab");
        assert_eq!(pool(b"abc"), 26);
        assert_eq!(pool(b"aB1!"), 95);
        assert_eq!(pool(&[0, 1]), 256);
    }
}
