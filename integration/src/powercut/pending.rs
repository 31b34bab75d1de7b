//! What a file holds beyond its durable bytes: the pages written since its last sync.
//!
//! Sans-IO: the durable bytes are read through [`Durable`] (the backing file, or a `Vec` in
//! tests), and [`Pending::apply`] is told where to write. A file without a `Pending` reads as
//! its durable bytes.
//!
//! ```text
//!   durable bytes (backing file)   [0 ............ low) visible, [low ..) truncated away since the sync
//!   pending pages                  4 KiB pages written since the sync, overlaid on the durable bytes
//!   logical length                 len (what stat shows); bytes past everything written read as zero
//! ```
//!
//! A power cut forgets every `Pending`; a sync (fsync, fdatasync, O_DSYNC) applies it to the
//! durable bytes and drops it.

use std::collections::BTreeMap;
use std::io;

/// Size of a pending page.
pub const PAGE_BYTES: u64 = 4096;

/// Durable bytes of a file.
pub trait Durable {
    fn durable_len(&self) -> io::Result<u64>;
    /// Reads up to `buf.len()` bytes at `off`; fewer only at the end of the bytes.
    fn read_durable(&self, buf: &mut [u8], off: u64) -> io::Result<usize>;
}

/// Where [`Pending::apply`] makes the bytes durable.
pub trait DurableMut: Durable {
    fn set_durable_len(&mut self, len: u64) -> io::Result<()>;
    fn write_durable(&mut self, data: &[u8], off: u64) -> io::Result<()>;
}

/// Unsynced state of one file.
#[derive(Debug, Clone)]
pub struct Pending {
    /// Page index → `PAGE_BYTES` bytes. Bytes of a page past `len` are zero.
    pages: BTreeMap<u64, Box<[u8]>>,
    /// Logical length.
    len: u64,
    /// Durable bytes at or past this offset are not visible: the file was truncated below it
    /// since the last sync. Always `<= len`.
    low: u64,
}

impl Pending {
    /// No change yet over durable bytes of `durable_len`.
    pub fn new(durable_len: u64) -> Self {
        Self {
            pages: BTreeMap::new(),
            len: durable_len,
            low: durable_len,
        }
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes held in memory.
    pub fn pending_bytes(&self) -> u64 {
        self.pages.len() as u64 * PAGE_BYTES
    }

    /// The page as it reads now, loaded from the durable bytes if it is not pending yet.
    fn page_mut(&mut self, d: &impl Durable, idx: u64) -> io::Result<&mut [u8]> {
        if !self.pages.contains_key(&idx) {
            let mut page = vec![0u8; PAGE_BYTES as usize].into_boxed_slice();
            let start = idx * PAGE_BYTES;
            let visible_end = self.low.min(start + PAGE_BYTES);
            if visible_end > start {
                read_full(d, &mut page[..(visible_end - start) as usize], start)?;
            }
            self.pages.insert(idx, page);
        }
        Ok(self.pages.get_mut(&idx).expect("inserted above"))
    }

    pub fn write(&mut self, d: &impl Durable, off: u64, data: &[u8]) -> io::Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let end = off + data.len() as u64;
        let mut at = off;
        while at < end {
            let idx = at / PAGE_BYTES;
            let in_page = (at % PAGE_BYTES) as usize;
            let n = ((PAGE_BYTES as usize) - in_page).min((end - at) as usize);
            let src = &data[(at - off) as usize..][..n];
            self.page_mut(d, idx)?[in_page..in_page + n].copy_from_slice(src);
            at += n as u64;
        }
        self.len = self.len.max(end);
        Ok(())
    }

    /// ftruncate: shorter drops what lies past `new_len`; longer reads as zeroes.
    pub fn truncate(&mut self, new_len: u64) {
        if new_len < self.len {
            let first_gone = new_len.div_ceil(PAGE_BYTES);
            self.pages.split_off(&first_gone);
            if new_len % PAGE_BYTES != 0 {
                if let Some(page) = self.pages.get_mut(&(new_len / PAGE_BYTES)) {
                    page[(new_len % PAGE_BYTES) as usize..].fill(0);
                }
            }
            self.low = self.low.min(new_len);
        }
        self.len = new_len;
    }

