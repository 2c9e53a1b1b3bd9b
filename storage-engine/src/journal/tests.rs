//! Tests of the journal: the record codec, the checkpoint bound, superblock choice,
//! and loading torn and damaged logs.

use super::records::split_records;
use super::superblock::read_superblock;
use super::*;
use crate::error::Result;
use crate::format::*;
use crate::meta::{Allocator, Entry, MapTable, MetaCounts};
use crate::props::{AttachKey, Attachment, Props, MAX_ATTACHMENTS, MAX_LABELS, MAX_PROPS_BYTES};
use std::collections::BTreeMap;
use zerocopy::{FromBytes, IntoBytes};

/// Random states, each of volumes, snapshots and clones of them with mapping pages
/// from empty to full and names up to the longest: the checkpoint never takes more
/// chunks than the bound the room for metadata is sized by, for every unit size.
#[test]
fn a_checkpoint_never_takes_more_chunks_than_its_bound() {
    let mut rng = crate::testing::Rng::new(0x5eed_c0de);
    for round in 0..300 {
        let unit_size = [16u64 << 10, 32 << 10, 64 << 10, 128 << 10][round % 4];
        let units = 1 << 16;
        let mut st = State { volumes: BTreeMap::new(), next_volume: 1, alloc: Allocator::new(units), unit_size };
        // Every fourth round the worst case: full pages only, each record a little
        // more than half a 16 KiB chunk, so that every chunk holds one.
        let dense = round % 8 < 2;
        let tables = if dense { 1 } else { 1 + rng.below(6) as usize };
        for t in 0..tables {
            let name_len = 1 + rng.below(257) as usize;
            let map = if t > 0 && rng.chance(50) {
                let src = st.volumes.values().next().expect("a volume").map.share(&mut st.alloc);
                src
            } else {
                let mut map = MapTable::new();
                for k in 0..if dense { 40 } else { rng.below(12) } {
                    let page = if dense { k } else { rng.below(40) };
                    let fill = if dense { 512 } else { [1, 8, 100, 512][rng.index(4)] };
                    for i in 0..fill {
                        let lunit = page * PAGE_ENTRIES as u64 + (i * 7919 + rng.below(3)) % PAGE_ENTRIES as u64;
                        if map.get(lunit).is_mapped() {
                            continue;
                        }
                        let Some(p) = st.alloc.alloc() else { break };
                        map.set(lunit, Entry { punit: p, bitmap: 1 }, &mut st.alloc);
                    }
                }
                map
            };
            // Properties from none to the largest record allowed.
            let props = sample_props(&mut rng);
            let meta = VolumeMeta {
                name: "n".repeat(name_len),
                snapshot: false,
                size: 1 << 40,
                created: 0,
                map,
                written: rng.chance(50),
                props,
            };
            st.alloc.counts.volumes += 1;
            st.alloc.counts.volume_bytes += meta.own_bytes();
            st.volumes.insert(t as u64 + 1, meta);
        }
        // A shared table changed after the share copies pages.
        if let Some(v) = st.volumes.values_mut().last().filter(|_| !dense) {
            for lunit in (0..40 * PAGE_ENTRIES as u64).step_by(997) {
                if v.map.get(lunit).is_mapped() {
                    v.map.set(lunit, Entry::EMPTY, &mut st.alloc);
                }
            }
        }
        assert_eq!(
            st.alloc.counts,
            MetaCounts::of(st.volumes.values().map(|v| (&v.map, v.own_bytes()))),
            "counts kept by the table changes"
        );
        // A first checkpoint writes every page; a second, after changes, keeps the page
        // chunks that stay at least half live. Each takes at most the bound's units and
        // leaves a checkpoint of at most twice the bound (the rule of room.rs).
        let mut chunks = PageChunks::new();
        let mut next_unit = 0u32;
        for pass in 0..2 {
            if pass == 1 {
                change_some_pages(&mut st, &mut rng);
            }
            let bound_bytes = checkpoint_bytes_bound(&st.alloc.counts, unit_size);
            let bound = checkpoint_units_bound(bound_bytes, unit_size);
            let (written, units_after) = checkpoint_into(&st, &mut chunks, &mut next_unit, unit_size);
            assert!(
                written.1 <= bound_bytes,
                "round {round} pass {pass}: {} bytes of records, bound {bound_bytes}",
                written.1
            );
            assert!(
                CHUNK_COPIES * written.0 <= bound,
                "round {round} pass {pass}: {} chunks of {unit_size} bytes in two copies, bound {bound} units",
                written.0
            );
            assert!(
                units_after <= 2 * bound,
                "round {round} pass {pass}: the checkpoint holds {units_after} units, twice the bound is {}",
                2 * bound
            );
        }
    }
}

