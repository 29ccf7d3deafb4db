//! The on-disk format of a cache volume (docs/format.md is the reader's guide).
//!
//! ```text
//! 0          1 MiB       2 MiB                                   data_offset
//! | config A | config B  | metadata blocks, 2 slots each, 512 B | cache lines ... |
//! ```
//! Config slots hold the superblock: identity, geometry, mode, parameters and the core table, as
//! JSON behind a checksummed header; the newer valid slot wins. Metadata block `i` describes lines
//! `i*E .. (i+1)*E` (E entries per block) and is written alternately to its two slots, so a torn
//! write can only damage the copy being replaced. Every structure carries a crc32c.

use serde::{Deserialize, Serialize};

use crate::bits::Mask;
use crate::meta::{Key, FREE};
use crate::{CacheMode, CoreId, SECTOR};

pub(crate) const MAGIC: &[u8; 8] = b"HYBRIDC\0";
/// Version 2 added the commit records; version 1 volumes are still read (and upgraded on load).
pub(crate) const VERSION: u32 = 2;
/// The oldest format version this build still loads.
pub(crate) const OLDEST_VERSION: u32 = 1;
pub(crate) const CONFIG_SLOT_BYTES: u64 = 1 << 20;
pub(crate) const META_OFFSET: u64 = 2 * CONFIG_SLOT_BYTES;
pub(crate) const BLOCK: usize = SECTOR as usize;
const CONFIG_HEADER: usize = 32;
const BLOCK_HEADER: usize = 32;
const BLOCK_MAGIC: u32 = 0x4d43_4248; // "HBCM" little-endian
const COMMIT_MAGIC: &[u8; 8] = b"HCCOMMIT";

/// Byte offsets of the two commit record slots: the last sector of each config slot. A record
/// with sequence number `seq` goes to slot `seq % 2`.
pub(crate) const COMMIT_SLOTS: [u64; 2] = [
    CONFIG_SLOT_BYTES - BLOCK as u64,
    2 * CONFIG_SLOT_BYTES - BLOCK as u64,
];

/// A core as the superblock records it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct CoreRecord {
    pub id: CoreId,
    /// What the user gave to attach it: a path or a volume URI.
    pub path: String,
    pub size: u64,
    /// Written by us when the core was added; tells two cores on the same path apart in messages.
    pub uuid: String,
    /// What the device is, independently of its path (a disk's WWID or serial, a file's
    /// device and inode), as the daemon found it when the core was added or attached; None
    /// when it could not tell (remote and emulated devices) or the record predates it. A device
    /// at the recorded path with another identity is not this core.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<String>,
}

/// The superblock: everything needed to load a cache except per-line state.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Superblock {
    pub cache_id: u16,
    pub uuid: String,
    /// Ties metadata blocks to this instance of the cache: blocks left by an earlier cache on the
    /// same device carry another nonce and are ignored.
    pub nonce: u64,
    pub line_size: u32,
    pub lines: u32,
    pub data_offset: u64,
    pub meta_blocks: u64,
    pub entries_per_block: u32,
    pub mode: String,
    pub clean_shutdown: bool,
    pub cores: Vec<CoreRecord>,
    /// Policy parameters, by name (reserved for the policies).
    #[serde(default)]
    pub params: serde_json::Map<String, serde_json::Value>,
    /// A mirrored cache's pairing (docs/format.md, "The mirror"); None without a mirror.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mirror: Option<MirrorRecord>,
}

/// Which of a mirrored cache's two devices a superblock is on, and what it knows of the other.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct MirrorRecord {
    /// `primary` or `mirror`.
    pub role: String,
    /// On the primary: the mirror's device as the user named it.
    #[serde(default)]
    pub path: String,
    /// The primary's size in bytes: the geometry a load of the mirror alone must find.
    pub size: u64,
    /// On the primary: the mirror missed writes (it failed, or the cache ran without it) and
    /// is stale.
    #[serde(default)]
    pub lost: bool,
    /// Which pairing of primary and mirror this is: a rebuild onto a new mirror draws a new
    /// one, so a mirror lost earlier (same uuid and nonce) is told apart as stale. 0 for the
    /// pairing made at creation.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub generation: u64,
    /// A smaller mirror: how many cache lines it holds (the first ones, line for line), and
    /// keeps every dirty line among (docs/format.md, "A smaller mirror"). Absent: every line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lines: Option<u32>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl MirrorRecord {
    pub const PRIMARY: &'static str = "primary";
    pub const MIRROR: &'static str = "mirror";
}