    /// Reads up to `size` bytes at `off` as the file reads now.
    pub fn read(&self, d: &impl Durable, off: u64, size: usize) -> io::Result<Vec<u8>> {
        let end = self.len.min(off.saturating_add(size as u64));
        if off >= end {
            return Ok(Vec::new());
        }
        let mut out = vec![0u8; (end - off) as usize];
        let mut at = off;
        while at < end {
            let idx = at / PAGE_BYTES;
            let in_page = (at % PAGE_BYTES) as usize;
            let n = ((PAGE_BYTES as usize) - in_page).min((end - at) as usize);
            let dst = &mut out[(at - off) as usize..][..n];
            match self.pages.get(&idx) {
                Some(page) => dst.copy_from_slice(&page[in_page..in_page + n]),
                None => {
                    let visible = self.low.saturating_sub(at).min(n as u64) as usize;
                    if visible > 0 {
                        read_full(d, &mut dst[..visible], at)?;
                    }
                }
            }
            at += n as u64;
        }
        Ok(out)
    }

    /// Makes the file's current bytes durable (fsync).
    pub fn apply(&self, d: &mut impl DurableMut) -> io::Result<()> {
        // Durable bytes truncated away must not come back if the file grew again.
        if d.durable_len()? > self.low {
            d.set_durable_len(self.low)?;
        }
        d.set_durable_len(self.len)?;
        for (&idx, page) in &self.pages {
            let start = idx * PAGE_BYTES;
            if start >= self.len {
                break;
            }
            let n = (self.len - start).min(PAGE_BYTES) as usize;
            d.write_durable(&page[..n], start)?;
        }
        Ok(())
    }
}

impl Pending {
    /// What a disk that wrote back some dirty pages before the power went leaves: the pages
    /// `keep` picks reach the durable bytes (growing them if they lie past the end), the rest
    /// and any truncation since the sync do not.
    pub fn apply_some(
        &self,
        d: &mut impl DurableMut,
        mut keep: impl FnMut(u64) -> bool,
    ) -> io::Result<usize> {
        let mut kept = 0;
        for (&idx, page) in &self.pages {
            let start = idx * PAGE_BYTES;
            if start >= self.len || !keep(idx) {
                continue;
            }
            let n = (self.len - start).min(PAGE_BYTES) as usize;
            d.write_durable(&page[..n], start)?;
            kept += 1;
        }
        Ok(kept)
    }
}

/// Reads exactly `buf.len()` durable bytes, zeroes past the end of the durable bytes.
fn read_full(d: &impl Durable, buf: &mut [u8], off: u64) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let n = d.read_durable(&mut buf[done..], off + done as u64)?;
        if n == 0 {
            buf[done..].fill(0);
            break;
        }
        done += n;
    }
    Ok(())
}

impl Durable for std::fs::File {
    fn durable_len(&self) -> io::Result<u64> {
        Ok(self.metadata()?.len())
    }
    fn read_durable(&self, buf: &mut [u8], off: u64) -> io::Result<usize> {
        std::os::unix::fs::FileExt::read_at(self, buf, off)
    }
}

impl DurableMut for std::fs::File {
    fn set_durable_len(&mut self, len: u64) -> io::Result<()> {
        self.set_len(len)
    }
    fn write_durable(&mut self, data: &[u8], off: u64) -> io::Result<()> {
        std::os::unix::fs::FileExt::write_all_at(self, data, off)
    }
}

impl Durable for Vec<u8> {
    fn durable_len(&self) -> io::Result<u64> {
        Ok(self.len() as u64)
    }
    fn read_durable(&self, buf: &mut [u8], off: u64) -> io::Result<usize> {
        let off = (off as usize).min(self.len());
        let n = buf.len().min(self.len() - off);
        buf[..n].copy_from_slice(&self[off..off + n]);
        Ok(n)
    }
}