/// Changes entries of some pages of the last table (copying those it shares), and
/// unmaps some whole pages of the first.
fn change_some_pages(st: &mut State, rng: &mut crate::testing::Rng) {
    let ids: Vec<u64> = st.volumes.keys().copied().collect();
    let last = *ids.last().unwrap();
    let mut v = st.volumes.remove(&last).unwrap();
    for lunit in (0..40 * PAGE_ENTRIES as u64).step_by(1 + rng.below(3000) as usize) {
        if let Some(p) = st.alloc.alloc() {
            let old = v.map.set(lunit, Entry { punit: p, bitmap: 3 }, &mut st.alloc);
            if old.is_mapped() {
                st.alloc.decref(old.punit);
            }
        }
    }
    st.volumes.insert(last, v);
    let first = ids[0];
    let mut v = st.volumes.remove(&first).unwrap();
    for page in 0..40u64 {
        if rng.chance(30) {
            for lunit in page * PAGE_ENTRIES as u64..(page + 1) * PAGE_ENTRIES as u64 {
                let old = v.map.set(lunit, Entry::EMPTY, &mut st.alloc);
                if old.is_mapped() {
                    st.alloc.decref(old.punit);
                }
            }
        }
    }
    st.volumes.insert(first, v);
}

/// A checkpoint of `st` whose current page chunks are `chunks` (updated to the new
/// checkpoint's), with page chunks numbered from `next_unit` on: returns the chunks
/// and bytes of records it wrote, and the units the new checkpoint holds in all.
fn checkpoint_into(st: &State, chunks: &mut PageChunks, next_unit: &mut u32, unit_size: u64) -> ((u64, u64), u64) {
    let payload = unit_size as usize - size_of::<ChunkHeader>();
    let plan = st.plan_checkpoint(chunks, chunk_fill(unit_size));
    let (mut written, mut bytes) = (0u64, 0u64);
    let mut emit = |body: &[u8]| {
        written += 1;
        bytes += body.len() as u64;
        *next_unit += 1;
        Ok(*next_unit - 1)
    };
    let mut new = encode_bodies(&plan.dirty, payload, &mut emit).unwrap();
    new.extend(encode_bodies(&plan.dirty_leaves, payload, &mut emit).unwrap());
    let mut all = plan.kept.clone();
    // Copies far from the chunks, as a spare spread over the pool gives them.
    all.extend(new.iter().map(|&u| (u, PageChunk::written(1, u + (1 << 30)))));
    let dir = st
        .encode_directory(&all, payload, &mut |body, _| {
            written += 1;
            bytes += body.len() as u64;
            Ok(())
        })
        .unwrap();
    *chunks = all;
    ((written, bytes), page_chunk_units(chunks) + CHUNK_COPIES * dir)
}

/// Properties of a volume: none, a few, or as many as fit in the largest record.
fn sample_props(rng: &mut crate::testing::Rng) -> Props {
    let mut p = Props::default();
    let (labels, nodes) = match rng.below(3) {
        0 => return p,
        1 => (1 + rng.below(3), 1 + rng.below(3)),
        _ => (MAX_LABELS as u64, MAX_ATTACHMENTS as u64),
    };
    for i in 0..labels {
        p.labels.insert(format!("k{i}{}", "k".repeat(60)), "v".repeat(255));
    }
    for i in 0..nodes {
        let a = Attachment {
            node_id: format!("{i}{}", "n".repeat(250)),
            key: AttachKey::random(),
            read_only: rng.chance(50),
            exclusive: false,
            created: 0,
        };
        p.attachments.push(a);
        if p.record_bytes() > MAX_PROPS_BYTES {
            p.attachments.pop();
            break;
        }
    }
    p
}

