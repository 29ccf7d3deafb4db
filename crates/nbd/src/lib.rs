//! NBD (Network Block Device) server library, plus a small client.
//!
//! **Job.** Serve byte ranges over the NBD protocol (fixed-newstyle
//! handshake, transmission phase per the upstream `doc/proto.md`) to Linux
//! `nbd-client`, qemu, libnbd/nbdkit tools, fio, and to [`client::Client`].
//!
//! **Boundaries.** The crate knows nothing about caching or storage: it
//! serves whatever implements [`Export`] (size, read, write, flush, trim,
//! write-zeroes, cache, block sizes, capability flags). Exports are looked up
//! by name in an [`ExportRegistry`] that can change while the server runs.
//! Not implemented: TLS (`NBD_OPT_STARTTLS` gets `NBD_REP_ERR_UNSUP`), block
//! status / meta contexts, extended headers, resize. Wire parsing lives in
//! [`proto`] as pure functions over byte slices.
//!
//! **Behaviour choices.**
//! - *Unaligned requests.* `NBD_INFO_BLOCK_SIZE` (the export's min /
//!   preferred / max, default 512 / 4096 / 32 MiB) is sent on every
//!   successful `NBD_OPT_INFO`/`NBD_OPT_GO`. The spec binds a client to it
//!   only if it *requested* that info in `NBD_OPT_GO`; such clients get
//!   `EINVAL` for requests not aligned to the minimum block size. Clients that
//!   did not negotiate (including `NBD_OPT_EXPORT_NAME`) may send any
//!   alignment, as the spec's defaults (minimum block size 1) allow: the
//!   server turns unaligned reads into aligned reads, unaligned writes and
//!   write-zeroes into read-modify-write of the partial edge blocks, shrinks
//!   unaligned trims to the whole blocks inside them and widens caches. So
//!   the export only ever sees aligned ranges. RMW is serialised against all
//!   other writes to the same export (a per-export gate: shared for aligned
//!   writes, exclusive for RMW).
//! - *Worker model.* Each connection has up to `workers_per_connection` threads
//!   (default 4), started as its requests need them, sharing one socket; a
//!   connection with nothing in flight and no request for 1 s *parks*: its
//!   threads end and one server-wide poller thread (epoll) watches its socket,
//!   starting a thread for it again when the client sends or hangs up. So idle
//!   connections cost no threads. Nothing is handed between threads on the
//!   fast path: the thread that reads a request usually executes it and
//!   keeps reading ("inline"); requests of kinds that have been slow are run
//!   while another worker takes over reading, and a waiting worker takes over
//!   reading from an inline request that is still running after ~0.5 ms. So
//!   up to `workers_per_connection` requests per connection are in flight and
//!   replies go out in completion order, written whole (header + payload in
//!   one buffer, or a piece at a time for reads over 1 MiB), batched when
//!   several are ready. Request buffers come from a server-wide pool and are
//!   charged to the in-flight budget. With `workers_per_connection = 1`
//!   requests run strictly one at a time.
//! - *Multi-conn.* `NBD_FLAG_CAN_MULTI_CONN` is advertised only when the
//!   export's [`Capabilities::can_multi_conn`] says so; all other
//!   transmission flags likewise come from [`Capabilities`].
//! - *Limits.* Option data over 64 KiB is refused; READ/WRITE over the
//!   maximum block size get `EINVAL` (a rejected write's payload is read and
//!   dropped up to 32 MiB, beyond that the connection is closed); malformed
//!   input closes only the offending connection. Connections are limited in
//!   all, per client and per export, the handshake has a deadline, a client
//!   stalled mid-request is dropped, and request memory is bounded by a
//!   budget with backpressure (see [`ServerConfig`] and memory.rs); refusals
//!   are logged through `tracing`.

pub mod client;
mod export;
mod handshake;
mod memory;
mod observe;
pub mod proto;
mod registry;
mod server;
mod transmission;

pub use client::{Client, ClientConfig, ClientError, ClientResult};
pub use export::{
    BlockSizes, Capabilities, ErrorKind, Export, ExportError, ExportResult, ZeroFlags,
    MAX_BLOCK_LIMIT,
};
pub use observe::{ObservedRequest, RequestKind, RequestObserver};
pub use registry::{ExportRegistry, RegistryError};
pub use server::{unix_peer_credentials, Server, ServerConfig, ShutdownHandle};
pub use transmission::WRITE_DISCARD_LIMIT;