impl DurableMut for Vec<u8> {
    fn set_durable_len(&mut self, len: u64) -> io::Result<()> {
        self.resize(len as usize, 0);
        Ok(())
    }
    fn write_durable(&mut self, data: &[u8], off: u64) -> io::Result<()> {
        let end = off as usize + data.len();
        if self.len() < end {
            self.resize(end, 0);
        }
        self[off as usize..end].copy_from_slice(data);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Random writes, truncations, reads, syncs and cuts against a plain model: the file as
    /// it reads (`logical`) and as a power cut would leave it (`durable`).
    #[test]
    fn random_operations_read_as_the_model_and_a_cut_keeps_exactly_what_was_synced() {
        for seed in 0..200u64 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let mut durable: Vec<u8> = (0..rng.gen_range(0..20_000u32)).map(|i| i as u8).collect();
            let mut logical = durable.clone();
            let mut pending: Option<Pending> = None;
            for step in 0..300 {
                let p = pending.get_or_insert_with(|| Pending::new(durable.len() as u64));
                match rng.gen_range(0..100) {
                    0..=49 => {
                        let off = rng.gen_range(0..(logical.len() as u64 + 9_000));
                        let len = rng.gen_range(0..10_000usize);
                        let data: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
                        p.write(&durable, off, &data).unwrap();
                        // A write of nothing changes nothing, past the end too.
                        if len > 0 {
                            let end = off as usize + len;
                            if logical.len() < end {
                                logical.resize(end, 0);
                            }
                            logical[off as usize..end].copy_from_slice(&data);
                        }
                    }
                    50..=64 => {
                        let len = rng.gen_range(0..(logical.len() as u64 + 9_000));
                        p.truncate(len);
                        logical.resize(len as usize, 0);
                    }
                    65..=84 => {
                        let off = rng.gen_range(0..(logical.len() as u64 + 100));
                        let size = rng.gen_range(0..12_000usize);
                        let got = p.read(&durable, off, size).unwrap();
                        let lo = (off as usize).min(logical.len());
                        let hi = (off as usize + size).min(logical.len());
                        assert_eq!(got, logical[lo..hi], "seed {seed} step {step}: read");
                    }
                    85..=94 => {
                        p.apply(&mut durable).unwrap();
                        pending = None;
                        assert_eq!(durable, logical, "seed {seed} step {step}: sync");
                    }
                    _ => {
                        pending = None;
                        logical = durable.clone();
                    }
                }
                if let Some(p) = &pending {
                    assert_eq!(
                        p.len(),
                        logical.len() as u64,
                        "seed {seed} step {step}: len"
                    );
                }
            }
        }
    }

    #[test]
    fn a_partial_cut_keeps_whole_pages_of_new_bytes_over_the_durable_ones() {
        let mut durable = vec![1u8; 3 * 4096];
        let mut p = Pending::new(durable.len() as u64);
        p.write(&durable, 0, &[2u8; 4 * 4096]).unwrap();
        p.truncate(4 * 4096 - 100);
        let kept = p.apply_some(&mut durable, |idx| idx % 2 == 1).unwrap();
        assert_eq!(kept, 2);
        assert_eq!(
            durable.len(),
            4 * 4096 - 100,
            "a kept page past the end grows the file"
        );
        assert!(durable[..4096].iter().all(|&b| b == 1));
        assert!(durable[4096..8192].iter().all(|&b| b == 2));
        assert!(durable[8192..12288].iter().all(|&b| b == 1));
        assert!(durable[12288..].iter().all(|&b| b == 2));
    }

    #[test]
    fn a_file_truncated_then_grown_reads_zeroes_and_syncs_them() {
        let mut durable = vec![7u8; 10_000];
        let mut p = Pending::new(10_000);
        p.truncate(100);
        p.truncate(9_000);
        assert_eq!(
            p.read(&durable, 0, 10_000).unwrap()[100..],
            vec![0u8; 8_900][..]
        );
        p.apply(&mut durable).unwrap();
        assert_eq!(durable.len(), 9_000);
        assert!(durable[..100].iter().all(|&b| b == 7));
        assert!(durable[100..].iter().all(|&b| b == 0));
    }
}