#[test]
fn records_round_trip() {
    let recs = vec![
        Record::Volume { volume: 3, size: 1 << 30, created: 5, name: "vol-a".into() },
        Record::Map { volume: 3, lunit: 9, punit: 77, bitmap: 0b1011 },
        Record::Unmap { volume: 3, lunit: 9 },
        Record::VolumeResize { volume: 3, size: 2 << 30 },
        Record::Props { volume: 3, props: sample_props(&mut crate::testing::Rng::new(2)) },
        Record::Props { volume: 3, props: Props::default() },
        Record::VolumeDelete { volume: 3 },
    ];
    let mut buf = Vec::new();
    for r in &recs {
        r.encode(&mut buf);
    }
    let back: Vec<Record> =
        split_records(&buf).unwrap().into_iter().map(|(k, b)| Record::decode(k, b).unwrap()).collect();
    assert_eq!(back, recs);
}

/// The superblock slots of a 64 MiB pool image, with generations 0 and 1.
fn created_slots() -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pool.img");
    let opts = crate::PoolOptions { size: 64 << 20, ..Default::default() };
    crate::Pool::create(&path, &opts).unwrap().close().unwrap();
    let mut img = std::fs::read(&path).unwrap();
    img.truncate(2 * BLOCK_SIZE as usize);
    // As creation leaves them (the open and close since moved them on), as a build
    // before ditto copies wrote them.
    for (off, gen) in [(0, 0), (BLOCK_SIZE as usize, 1)] {
        set_generation(&mut img, off, gen);
        set_ditto(&mut img, off, false);
    }
    img
}

/// Sets or clears [`INCOMPAT_DITTO`] in the slot at `off` of `slots` (checksum
/// updated).
fn set_ditto(slots: &mut [u8], off: usize, on: bool) {
    let mut sb = Superblock::read_from_bytes(&slots[off..off + size_of::<Superblock>()]).unwrap();
    let bits = sb.incompat_features.get() & !crate::format::INCOMPAT_DITTO;
    sb.incompat_features = (bits | if on { crate::format::INCOMPAT_DITTO } else { 0 }).into();
    sb.crc = sb.compute_crc().into();
    slots[off..off + size_of::<Superblock>()].copy_from_slice(sb.as_bytes());
}

/// `read_superblock` over `slots` (the first 8 KiB of a 64 MiB pool).
fn pick(slots: &[u8], accept_rollback: bool) -> Result<(u64, Option<String>)> {
    let mut read = |off: u64, len: usize| Ok(slots[off as usize..off as usize + len].to_vec());
    read_superblock(&mut read, 64 << 20, accept_rollback).map(|(sb, _, w, _)| (sb.generation.get(), w))
}

/// Rewrites the slot at `off` of `slots` with generation `gen` (checksum updated).
fn set_generation(slots: &mut [u8], off: usize, gen: u64) {
    let mut sb = Superblock::read_from_bytes(&slots[off..off + size_of::<Superblock>()]).unwrap();
    sb.generation = gen.into();
    sb.crc = sb.compute_crc().into();
    slots[off..off + size_of::<Superblock>()].copy_from_slice(sb.as_bytes());
}

