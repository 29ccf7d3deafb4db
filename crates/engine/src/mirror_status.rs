//! What a mirrored cache shows and is told, as values (mirror.rs holds the pair and its
//! states): the `mirror_lost` policy, the state and status `-L` and `-P` print, and how many
//! cache lines a mirror of a given size covers (docs/format.md, "A smaller mirror"). No state
//! of its own.

/// What a mirrored cache does once its mirror is lost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum MirrorLostPolicy {
    /// Drain the dirty lines to the cores and serve as write-through: nothing acknowledged
    /// depends on one device any more once the drain is done.
    #[default]
    Drain,
    /// Stay write-back, without protection: dirty lines exist on the primary only.
    Keep,
}

impl std::str::FromStr for MirrorLostPolicy {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "drain" => Ok(MirrorLostPolicy::Drain),
            "keep" => Ok(MirrorLostPolicy::Keep),
            other => Err(format!("mirror_lost is `drain` or `keep`, not `{other}`")),
        }
    }
}

impl MirrorLostPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            MirrorLostPolicy::Drain => "drain",
            MirrorLostPolicy::Keep => "keep",
        }
    }
}

/// Whether a mirrored cache still has both devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MirrorState {
    Redundant,
    /// The primary failed: dirty data is served from the mirror, the rest from the cores.
    PrimaryLost,
    /// The mirror failed: dirty data is on the primary only.
    MirrorLost,
    /// A new mirror is being filled (`--attach-mirror`): written like a mirror, not yet
    /// trusted (no superblock on it until the copy is done), so the cache is as unprotected
    /// as with the mirror lost.
    Rebuilding,
    /// A new primary is being filled (`--attach-cache`): it gets the metadata and dirty writes,
    /// but nothing is read from it (no superblock on it until the copy is done), so the cache
    /// serves as with the primary lost, from its mirror.
    RebuildingPrimary,
}

impl MirrorState {
    pub fn as_str(self) -> &'static str {
        match self {
            MirrorState::Redundant => "redundant",
            MirrorState::PrimaryLost => "primary lost",
            MirrorState::MirrorLost => "mirror lost",
            MirrorState::Rebuilding => "rebuilding",
            MirrorState::RebuildingPrimary => "rebuilding primary",
        }
    }
}

/// A mirrored cache's mirror as `-L` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MirrorStatus {
    /// The mirror's device.
    pub device: String,
    pub state: MirrorState,
    pub policy: MirrorLostPolicy,
    /// Why the cache left `redundant`: the failed operation and its error.
    pub reason: Option<String>,
    /// While rebuilding (a new mirror or a new primary): dirty lines copied onto the new
    /// device, and how many there were to copy when the pass began.
    pub rebuild: Option<(u64, u64)>,
    /// The cache lines the mirror covers (every line, or a smaller mirror's first ones):
    /// every dirty line is among them.
    pub lines: u64,
    /// Of those, the dirty ones.
    pub dirty_lines: u64,
    /// What the mirror must hold: the metadata and the lines it covers.
    pub bytes: u64,
}

/// The fewest cache lines a smaller mirror may hold: one round of making room cleans 64
/// lines (write.rs's `make_room`), and fewer would leave writes waiting on every round.
pub const MIN_MIRRORED_LINES: u32 = 64;

/// How many of a cache's `lines` a mirror of `size` bytes holds line for line, after the
/// metadata (`data_offset` bytes).
pub(crate) fn mirrored_lines(size: u64, data_offset: u64, line_bytes: u64, lines: u32) -> u32 {
    (size.saturating_sub(data_offset) / line_bytes).min(lines as u64) as u32
}
