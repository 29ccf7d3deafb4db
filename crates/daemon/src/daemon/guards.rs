//! What a change must not take from others without consent: a device another cache, a mount
//! or a program holds (opened only under an exclusive claim, claims.rs, and never one of this
//! daemon's own exports), and the clients connected to an export that is about to go.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hybridcache_volume::VolumeRef;

use super::Daemon;
use crate::claims::ClaimedVolume;
use crate::devices::open_device;
use crate::nbd_volume::is_nbd_uri;
use crate::safety::Loss;

/// How long a stop or removal waits for clients that are disconnecting before it refuses.
const CLIENT_GONE_GRACE: Duration = Duration::from_secs(2);

impl Daemon {
    /// Open the device `spec` names under an exclusive claim (claims.rs) held as long as the
    /// volume is open. `allow_mounted`: see [`crate::claims::claim`].
    pub(super) fn open_claimed(
        &self,
        spec: &str,
        allow_mounted: bool,
    ) -> std::result::Result<VolumeRef, String> {
        if is_nbd_uri(spec) && self.own.serves(spec) {
            return Err(format!(
                "{spec} is an export of this daemon: a cache cannot use its own export as a device (its I/O would come back into itself and deadlock)"
            ));
        }
        let claim = crate::claims::claim(spec, allow_mounted)?;
        let volume = open_device(spec)?;
        Ok(match claim {
            Some(claim) => Arc::new(ClaimedVolume::new(volume, claim)),
            None => volume,
        })
    }

    /// The in-use guard: taking an export away from connected clients gives them I/O errors
    /// (a mounted file system aborts its journal), so each busy export is a [`Loss`] that needs
    /// `--disconnect-clients`. With `grace`, a client that has just disconnected (still counted
    /// until its connection has wound down on the server's side) is waited for a moment: a
    /// script that disconnects and then stops must not be refused for that.
    pub(super) fn clients_of(&self, exports: &[(String, &'static str)], grace: bool) -> Vec<Loss> {
        let deadline = Instant::now() + CLIENT_GONE_GRACE;
        loop {
            let busy = self.clients_now(exports);
            if busy.is_empty() || !grace || Instant::now() >= deadline {
                return busy;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn clients_now(&self, exports: &[(String, &'static str)]) -> Vec<Loss> {
        exports
            .iter()
            .filter_map(|(name, kind)| {
                let frontend = self.frontends.get(Some(kind)).ok()?;
                let n = frontend.busy(name).unwrap_or(0);
                (n > 0).then(|| Loss::Clients {
                    export: name.clone(),
                    // A block device is named too: that is what the operator sees mounted.
                    block_device: frontend.device(name),
                    connections: n,
                })
            })
            .collect()
    }
}
