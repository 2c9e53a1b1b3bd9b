//! A short fuzzing run on stable Rust, part of every test run: each fuzz target's body
//! (the same functions `fuzz/` drives with libFuzzer) runs on every input of its corpus
//! in `fuzz/corpus/`, then on inputs made by mutating them at random (bytes flipped,
//! inserted, removed, inputs cut and spliced). None may panic. `FUZZ_CORPUS_RUNS` sets
//! the mutated inputs per target (default 300); the seed is printed on failure.

use std::path::Path;

use storage_engine::testing::Rng;

fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus").join(target);
    let mut inputs: Vec<Vec<u8>> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display()))
        .map(|e| std::fs::read(e.unwrap().path()).unwrap())
        .collect();
    inputs.sort();
    assert!(!inputs.is_empty(), "empty corpus {}", dir.display());
    inputs
}

fn mutate(rng: &mut Rng, inputs: &[Vec<u8>]) -> Vec<u8> {
    let mut v = inputs[rng.index(inputs.len())].clone();
    for _ in 0..1 + rng.index(8) {
        match rng.index(6) {
            0 | 1 if !v.is_empty() => {
                let i = rng.index(v.len());
                v[i] ^= 1 << rng.index(8);
            }
            2 if !v.is_empty() => {
                let i = rng.index(v.len());
                v[i] = [0, 0xff, 0x7f, 0x80][rng.index(4)];
            }
            3 => {
                let i = rng.index(v.len() + 1);
                v.insert(i, rng.next_u64() as u8);
            }
            4 if !v.is_empty() => {
                let i = rng.index(v.len());
                v.truncate(i);
            }
            _ => {
                let other = &inputs[rng.index(inputs.len())];
                let at = rng.index(v.len() + 1);
                v.truncate(at);
                v.extend_from_slice(&other[rng.index(other.len() + 1)..]);
            }
        }
    }
    v
}

fn run(target: &str, body: fn(&[u8])) {
    let inputs = corpus(target);
    for input in &inputs {
        body(input);
    }
    let runs: usize = std::env::var("FUZZ_CORPUS_RUNS").ok().and_then(|s| s.parse().ok()).unwrap_or(300);
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    let mut rng = Rng::new(seed);
    for i in 0..runs {
        let input = mutate(&mut rng, &inputs);
        let r = std::panic::catch_unwind(|| body(&input));
        if let Err(e) = r {
            eprintln!("{target}: mutated input {i} (seed {seed:#x}) panicked; input: {input:02x?}");
            std::panic::resume_unwind(e);
        }
    }
}

#[test]
fn nbd_handshake() {
    run("nbd_handshake", nbd::testing::fuzz_handshake);
}

#[test]
fn nbd_transmission() {
    run("nbd_transmission", nbd::testing::fuzz_transmission);
}

#[test]
fn pool_open() {
    run("pool_open", storage_engine::testing::fuzz_pool_open);
}

#[test]
fn management_api() {
    run("management_api", ferrovol::fuzzing::management);
}
