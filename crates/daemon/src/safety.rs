//! The management plane's one safety model (issue 30): every command that can destroy something
//! first lists what it would destroy, as [`Loss`] values, and [`decide`] runs it only when the
//! list is empty or the operator gave, for every loss, the [`Consent`] that names exactly that
//! kind of loss. A refusal names each loss with its size and the one flag that accepts it; an
//! accepted loss is logged at WARN and sent back in the reply (`"losses"`) so the CLI prints it.
//!
//! The flags keep casadm's meanings: `--force` on `-R`/`--remove-inactive` removes without
//! flushing (dirty data lost), `-T -n` keeps dirty data on the cache device (no loss: the next
//! `--load` brings it back), `--force` on `-S`/`--zero-metadata` overwrites what the device
//! holds. Connected clients have their own consent, `--disconnect-clients`, the same on every
//! verb with a client check, so the hint of a refusal about clients never points to a flag that
//! also discards data. docs/cli.md ("What a command can destroy") is the table of it all.

use serde::{Deserialize, Serialize};

/// The flag that gives [`Consent::DisconnectClients`] on every verb with a client check.
pub const DISCONNECT_CLIENTS_FLAG: &str = "--disconnect-clients";
/// The flag that gives [`Consent::DiscardDirty`] and [`Consent::Overwrite`], on the verbs that
/// take them.
pub const FORCE_FLAG: &str = "--force";

/// Something a command would destroy, with its size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Loss {
    /// Dirty lines that would never reach their core: acknowledged writes lost.
    DirtyData {
        cache: u16,
        core: u16,
        lines: u64,
        bytes: u64,
    },
    /// Clients connected to an export lose it: their requests fail from then on (a mounted file
    /// system aborts its journal).
    Clients {
        export: String,
        /// The block device clients opened (`/dev/ublkbN`), for front-ends that make one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        block_device: Option<String>,
        connections: usize,
    },
    /// The cache a device holds, overwritten or wiped: it can no longer be loaded, and its
    /// dirty lines (if any) never reach their cores.
    CacheMetadata {
        device: String,
        cache: u16,
        /// Its cores as its superblock records them ("1 (/dev/sdb), 2 (/dev/sdc)").
        #[serde(default)]
        cores: String,
        dirty_lines: u64,
        dirty_bytes: u64,
    },
    /// A file system, partition table or other signature (signature.rs) overwritten.
    Signature { device: String, what: String },
    /// Bytes of a device whose content hybridcache does not know, overwritten.
    DeviceContent { device: String, bytes: u64 },
    /// A mounted block device taken as a core without an exclusive claim: the file system and
    /// the cache both write to it.
    Mounted { device: String, mounts: Vec<String> },
}

/// The consent an operator gives with a flag; each accepts exactly one kind of [`Loss`]
/// (`Overwrite`: whatever a device holds, which the refusal has named).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Consent {
    /// Connected clients lose their export.
    DisconnectClients,
    /// Dirty data is discarded instead of flushed.
    DiscardDirty,
    /// A device's content (a cache, a file system, unknown data) is overwritten.
    Overwrite,
}

impl Consent {
    /// The one CLI flag that gives this consent.
    pub fn flag(self) -> &'static str {
        match self {
            Consent::DisconnectClients => DISCONNECT_CLIENTS_FLAG,
            Consent::DiscardDirty | Consent::Overwrite => FORCE_FLAG,
        }
    }
}

/// A byte count for people ("8.0 MiB").
pub fn size_text(bytes: u64) -> String {
    hybridcache_analyze::units::bytes(bytes)
}