#[test]
fn a_damaged_superblock_slot_opens_only_when_it_cannot_have_been_newer() {
    let base = created_slots();
    let (s0, s1) = (0usize, BLOCK_SIZE as usize);
    // Both valid: the higher generation.
    let mut img = base.clone();
    set_generation(&mut img, s0, 6);
    set_generation(&mut img, s1, 7);
    assert_eq!(pick(&img, false).unwrap(), (7, None));
    // The older slot (6) damaged, its generation field intact: opens with a warning.
    let mut older = img.clone();
    older[s0 + 40] ^= 0x10;
    let (gen, warning) = pick(&older, false).unwrap();
    assert_eq!(gen, 7);
    assert!(warning.unwrap().contains("slot 0 is damaged (superblock checksum mismatch)"));
    // The newer slot (7) damaged: refused, unless a rollback to 6 is accepted.
    let mut newer = img.clone();
    newer[s1 + 40] ^= 0x10;
    let e = pick(&newer, false).unwrap_err();
    assert!(e.message().contains("slot 1 is damaged") && e.message().contains("may hold a newer generation"));
    let (gen, warning) = pick(&newer, true).unwrap();
    assert_eq!(gen, 6);
    assert!(warning.unwrap().contains("the metadata committed after generation 6 is lost"));
    // A damaged slot whose generation field does not read one below: refused.
    let mut unknown = img.clone();
    unknown[s0..s0 + 8].copy_from_slice(b"XXXXXXXX");
    assert!(pick(&unknown, false).is_err());
    // A create cut short: one slot never written, the other generation 0 or 1.
    for (zeroed, gen) in [(s1, 0), (s0, 1)] {
        let mut cut = base.clone();
        cut[zeroed..zeroed + BLOCK_SIZE as usize].fill(0);
        let (g, warning) = pick(&cut, false).unwrap();
        assert_eq!(g, gen);
        assert!(warning.unwrap().contains("creation was cut short"));
    }
    // The same zeroed slot beside a later generation is damage, not a cut create.
    let mut late = img.clone();
    late[s0..s0 + BLOCK_SIZE as usize].fill(0);
    assert!(pick(&late, false).is_err());

    // With ditto copies every checkpoint writes both slots, the slot of its generation
    // first: a damaged slot held the valid one's generation or the next one of a cut
    // checkpoint, whose predecessor is whole. Either slot opens, with a warning.
    let mut both = base.clone();
    for off in [s0, s1] {
        set_generation(&mut both, off, 7);
        set_ditto(&mut both, off, true);
    }
    assert_eq!(pick(&both, false).unwrap(), (7, None));
    for (damaged, kept) in [(s0, 1), (s1, 0)] {
        let mut one = both.clone();
        one[damaged + 40] ^= 0x10;
        let (gen, warning) = pick(&one, false).unwrap();
        assert_eq!(gen, 7);
        let warning = warning.unwrap();
        assert!(warning.contains(&format!("its copy in slot {kept} (generation 7) was read")), "{warning}");
        assert!(!warning.contains("lost"), "{warning}");
    }
    // A checkpoint cut between its two writes: the newer slot, with a warning.
    let mut cut = both.clone();
    set_generation(&mut cut, s0, 8);
    let (gen, warning) = pick(&cut, false).unwrap();
    assert_eq!(gen, 8);
    assert!(warning.unwrap().contains("cut between its two superblock writes"));
    // Both slots damaged: refused, naming both.
    let mut none = both.clone();
    none[s0 + 40] ^= 0x10;
    none[s1 + 40] ^= 0x10;
    let e = pick(&none, false).unwrap_err();
    assert!(e.message().contains("slot 0") && e.message().contains("slot 1"), "{}", e.message());
}