impl Superblock {
    /// The recorded cores as an error message names them: `id (path)`, or `none`.
    pub(crate) fn describe_cores(&self) -> String {
        if self.cores.is_empty() {
            return "none".into();
        }
        self.cores
            .iter()
            .map(|c| format!("{} ({})", c.id, c.path))
            .collect::<Vec<_>>()
            .join(", ")
    }

    pub(crate) fn mode(&self) -> Result<CacheMode, String> {
        self.mode.parse()
    }
}

/// Where things are on a cache volume of a given size and line size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub(crate) lines: u32,
    pub(crate) entries_per_block: u32,
    pub(crate) meta_blocks: u64,
    pub(crate) data_offset: u64,
}

pub(crate) fn entry_bytes(sectors_per_line: u32) -> usize {
    8 + 2 * (sectors_per_line as usize / 8)
}

impl Geometry {
    /// Lay out a volume of `size` bytes. None when not even one line fits.
    pub(crate) fn compute(size: u64, line_bytes: u64) -> Option<Geometry> {
        let sectors = (line_bytes / SECTOR) as u32;
        let epb = ((BLOCK - BLOCK_HEADER) / entry_bytes(sectors)) as u32;
        // Start from the most lines that could fit and shrink until metadata and data both fit.
        let mut lines = size.saturating_sub(META_OFFSET) / line_bytes;
        loop {
            if lines == 0 {
                return None;
            }
            let meta_blocks = lines.div_ceil(epb as u64);
            let meta_end = META_OFFSET + meta_blocks * 2 * BLOCK as u64;
            // Lines start on a 1 MiB boundary so data IO stays aligned for any device.
            let data_offset = meta_end.div_ceil(1 << 20) << 20;
            if data_offset + lines * line_bytes <= size {
                let lines = u32::try_from(lines).ok()?;
                return Some(Geometry {
                    lines,
                    entries_per_block: epb,
                    meta_blocks,
                    data_offset,
                });
            }
            let over = (data_offset + lines * line_bytes - size).div_ceil(line_bytes);
            lines = lines.saturating_sub(over.max(1));
        }
    }

    /// How many lines block `block` describes (the last block may be short).
    pub(crate) fn lines_in_block(&self, block: u64) -> usize {
        let epb = self.entries_per_block as u64;
        (self.lines as u64 - block * epb).min(epb) as usize
    }

    /// The metadata blocks in runs of at most `max`: (first block, count). Both copies of a run's
    /// blocks are contiguous on the device, `2 × count × 512` bytes from `slot_offset(first, 0)`.
    pub(crate) fn block_runs(&self, max: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        (0..self.meta_blocks)
            .step_by(max as usize)
            .map(move |b| (b, (self.meta_blocks - b).min(max)))
    }

    pub(crate) fn slot_offset(&self, block: u64, slot: u32) -> u64 {
        META_OFFSET + (block * 2 + slot as u64) * BLOCK as u64
    }
}

/// Encode a config slot: header + JSON body, padded to whole sectors.
pub(crate) fn encode_config(sb: &Superblock, seq: u64) -> Vec<u8> {
    let body = serde_json::to_vec(sb).expect("superblock serialises");
    let len = CONFIG_HEADER + body.len();
    let mut out = vec![0u8; len.div_ceil(BLOCK) * BLOCK];
    out[0..8].copy_from_slice(MAGIC);
    out[8..12].copy_from_slice(&VERSION.to_le_bytes());
    out[16..24].copy_from_slice(&seq.to_le_bytes());
    out[24..28].copy_from_slice(&(body.len() as u32).to_le_bytes());
    out[CONFIG_HEADER..len].copy_from_slice(&body);
    let crc = config_crc(&out[..len]);
    out[12..16].copy_from_slice(&crc.to_le_bytes());
    out
}

pub(crate) fn config_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(&bytes[0..12]);
    crc32c::crc32c_append(crc, &bytes[16..])
}