/// A count with thousands separators ("2,048"), as the operator reads them.
pub fn count_text(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn lines_text(lines: u64, bytes: u64) -> String {
    format!(
        "{} dirty line{} ({})",
        count_text(lines),
        if lines == 1 { "" } else { "s" },
        size_text(bytes)
    )
}

impl Loss {
    pub fn consent(&self) -> Consent {
        match self {
            Loss::Clients { .. } => Consent::DisconnectClients,
            Loss::DirtyData { .. } => Consent::DiscardDirty,
            Loss::CacheMetadata { .. }
            | Loss::Signature { .. }
            | Loss::DeviceContent { .. }
            | Loss::Mounted { .. } => Consent::Overwrite,
        }
    }

    /// What would be lost, as a refusal names it.
    pub fn describe(&self) -> String {
        match self {
            Loss::DirtyData {
                cache,
                core,
                lines,
                bytes,
            } => format!(
                "{} of core {core} of cache {cache} would be discarded",
                lines_text(*lines, *bytes)
            ),
            // An NBD export counts connections, not clients: one nbdfuse mount opens 4. A
            // block device (ublk) counts 1 while something holds it: a client, a mount.
            Loss::Clients {
                export,
                block_device: None,
                connections,
            } => format!(
                "{export} has {connections} NBD connection{} open",
                if *connections == 1 { "" } else { "s" }
            ),
            Loss::Clients {
                export,
                block_device: Some(device),
                connections,
            } => format!(
                "{export} ({device}) has {connections} client{} connected",
                if *connections == 1 { "" } else { "s" }
            ),
            Loss::CacheMetadata {
                device,
                cache,
                cores,
                dirty_lines,
                dirty_bytes,
            } => {
                let cores = if cores.is_empty() {
                    "no cores".to_string()
                } else {
                    format!("cores: {cores}")
                };
                if *dirty_lines == 0 {
                    format!("{device} holds cache {cache} ({cores}; clean)")
                } else {
                    format!(
                        "{device} holds cache {cache} ({cores}) with {} not yet on its cores",
                        lines_text(*dirty_lines, *dirty_bytes)
                    )
                }
            }
            Loss::Signature { device, what } => format!("{device} holds {what}"),
            Loss::DeviceContent { device, bytes } => format!(
                "{device} holds no hybridcache metadata, so its first {} would be zeroed",
                size_text(*bytes)
            ),
            Loss::Mounted { device, mounts } => {
                format!("{device} is mounted at {}", mounts.join(", "))
            }
        }
    }

    /// What was lost, as it is printed and logged once accepted.
    pub fn accepted(&self) -> String {
        match self {
            Loss::DirtyData {
                cache,
                core,
                lines,
                bytes,
            } => format!(
                "discarded {} of core {core} of cache {cache}",
                lines_text(*lines, *bytes)
            ),
            Loss::Clients {
                export,
                block_device: None,
                connections,
            } => format!(
                "closed {connections} NBD connection{} of {export}",
                if *connections == 1 { "" } else { "s" }
            ),
            Loss::Clients {
                export,
                block_device: Some(device),
                connections,
            } => format!(
                "disconnected {connections} client{} of {export} ({device})",
                if *connections == 1 { "" } else { "s" }
            ),
            Loss::CacheMetadata {
                device,
                cache,
                dirty_lines,
                dirty_bytes,
                ..
            } => {
                if *dirty_lines == 0 {
                    format!("destroyed cache {cache} on {device} (it was clean)")
                } else {
                    format!(
                        "destroyed cache {cache} on {device} and discarded its {}",
                        lines_text(*dirty_lines, *dirty_bytes)
                    )
                }
            }
            Loss::Signature { device, what } => format!("overwrote {what} on {device}"),
            Loss::DeviceContent { device, bytes } => {
                format!("zeroed the first {} of {device}", size_text(*bytes))
            }
            Loss::Mounted { device, mounts } => format!(
                "took {device}, mounted at {}, without an exclusive claim: the file system and the cache both write to it",
                mounts.join(", ")
            ),
        }
    }

    /// The bytes this loss destroys, where that is known (for the WARN log and scripts).
    pub fn bytes(&self) -> Option<u64> {
        match self {
            Loss::DirtyData { bytes, .. } | Loss::DeviceContent { bytes, .. } => Some(*bytes),
            Loss::CacheMetadata { dirty_bytes, .. } => Some(*dirty_bytes),
            Loss::Clients { .. } | Loss::Signature { .. } | Loss::Mounted { .. } => None,
        }
    }

    /// How the operator can avoid the loss instead of accepting it, where there is a way.
    fn avoid(&self) -> Option<&'static str> {
        match self {
            Loss::Clients { .. } => Some("disconnect them first"),
            Loss::Mounted { .. } => Some("unmount it first"),
            Loss::CacheMetadata { .. } => Some("load it with --load"),
            // Only an inactive core's dirty data is refused (an active core's is flushed
            // unless --force was given): its device must come back to take it.
            Loss::DirtyData { .. } => Some("attach its device again (add-core) and flush it"),
            _ => None,
        }
    }

    /// What the consent's flag accepts, in the refusal's words.
    fn accepts(&self) -> &'static str {
        match self {
            Loss::Clients { .. } => "they lose the export and get I/O errors",
            Loss::DirtyData { .. } => "the dirty data is discarded, not flushed",
            Loss::CacheMetadata { dirty_lines: 0, .. } => "the cache is destroyed",
            Loss::CacheMetadata { .. } => "the cache and its dirty data are destroyed",
            Loss::Signature { .. } => "it is overwritten",
            Loss::DeviceContent { .. } => "it is zeroed",
            Loss::Mounted { .. } => "the cache writes under the mounted file system",
        }
    }
}