/// A crash while a commit writes its batches can leave an early batch torn and a
/// later one of the same commit complete behind it: the normal end of a log, loaded
/// without a warning, with the batches before the torn one replayed. A batch of a
/// commit that began after the torn one proves damage and is refused, and so is a
/// batch whose commit index does not follow the batch before it.
#[test]
fn torn_commits_of_several_batches_load_and_later_commits_are_refused() {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pool.img");
    let opts = crate::PoolOptions { size: 512 << 20, ..Default::default() };
    crate::Pool::create(&path, &opts).unwrap().close().unwrap();
    let file = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
    let size = file.metadata().unwrap().len();
    let loaded = load(&mut crate::journal::read_at_file(&file), size, Accept::default()).unwrap();
    let (geo, log) = (loaded.geo.clone(), loaded.log);
    let mut clean_log = vec![0u8; geo.log_size as usize];
    file.read_exact_at(&mut clean_log, geo.log_offset).unwrap();

    // Commit A: a volume created and then grown 131,072 times (about 2.5 MiB of
    // records, three batches); commit B after it: one more growth.
    let id = 1000;
    let mut a = Vec::new();
    Record::Volume { volume: id, size: 4096, created: 0, name: "torn".into() }.encode(&mut a);
    let growths = 1u64 << 17;
    for k in 0..growths {
        Record::VolumeResize { volume: id, size: 4096 * (k + 2) }.encode(&mut a);
    }
    let mut b = Vec::new();
    Record::VolumeResize { volume: id, size: 4096 * (growths + 2) }.encode(&mut b);
    let batches_a = encode_batches(&a, &[], log.seq + 1, geo.pool_tag()).unwrap();
    assert_eq!(batches_a.len(), 3);
    let batches_b = encode_batches(&b, &[], log.seq + 4, geo.pool_tag()).unwrap();
    // Writes `batches` one after another from the log's end; `damaged` gets a payload
    // byte flipped (a torn write).
    let put = |batches: &[&Vec<u8>], damaged: Option<usize>| {
        file.write_all_at(&clean_log, geo.log_offset).unwrap();
        let mut pos = log.pos;
        for (i, batch) in batches.iter().enumerate() {
            let mut batch = batch.to_vec();
            if damaged == Some(i) {
                batch[100] ^= 1;
            }
            assert!(pos % geo.log_size + batch.len() as u64 <= geo.log_size);
            file.write_all_at(&batch, geo.log_offset + pos % geo.log_size).unwrap();
            pos += batch.len() as u64;
        }
    };
    let load_now = || load(&mut crate::journal::read_at_file(&file), size, Accept::default());
    // The size of volume `id` after replay, or None.
    let size_of_torn = |l: &Loaded| l.state.volumes.get(&id).map(|v| v.size);
    let all: Vec<&Vec<u8>> = batches_a.iter().chain(&batches_b).collect();

    // Intact: everything replays.
    put(&all, None);
    let l = load_now().unwrap();
    assert_eq!((l.batches, size_of_torn(&l)), (4, Some(4096 * (growths + 2))));
    assert!(l.log_warning.is_none());
    // A torn at its first batch, its later batches complete: nothing of A, no warning.
    put(&all[..3], Some(0));
    let l = load_now().unwrap();
    assert_eq!((l.batches, size_of_torn(&l)), (0, None));
    assert!(l.log_warning.is_none(), "{:?}", l.log_warning);
    // A torn at its second batch: the first one replays.
    put(&all[..3], Some(1));
    let l = load_now().unwrap();
    assert_eq!(l.batches, 1);
    assert!(size_of_torn(&l).is_some_and(|s| s > 4096 && s < 4096 * (growths + 1)));
    assert!(l.log_warning.is_none(), "{:?}", l.log_warning);
    // The same with commit B behind it: A was complete before B began, so its
    // second batch was damaged afterwards.
    put(&all, Some(1));
    let e = load_now().err().expect("a commit behind a damaged batch was accepted");
    assert_eq!(e.kind(), crate::ErrorKind::Corrupt);
    let named =
        format!("log batch {} is damaged or missing, but the commit that begins at batch {}", log.seq + 2, log.seq + 4);
    assert!(e.message().contains(&named), "{e}");
    // A's second batch alone, renumbered to follow the checkpoint: it says it is
    // batch 1 of a commit whose batch 0 is not there.
    let shifted = encode_batches(&a, &[], log.seq, geo.pool_tag()).unwrap();
    put(&[&shifted[1]], None);
    let e = load_now().err().expect("a batch out of its commit's order was accepted");
    assert!(
        e.message().contains("says it is batch 1 of its commit, but it is the first batch after the checkpoint"),
        "{e}"
    );
    // A valid batch numbered past the range (damage under a recomputed checksum) is
    // refused, not left to overflow the checkpoint's jump past it.
    let far = encode_batches(&b, &[], 1 << 63, geo.pool_tag()).unwrap();
    put(&[&far[0]], None);
    let e = load_now().err().expect("a batch numbered 2^63 was accepted");
    assert!(e.message().contains("out of range"), "{e}");
}

#[test]
fn truncated_records_are_corrupt() {
    let mut buf = Vec::new();
    Record::Unmap { volume: 1, lunit: 2 }.encode(&mut buf);
    buf.pop();
    assert!(split_records(&buf).is_err());
}