/// What reading one config slot found.
#[derive(Debug)]
pub(crate) enum ConfigSlot {
    /// No magic: never written by hybridcache (or wiped).
    Empty,
    /// Magic present but the content is not valid; the message says what is wrong.
    Corrupt(String),
    /// An intact superblock of a format version newer than this build reads: written by a
    /// newer hybridcache, not damaged.
    Newer(u32),
    Valid {
        seq: u64,
        sb: Box<Superblock>,
        /// The format version the slot was written with.
        version: u32,
    },
}

/// Decode a config slot from its first bytes; `more` reads further bytes when the body is longer
/// than what was read.
pub(crate) fn decode_config(
    head: &[u8],
    read_more: &mut dyn FnMut(usize) -> Option<Vec<u8>>,
) -> ConfigSlot {
    if head.len() < CONFIG_HEADER || &head[0..8] != MAGIC {
        return ConfigSlot::Empty;
    }
    let version = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes"));
    let unsupported = || {
        ConfigSlot::Corrupt(format!(
            "format version {version} is not supported (this build reads versions {OLDEST_VERSION} to {VERSION})"
        ))
    };
    if version < OLDEST_VERSION {
        return unsupported();
    }
    let body_len = u32::from_le_bytes(head[24..28].try_into().expect("4 bytes")) as usize;
    let len = CONFIG_HEADER + body_len;
    if len as u64 > CONFIG_SLOT_BYTES {
        return ConfigSlot::Corrupt(format!("body length {body_len} is impossible"));
    }
    let owned;
    let bytes = if len <= head.len() {
        &head[..len]
    } else {
        match read_more(len) {
            Some(b) => {
                owned = b;
                &owned[..len]
            }
            None => return ConfigSlot::Corrupt("could not read the body".into()),
        }
    };
    let stored = u32::from_le_bytes(bytes[12..16].try_into().expect("4 bytes"));
    if config_crc(bytes) != stored {
        // A version field beyond ours in a slot that fails its checksum is damage, not a
        // newer build's work: say what the version says, as before.
        return if version > VERSION {
            unsupported()
        } else {
            ConfigSlot::Corrupt("checksum mismatch".into())
        };
    }
    if version > VERSION {
        // The header (magic, version, checksum, sequence, body length) is the one thing every
        // version keeps, so an intact slot of a later version can be told from a damaged one.
        return ConfigSlot::Newer(version);
    }
    let seq = u64::from_le_bytes(bytes[16..24].try_into().expect("8 bytes"));
    match serde_json::from_slice::<Superblock>(&bytes[CONFIG_HEADER..]) {
        Ok(sb) => ConfigSlot::Valid {
            seq,
            sb: Box::new(sb),
            version,
        },
        Err(e) => ConfigSlot::Corrupt(format!("unreadable superblock: {e}")),
    }
}

/// One line's persistent state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) key: Option<Key>,
    pub(crate) valid: Mask,
    pub(crate) dirty: Mask,
}

/// Encode metadata block `index` holding `entries` (at most entries_per_block).
pub(crate) fn encode_block(
    out: &mut [u8],
    index: u64,
    seq: u64,
    nonce: u64,
    mask_bytes: usize,
    entries: &[Entry],
) {
    debug_assert_eq!(out.len(), BLOCK);
    out.fill(0);
    out[4..8].copy_from_slice(&BLOCK_MAGIC.to_le_bytes());
    out[8..16].copy_from_slice(&index.to_le_bytes());
    out[16..24].copy_from_slice(&seq.to_le_bytes());
    out[24..32].copy_from_slice(&nonce.to_le_bytes());
    let size = 8 + 2 * mask_bytes;
    for (i, e) in entries.iter().enumerate() {
        let at = BLOCK_HEADER + i * size;
        let raw = e.key.map_or(FREE, Key::raw);
        out[at..at + 8].copy_from_slice(&raw.to_le_bytes());
        out[at + 8..at + 8 + mask_bytes].copy_from_slice(&e.valid.to_le_bytes()[..mask_bytes]);
        out[at + 8 + mask_bytes..at + size].copy_from_slice(&e.dirty.to_le_bytes()[..mask_bytes]);
    }
    let crc = crc32c::crc32c(&out[4..]);
    out[0..4].copy_from_slice(&crc.to_le_bytes());
}