/// The consents an operator gave on one command line.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Consents(std::collections::BTreeSet<Consent>);

impl Consents {
    pub fn none() -> Consents {
        Consents::default()
    }

    /// Add `consent` when `given` (the flag was on the command line).
    pub fn with(mut self, consent: Consent, given: bool) -> Consents {
        if given {
            self.0.insert(consent);
        }
        self
    }

    pub fn gives(&self, consent: Consent) -> bool {
        self.0.contains(&consent)
    }
}

/// Run or refuse: `Ok` with the losses the operator accepted (to print and log), or `Err` with
/// the refusal naming every loss not consented to and, for each, how to avoid it and the one
/// flag that accepts it. `what` is the operation as the refusal names it ("removing core 3 of
/// cache 2").
pub fn decide(what: &str, losses: Vec<Loss>, given: &Consents) -> Result<Vec<Loss>, String> {
    let missing: Vec<&Loss> = losses
        .iter()
        .filter(|l| !given.gives(l.consent()))
        .collect();
    if missing.is_empty() {
        return Ok(losses);
    }
    let parts: Vec<String> = missing
        .iter()
        .map(|l| {
            let accept = format!("give {} to accept that {}", l.consent().flag(), l.accepts());
            match l.avoid() {
                Some(avoid) => format!("{}: {avoid}, or {accept}", l.describe()),
                None => format!("{}: {accept}", l.describe()),
            }
        })
        .collect();
    Err(format!(
        "{what} refused, nothing was changed: {}",
        parts.join("; ")
    ))
}

/// Log each accepted loss at WARN and give the reply field the CLI prints.
pub fn record(what: &str, accepted: &[Loss]) -> serde_json::Value {
    for loss in accepted {
        tracing::warn!(
            bytes = loss.bytes().unwrap_or(0),
            "{what}: {} (accepted with {})",
            loss.accepted(),
            loss.consent().flag()
        );
    }
    serde_json::to_value(accepted).unwrap_or(serde_json::Value::Null)
}

/// The lines the CLI prints for the `"losses"` field of a reply (empty when there is none).
pub fn printed(result: &serde_json::Value) -> Vec<String> {
    result
        .get("losses")
        .cloned()
        .and_then(|v| serde_json::from_value::<Vec<Loss>>(v).ok())
        .unwrap_or_default()
        .iter()
        .map(Loss::accepted)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dirty() -> Loss {
        Loss::DirtyData {
            cache: 2,
            core: 3,
            lines: 2048,
            bytes: 8 << 20,
        }
    }

    fn clients() -> Loss {
        Loss::Clients {
            export: "cas2-3".into(),
            block_device: None,
            connections: 4,
        }
    }

    #[test]
    fn nothing_to_lose_runs_without_consent() {
        assert_eq!(decide("x", vec![], &Consents::none()), Ok(vec![]));
    }

    #[test]
    fn a_client_refusal_never_points_to_the_flag_that_discards_data() {
        let e = decide(
            "removing core 3 of cache 2",
            vec![clients()],
            &Consents::none(),
        )
        .unwrap_err();
        assert!(e.contains("cas2-3 has 4 NBD connections open"), "{e}");
        assert!(e.contains("give --disconnect-clients to accept"), "{e}");
        assert!(!e.contains("--force"), "{e}");
    }

    #[test]
    fn two_losses_need_two_consents_and_the_refusal_names_the_missing_one() {
        let force = Consents::none().with(Consent::DiscardDirty, true);
        let e = decide("removing core 3", vec![dirty(), clients()], &force).unwrap_err();
        assert!(e.contains("--disconnect-clients"), "{e}");
        assert!(
            !e.contains("2,048"),
            "the accepted loss is not refused: {e}"
        );
        let both = force.with(Consent::DisconnectClients, true);
        let ok = decide("removing core 3", vec![dirty(), clients()], &both).unwrap();
        assert_eq!(ok.len(), 2);
        assert_eq!(
            ok[0].accepted(),
            "discarded 2,048 dirty lines (8 MiB) of core 3 of cache 2"
        );
    }

    #[test]
    fn losses_round_trip_through_the_reply() {
        let v = serde_json::json!({ "losses": record("t", &[dirty()]) });
        assert_eq!(
            printed(&v),
            vec!["discarded 2,048 dirty lines (8 MiB) of core 3 of cache 2".to_string()]
        );
        assert!(printed(&serde_json::json!({})).is_empty());
    }

    #[test]
    fn counts_have_separators() {
        assert_eq!(count_text(0), "0");
        assert_eq!(count_text(999), "999");
        assert_eq!(count_text(1000), "1,000");
        assert_eq!(count_text(1234567), "1,234,567");
    }
}