/// A run of records logged together never straddles two log batches (recovery replays
/// whole batches: a crash could otherwise keep the first of them only), unless the
/// run alone overflows a batch; without glue the same records are cut where they fill
/// a batch.
#[test]
fn glued_records_stay_in_one_batch() {
    let mut records = Vec::new();
    let mut bounds = Vec::new();
    // About 1.5 MiB of small records: the first batch fills near 1 MiB.
    for k in 0..70_000u64 {
        Record::VolumeResize { volume: 7, size: 4096 * (k + 1) }.encode(&mut records);
        bounds.push(records.len());
    }
    let plain = encode_batches(&records, &[], 1, 42).unwrap();
    assert_eq!(plain.len(), 2);
    let payload_len = |b: &Vec<u8>| BatchHeader::read_from_prefix(b).unwrap().0.payload_len.get() as usize;
    let cut = payload_len(&plain[0]);
    assert!(bounds.contains(&cut), "cut at a record boundary");
    // Glue the 20 records around that cut into one run.
    let at = bounds.iter().position(|b| *b == cut).unwrap();
    let glued: Vec<usize> = bounds[at - 10..at + 10].to_vec();
    let with_glue = encode_batches(&records, &glued, 1, 42).unwrap();
    let cut2 = payload_len(&with_glue[0]);
    assert_eq!(cut2, bounds[at - 11], "the batch ends before the run");
    assert_eq!(with_glue.iter().map(payload_len).sum::<usize>(), records.len(), "every record in a batch");
    // A run longer than a batch is cut anyway (where it must).
    let all: Vec<usize> = bounds[..bounds.len() - 1].to_vec();
    let forced = encode_batches(&records, &all, 1, 42).unwrap();
    assert_eq!(payload_len(&forced[0]), cut);
}

/// A chunk neither of whose copies can be read is an I/O error, not damage: the load
/// fails with `Io` naming both units; one copy that cannot be read is read around (a
/// warning), and one unreadable beside one damaged is `Corrupt`.
#[test]
fn a_chunk_whose_copies_cannot_be_read_is_an_io_error() {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pool.img");
    let opts = crate::PoolOptions { size: 512 << 20, ..Default::default() };
    let pool = crate::Pool::create(&path, &opts).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(pool.create_volume("v", 1 << 20)).unwrap();
    rt.block_on(pool.checkpoint()).unwrap();
    pool.close().unwrap();
    let file = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
    let size = file.metadata().unwrap().len();
    let loaded = load(&mut read_at_file(&file), size, Accept::default()).unwrap();
    let (geo, sb) = (loaded.geo.clone(), loaded.sb.clone());
    let units = [sb.checkpoint_unit.get(), sb.checkpoint_copy_unit.get()];
    assert!(units.iter().all(|&u| u != NO_UNIT) && units[0] != units[1], "{units:?}");
    // Reads of the directory's first chunk at the units in `failing` get EIO.
    let load_failing = |failing: &[u64]| {
        let mut inner = read_at_file(&file);
        let offsets: Vec<u64> = failing.iter().map(|&u| geo.unit_offset(u)).collect();
        let mut read = move |off: u64, len: usize| {
            if offsets.contains(&off) {
                return Err(std::io::Error::from_raw_os_error(libc::EIO));
            }
            inner(off, len)
        };
        load(&mut read, size, Accept::default())
    };
    let e = load_failing(&units).map(|_| ()).unwrap_err();
    assert_eq!(e.kind(), crate::ErrorKind::Io, "{e}");
    for u in units {
        assert!(e.message().contains(&format!("data unit {u} ")), "{e}");
    }
    let l = load_failing(&units[..1]).unwrap();
    assert!(l.copy_warnings.iter().any(|w| w.contains("cannot be read")), "{:?}", l.copy_warnings);
    // The copy damaged on disk, the first unreadable: no sound copy, and one of them
    // is damage.
    let at = geo.unit_offset(units[1]) + 100;
    let mut b = [0u8; 1];
    file.read_exact_at(&mut b, at).unwrap();
    file.write_all_at(&[b[0] ^ 1], at).unwrap();
    let e = load_failing(&units[..1]).map(|_| ()).unwrap_err();
    assert_eq!(e.kind(), crate::ErrorKind::Corrupt, "{e}");
}