/// Why a block slot was not usable.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum BlockError {
    Checksum,
    WrongIndex(u64),
    ForeignNonce,
}

/// Decode a block slot into `entries` (cleared first); returns its sequence number.
pub(crate) fn decode_block(
    bytes: &[u8],
    index: u64,
    nonce: u64,
    mask_bytes: usize,
    count: usize,
    entries: &mut Vec<Entry>,
) -> Result<u64, BlockError> {
    let stored = u32::from_le_bytes(bytes[0..4].try_into().expect("4 bytes"));
    if crc32c::crc32c(&bytes[4..BLOCK]) != stored
        || u32::from_le_bytes(bytes[4..8].try_into().expect("4 bytes")) != BLOCK_MAGIC
    {
        return Err(BlockError::Checksum);
    }
    let found = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
    if found != index {
        return Err(BlockError::WrongIndex(found));
    }
    if u64::from_le_bytes(bytes[24..32].try_into().expect("8 bytes")) != nonce {
        return Err(BlockError::ForeignNonce);
    }
    let seq = u64::from_le_bytes(bytes[16..24].try_into().expect("8 bytes"));
    let size = 8 + 2 * mask_bytes;
    entries.clear();
    for i in 0..count {
        let at = BLOCK_HEADER + i * size;
        let raw = u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        let mut v = [0u8; 16];
        let mut d = [0u8; 16];
        v[..mask_bytes].copy_from_slice(&bytes[at + 8..at + 8 + mask_bytes]);
        d[..mask_bytes].copy_from_slice(&bytes[at + 8 + mask_bytes..at + size]);
        entries.push(Entry {
            key: (raw != FREE).then(|| Key::from_raw(raw)),
            valid: Mask::from_le_bytes(v),
            dirty: Mask::from_le_bytes(d),
        });
    }
    Ok(seq)
}

/// The stored checksum of an encoded (or read) metadata block copy.
pub(crate) fn block_crc(bytes: &[u8]) -> u32 {
    u32::from_le_bytes(bytes[0..4].try_into().expect("4 bytes"))
}

/// What one block version adds to a commit's digest. It names the block, its sequence number
/// and (through the block's checksum) its content, so any other version of the block, older or
/// written in another place, changes the sum.
pub(crate) fn digest_term(index: u64, seq: u64, crc: u32) -> u32 {
    let mut b = [0u8; 20];
    b[0..8].copy_from_slice(&index.to_le_bytes());
    b[8..16].copy_from_slice(&seq.to_le_bytes());
    b[16..20].copy_from_slice(&crc.to_le_bytes());
    crc32c::crc32c(&b)
}

/// A commit record: commit `seq` completed, and the metadata it left has `digest` (the sum of
/// every block's [`digest_term`] for the version current after that commit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CommitRecord {
    pub(crate) seq: u64,
    pub(crate) digest: u64,
}

pub(crate) fn encode_commit(rec: CommitRecord, nonce: u64, meta_blocks: u64) -> Vec<u8> {
    let mut out = vec![0u8; BLOCK];
    out[0..8].copy_from_slice(COMMIT_MAGIC);
    out[16..24].copy_from_slice(&rec.seq.to_le_bytes());
    out[24..32].copy_from_slice(&nonce.to_le_bytes());
    out[32..40].copy_from_slice(&meta_blocks.to_le_bytes());
    out[40..48].copy_from_slice(&rec.digest.to_le_bytes());
    let crc = crc32c::crc32c(&out[12..]);
    out[8..12].copy_from_slice(&crc.to_le_bytes());
    out
}

/// What a commit record slot holds.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum CommitSlot {
    /// No magic: never written for this format version, or wiped.
    Empty,
    /// Left by an earlier cache on the same device.
    Foreign,
    Corrupt(String),
    Valid(CommitRecord),
}

pub(crate) fn decode_commit(bytes: &[u8], nonce: u64, meta_blocks: u64) -> CommitSlot {
    if &bytes[0..8] != COMMIT_MAGIC {
        return CommitSlot::Empty;
    }
    let stored = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if crc32c::crc32c(&bytes[12..BLOCK]) != stored {
        return CommitSlot::Corrupt("checksum mismatch".into());
    }
    let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    if word(24) != nonce {
        return CommitSlot::Foreign;
    }
    if word(32) != meta_blocks {
        return CommitSlot::Corrupt(format!(
            "records {} metadata blocks, the superblock {meta_blocks}",
            word(32)
        ));
    }
    CommitSlot::Valid(CommitRecord {
        seq: word(16),
        digest: word(40),
    })
}

/// Whether `volume` holds hybridcache metadata: a config slot that starts with the magic.
pub fn holds_metadata(volume: &dyn hybridcache_volume::Volume) -> crate::Result<bool> {
    let mut buf = vec![0u8; BLOCK];
    for slot in [0, CONFIG_SLOT_BYTES] {
        if volume.size() < slot + BLOCK as u64 {
            continue;
        }
        volume.read_at(&mut buf, slot)?;
        if &buf[..MAGIC.len()] == MAGIC {
            return Ok(true);
        }
    }
    Ok(false)
}

/// `--zero-metadata`: zero both config slots (the superblocks and the commit records), so the
/// volume no longer loads as a cache, and make it durable. The metadata blocks after them are
/// left: without a superblock nothing reads them, and a new cache ties its blocks to its own
/// uuid.
pub fn zero_metadata(volume: &dyn hybridcache_volume::Volume) -> crate::Result<()> {
    let len = META_OFFSET.min(volume.size());
    let zeroes = vec![0u8; 64 << 10];
    let mut at = 0;
    while at < len {
        let n = (len - at).min(zeroes.len() as u64) as usize;
        volume.write_at(&zeroes[..n], at)?;
        at += n as u64;
    }
    volume.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_fits_and_aligns() {
        for line in [4096u64, 65536] {
            for size in [4 << 20, 64 << 20, 1 << 30, (16u64 << 30) + 12345 * 512] {
                let g = Geometry::compute(size, line).expect("fits");
                assert!(g.data_offset % (1 << 20) == 0);
                assert!(g.data_offset + g.lines as u64 * line <= size);
                assert!(g.meta_blocks * g.entries_per_block as u64 >= g.lines as u64);
                assert!(g.slot_offset(g.meta_blocks - 1, 1) + BLOCK as u64 <= g.data_offset);
            }
        }
        assert!(Geometry::compute(2 << 20, 4096).is_none());
    }

    #[test]
    fn blocks_round_trip_and_detect_damage() {
        let entries = vec![
            Entry {
                key: Some(Key::new(3, 77)),
                valid: 0xff,
                dirty: 0x0f,
            },
            Entry {
                key: None,
                valid: 0,
                dirty: 0,
            },
        ];
        let mut buf = vec![0u8; BLOCK];
        encode_block(&mut buf, 9, 5, 42, 1, &entries);
        let mut out = Vec::new();
        assert_eq!(decode_block(&buf, 9, 42, 1, 2, &mut out), Ok(5));
        assert_eq!(out, entries);
        let bad = |buf: &[u8], index, nonce| decode_block(buf, index, nonce, 1, 2, &mut Vec::new());
        assert_eq!(bad(&buf, 8, 42), Err(BlockError::WrongIndex(9)));
        assert_eq!(bad(&buf, 9, 41), Err(BlockError::ForeignNonce));
        buf[100] ^= 1;
        assert_eq!(bad(&buf, 9, 42), Err(BlockError::Checksum));
    }

    #[test]
    fn commit_records_round_trip_and_detect_damage() {
        let rec = CommitRecord {
            seq: 17,
            digest: 0x1234_5678_9abc,
        };
        let mut buf = encode_commit(rec, 42, 3);
        assert_eq!(decode_commit(&buf, 42, 3), CommitSlot::Valid(rec));
        assert_eq!(decode_commit(&buf, 41, 3), CommitSlot::Foreign);
        assert!(matches!(decode_commit(&buf, 42, 4), CommitSlot::Corrupt(_)));
        buf[45] ^= 4;
        assert!(matches!(decode_commit(&buf, 42, 3), CommitSlot::Corrupt(_)));
        assert_eq!(decode_commit(&[0u8; BLOCK], 42, 3), CommitSlot::Empty);
        assert_ne!(digest_term(1, 5, 7), digest_term(1, 4, 7));
        assert_ne!(digest_term(1, 5, 7), digest_term(2, 5, 7));
        assert_ne!(digest_term(1, 5, 7), digest_term(1, 5, 8));
    }
}
